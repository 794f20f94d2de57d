"""Chat against run, side by side: the real chat app driven headless on the real model, with
the prompt `edgespec run` would get, against the same generation without a UI.

    python -m edgespec.tui.bench [-m MODEL] [-p PROMPT] [-n 512] [--spec auto]
                                 [--sizes 80x24,200x50] [--views markdown,marked] [--repeat 2]

For every terminal size and view, `run` and `chat` alternate `--repeat` times (this machine is
shared and noisy: ratios come from runs side by side). Reported: tokens/s of each (the decode
rate of the reply's own stats, as both show it), chat/run (median of the pairs, and their
range), mean accepted length, and the UI
thread's CPU time per second of the reply ("ui", as the stats panel shows it)."""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys

PROMPT = ("Repeat exactly: the quick brown fox jumps over the lazy dog. "
          "The quick brown fox jumps over the lazy dog.")


def run_once(engine, prompt: str, n: int, method: str):
    from edgespec.sampling import SamplingConfig

    gen = engine.start(engine.prompt_tokens(messages=[{"role": "user", "content": prompt}]), n, SamplingConfig(),
                       method)
    for _ in gen:
        pass
    return gen.stats


def chat_once(engine, prompt: str, n: int, method: str, size: tuple[int, int], marked: bool):
    from edgespec.frontends.session import ChatSession
    from edgespec.sampling import SamplingConfig

    from .app import ChatApp, PromptInput

    session = ChatSession(engine, method, SamplingConfig(), n)
    app = ChatApp(session, cursor_blink=False)
    out = {}

    async def drive():
        async with app.run_test(size=size) as pilot:
            if marked:
                await pilot.press("ctrl+t")
            box = app.query_one(PromptInput)
            box.text = prompt
            await pilot.press("enter")
            await pilot.pause(0.05)
            while app.busy:  # as a person waits: no pilot work on the UI thread meanwhile
                await asyncio.sleep(0.1)
            out["stats"], out["ui"] = app.reply_stats, app.ui_share

    asyncio.run(drive())
    return out["stats"], out["ui"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m edgespec.tui.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default="smollm2-135m-instruct:q4_0")
    ap.add_argument("-p", "--prompt", default=PROMPT)
    ap.add_argument("-n", "--n-predict", type=int, default=512)
    ap.add_argument("--spec", default="auto")
    ap.add_argument("-t", "--threads", type=int, default=0)
    ap.add_argument("--sizes", default="80x24,200x50")
    ap.add_argument("--views", default="markdown,marked")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--json", default=None, metavar="FILE", help="also write the rows as JSON")
    a = ap.parse_args(argv)
    from edgespec.engine import Engine, EngineConfig

    sizes = [tuple(int(x) for x in s.split("x")) for s in a.sizes.split(",")]
    views = a.views.split(",")
    engine = Engine(EngineConfig(model=a.model, threads=a.threads), quiet=False)
    rows = []
    try:
        for size in sizes:
            for view in views:
                r_run, r_chat, mal_run, mal_chat, ui = [], [], [], [], []
                for _ in range(a.repeat):
                    st = run_once(engine, a.prompt, a.n_predict, a.spec)
                    r_run.append(st.tokens_per_s)
                    mal_run.append(st.mean_accepted_length)
                    st, share = chat_once(engine, a.prompt, a.n_predict, a.spec, size, view == "marked")
                    r_chat.append(st.tokens_per_s)
                    mal_chat.append(st.mean_accepted_length)
                    ui.append(share or 0.0)
                ratios = [c / r for c, r in zip(r_chat, r_run) if r > 0]
                row = {"size": f"{size[0]}x{size[1]}", "view": view, "run_tok_s": round(statistics.mean(r_run), 1),
                       "chat_tok_s": round(statistics.mean(r_chat), 1),
                       "chat_over_run": round(statistics.median(ratios), 3), "ratio_min": round(min(ratios), 3),
                       "ratio_max": round(max(ratios), 3),
                       "mal_run": round(statistics.mean(mal_run), 2), "mal_chat": round(statistics.mean(mal_chat), 2),
                       "ui_share": round(statistics.mean(ui), 3)}
                rows.append(row)
                print(json.dumps(row), file=sys.stderr)
    finally:
        engine.close()
    print("| size | view | run tok/s | chat tok/s | chat / run, median (min-max) | mean acc. len run / chat | ui |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['size']} | {r['view']} | {r['run_tok_s']} | {r['chat_tok_s']} | {r['chat_over_run']:.2f}x "
              f"({r['ratio_min']:.2f}-{r['ratio_max']:.2f}) | {r['mal_run']} / {r['mal_chat']} | {100 * r['ui_share']:.0f}% |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
