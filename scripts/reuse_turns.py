"""Five chat turns through the chat session, each turn's time to first token with the KV cache
reset every turn (before) and kept (after, KV reuse), side by side.

    python scripts/reuse_turns.py -m smollm2-135m-instruct:q4_0
    python scripts/reuse_turns.py -m qwen2.5-coder-1.5b-instruct --repeats 2 --json out.json

Each conversation runs once with `--no-reuse` semantics and once with reuse, alternated
`--repeats` times; a turn's prompt time is the prologue (reading the prompt and picking the
first token), its time to first token the wall time from `send` to the first token's event.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from edgespec.engine import Engine, EngineConfig
from edgespec.frontends.session import ChatSession
from edgespec.sampling import SamplingConfig

TURNS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Add type hints and a docstring to it.",
    "Now write three pytest tests for it.",
    "Make it ignore case and punctuation.",
    "Show the final version once more.",
]


def conversation(engine: Engine, method: str, n: int, reuse: bool) -> list[dict]:
    s = ChatSession(engine, method, SamplingConfig(temp=0.0), n, reuse=reuse)
    engine.kv.reset()  # every conversation starts cold
    out = []
    for text in TURNS:
        first: list[float] = []
        t0 = time.perf_counter()
        r = s.send(text, lambda ev, piece: first.append(time.perf_counter()) if not first else None)
        st = r.stats
        out.append({"ttft_s": round(first[0] - t0, 4), "prompt_s": round(st.t_prompt, 4), "n_prompt": st.n_prompt,
                    "n_cached": st.n_prompt_cached, "n_read": st.n_prompt_eval, "n_out": st.n_generated,
                    "tokens": r.tokens})
        print(f"  {'after ' if reuse else 'before'} turn {len(out)}: {st.n_prompt} prompt tokens, "
              f"{st.n_prompt_eval} read in {st.t_prompt:.3f} s, first token after {first[0] - t0:.3f} s", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default="smollm2-135m-instruct:q4_0")
    ap.add_argument("--spec", default="none")
    ap.add_argument("-n", type=int, default=160, help="tokens per reply (default: %(default)s)")
    ap.add_argument("-c", "--ctx", type=int, default=4096)
    ap.add_argument("-t", "--threads", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--json", default=None, help="write every run's numbers here")
    a = ap.parse_args()
    eng = Engine(EngineConfig(model=a.model, n_ctx=a.ctx, threads=a.threads))
    runs: dict[str, list[list[dict]]] = {"before": [], "after": []}
    try:
        for _ in range(a.repeats):
            runs["before"].append(conversation(eng, a.spec, a.n, reuse=False))
            runs["after"].append(conversation(eng, a.spec, a.n, reuse=True))
    finally:
        eng.close()
    med = lambda key, mode, t: statistics.median(r[t][key] for r in runs[mode])  # noqa: E731
    print(f"{a.model}, --spec {a.spec}, {a.n} tokens per reply, median of {a.repeats} (before: cache reset every "
          f"turn; after: KV reuse)")
    print("turn  prompt tokens  read after   prompt s before  after   TTFT s before  after   same text")
    for t in range(len(TURNS)):
        b, f = runs["before"][0][t], runs["after"][0][t]
        same = all(r[t]["tokens"] == b["tokens"] for r in runs["before"] + runs["after"])
        print(f"{t + 1:4d}  {b['n_prompt']:13d}  {f['n_read']:10d}   {med('prompt_s', 'before', t):15.3f}  "
              f"{med('prompt_s', 'after', t):5.3f}   {med('ttft_s', 'before', t):13.3f}  {med('ttft_s', 'after', t):5.3f}"
              f"   {'yes' if same else 'NO'}")
    p1, p5 = med("prompt_s", "after", 0), med("prompt_s", "after", len(TURNS) - 1)
    print(f"after: turn {len(TURNS)}'s prompt time is {p5 / p1:.2f}x turn 1's "
          f"(before: {med('prompt_s', 'before', len(TURNS) - 1) / med('prompt_s', 'before', 0):.2f}x)")
    if a.json:
        for mode in runs.values():
            for conv in mode:
                for turn in conv:
                    turn.pop("tokens")
        with open(a.json, "w") as f:
            json.dump({"model": a.model, "spec": a.spec, "n": a.n, "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
