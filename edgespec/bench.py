"""`edgespec bench`: methods measured side by side, interleaved prompt by prompt, in one run.

Speedups are ratios against `none` from the same prompt and repeat, so a noisy shared machine
slows both sides alike. Every greedy output is compared with `none`'s token for token. The
ceiling is what an oracle drafter (always right) could reach on this machine's cost curve.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .errors import EdgespecError
from .sampling import SamplingConfig
from .suites import load_suite

GREEDY = SamplingConfig(temp=0.0)


def geomean(xs: list[float]) -> float:
    xs = [x for x in xs if x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else 0.0


def run_method(eng, tokens: list[int], n: int, method: str):
    """One greedy generation (a seam for tests that need a deliberately broken method)."""
    return eng.start(tokens, n, GREEDY, method).run()


def ceiling(cost, n_past: int, max_rows: int = 32) -> tuple[float, int]:
    """Best speedup of an oracle drafter (every draft token accepted) and its draft length."""
    best, best_k = 1.0, 0
    plain = cost.t(1, n_past)
    for k in range(1, min(max_rows, cost.max_exact_rows)):
        s = (k + 1) * plain / cost.t(k + 1, n_past)
        if s > best:
            best, best_k = s, k
    return best, best_k


def run_bench(a, engine_cfg) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from .runner import Engine

    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    methods = ["none"] + [m for m in methods if m != "none"]
    suite = load_suite(a.suite, a.categories, a.limit)
    if getattr(a, "parallel", None):
        return run_batch_bench(a, engine_cfg, methods, suite)
    eng = Engine(engine_cfg, quiet=False)
    for m in methods:
        if m != "pearl":
            eng.make_drafter(m)  # fail early on a method that cannot run
        elif eng.draft_ctx is None:
            raise EdgespecError("method pearl needs a draft model: pass -md MODEL")
    prompts = []
    for item in suite:
        if "messages" in item:
            toks = eng.prompt_tokens(messages=item["messages"])
        else:
            toks = eng.prompt_tokens(item["prompt"], raw=True)
        prompts.append((item, toks, min(a.n_predict, int(item.get("max_tokens", a.n_predict)))))
    # warm-up: page the weights in and settle the clocks before anything is measured
    run_method(eng, prompts[0][1], 16, "none")

    records: list[dict] = []
    mismatches: list[tuple[str, str]] = []
    total = len(prompts) * len(methods) * a.repeat
    with Progress(TextColumn("bench"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  TextColumn("{task.fields[info]}"), transient=True, console=_stderr_console()) as prog:
        task = prog.add_task("bench", total=total, info="")
        for item, toks, n in prompts:
            for rep in range(a.repeat):
                ref = None
                for m in methods:  # interleaved: A B C A B C ...
                    g = run_method(eng, toks, n, m)
                    if m == "none":
                        ref = g.tokens
                    match = g.tokens == ref
                    if not match:
                        mismatches.append((item["id"], m))
                        prog.console.print(f"[bold red]MISMATCH[/]: {m} output differs from none on {item['id']}")
                    records.append({"id": item["id"], "category": item["category"], "method": m, "repeat": rep,
                                    "match": match, **g.stats.to_dict()})
                    prog.update(task, advance=1, info=f"{item['id']} {m} {g.stats.tokens_per_s:.0f} tok/s")
                if getattr(a, "llama_cpp_bin", None):  # interleaved too, right after ours
                    records.extend(run_llama_cpp(a.llama_cpp_bin, eng, [(item, toks, n)], engine_cfg, rep))

    order = methods + sorted({r["method"] for r in records} - set(methods), reverse=True)
    n_past = int(sum(len(t) for _, t, _ in prompts) / len(prompts))
    report = summarize(records, order, eng.cost, n_past)
    report["config"] = {
        "model": engine_cfg.model, "draft": engine_cfg.draft, "threads": eng.ctx.n_threads, "kv_type": engine_cfg.kv_type,
        "n_predict": a.n_predict, "repeat": a.repeat, "suite": a.suite or "built-in", "prompts": len(prompts),
        "methods": methods,
    }
    report["mismatches"] = mismatches
    print(render_markdown(report))
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.json").write_text(json.dumps({**report, "records": records}, indent=1))
        chart = write_charts(report, records, out / "report.png")
        print(f"\nreport: {out / 'report.json'}" + (f", {chart}" if chart else " (charts need matplotlib: pip install 'edgespec[bench]')"),
              file=sys.stderr)
    if mismatches:
        print(f"edgespec: error: {len(mismatches)} outputs differ from plain greedy decoding: "
              + ", ".join(f"{m} on {i}" for i, m in mismatches[:5]), file=sys.stderr)
        return 3
    return 0


def _stderr_console():
    from rich.console import Console

    return Console(file=sys.stderr)


def summarize(records: list[dict], methods: list[str], cost, n_past: int) -> dict:
    base = {(r["id"], r["repeat"]): r for r in records if r["method"] == "none"}
    llama_base = {(r["id"], r["repeat"]): r for r in records if r["method"] == "llama.cpp:completion"}
    cats = sorted({r["category"] for r in records})
    top, top_k = ceiling(cost, n_past)
    rows = []
    for m in methods:
        mine = [r for r in records if r["method"] == m]
        for cat in cats + ["all"]:
            sel = [r for r in mine if cat == "all" or r["category"] == cat]
            if not sel:
                continue
            sp = [_tps(r) / _tps(base[(r["id"], r["repeat"])]) for r in sel
                  if _tps(r) > 0 and _tps(base.get((r["id"], r["repeat"]), {})) > 0]
            drafted = sum(r.get("n_drafted", 0) for r in sel)
            accepted = sum(r.get("n_accept", 0) for r in sel)
            steps = sum(r.get("n_steps", 0) for r in sel)
            gen = sum(r["n_generated"] for r in sel)
            tgen = sum(r.get("t_gen", 0.0) for r in sel)
            d_at = _sum_lists([r.get("drafted_at", []) for r in sel])
            a_at = _sum_lists([r.get("accepted_at", []) for r in sel])
            speed = geomean(sp) if sp else None
            # llama.cpp's tools against llama.cpp's own plain decoding: the drafting alone,
            # without the difference between the two runtimes' plain speeds
            own = llama_base if m.startswith("llama.cpp:") else base
            osp = [_tps(r) / _tps(own[(r["id"], r["repeat"])]) for r in sel
                   if _tps(r) > 0 and _tps(own.get((r["id"], r["repeat"]), {})) > 0]
            rows.append({
                "method": m, "category": cat, "prompts": len(sel),
                "tokens_per_s": round(geomean([_tps(r) for r in sel]), 1),
                "speedup": _r(speed), "speedup_min": _r(min(sp) if sp else None), "speedup_max": _r(max(sp) if sp else None),
                "speedup_own_plain": _r(geomean(osp) if osp else None),
                "efficiency": _r(speed / top if speed and top > 0 else None),
                "acceptance_rate": _r(accepted / drafted if drafted else None),
                "mean_accepted_length": _r(gen / steps if steps else None),
                "acceptance_by_position": [round(x / y, 3) if y else 0.0 for x, y in zip(a_at + [0] * len(d_at), d_at)],
                "accepted_len_hist": _sum_lists([r.get("accepted_len_hist", []) for r in sel]),
                "draft_share": _r(sum(r.get("t_draft", 0.0) for r in sel) / tgen if tgen and "t_draft" in sel[0] else None),
                "verify_share": _r(sum(r.get("t_verify", 0.0) for r in sel) / tgen if tgen and "t_verify" in sel[0] else None),
                # llama.cpp's outputs are not compared (None): its text is printed, not its tokens
                "all_match": None if all(r.get("match") is None for r in sel) else all(r.get("match", True) for r in sel),
            })
    return {"summary": rows, "cost_ms": cost.to_dict(),
            "ceiling": {"speedup": round(top, 3), "draft_len": top_k, "n_past": n_past}}


def _tps(record: dict) -> float:
    """A run's tokens/s; 0 when it has none (a llama.cpp run whose output could not be parsed)."""
    return record.get("tokens_per_s") or 0.0


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def _sum_lists(lists: list[list[int]]) -> list[int]:
    out: list[int] = []
    for xs in lists:
        for i, x in enumerate(xs):
            if i >= len(out):
                out.append(0)
            out[i] += x
    return out


def render_markdown(report: dict) -> str:
    c = report["ceiling"]
    lines = [
        f"Oracle ceiling on this machine: {c['speedup']:.2f}x (draft {c['draft_len']}, {c['n_past']} tokens of context).",
        "",
        "| method | category | prompts | tok/s | speedup (min-max) | vs own plain | efficiency | acceptance | "
        "mean acc. len | acc. by position | draft / verify time | output = none |",
        "|" + "---|" * 12,
    ]
    for r in report["summary"]:
        sp = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x ({r['speedup_min']:.2f}-{r['speedup_max']:.2f})"
        eff = "-" if r["efficiency"] is None else f"{100 * r['efficiency']:.0f}%"
        acc = "-" if r["acceptance_rate"] is None else f"{100 * r['acceptance_rate']:.0f}%"
        mal = "-" if r["mean_accepted_length"] is None else f"{r['mean_accepted_length']:.2f}"
        pos = " ".join(f"{100 * x:.0f}" for x in r["acceptance_by_position"][:4]) or "-"
        share = "-" if r["draft_share"] is None or r["verify_share"] is None else f"{100 * r['draft_share']:.0f}% / {100 * r['verify_share']:.0f}%"
        ok = "not checked" if r["all_match"] is None else "yes" if r["all_match"] else "**NO**"
        own = "-" if r.get("speedup_own_plain") is None else f"{r['speedup_own_plain']:.2f}x"
        lines.append(f"| {r['method']} | {r['category']} | {r['prompts']} | {r['tokens_per_s']:.1f} | {sp} | {own} | {eff} | "
                     f"{acc} | {mal} | {pos} | {share} | {ok} |")
    return "\n".join(lines)


def write_charts(report: dict, records: list[dict], path: Path) -> Path | None:
    """Speedup by method and category; accepted-length histograms. Needs matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = [r for r in report["summary"] if r["speedup"] is not None and r["method"] != "none"]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    cats = list(dict.fromkeys(r["category"] for r in rows))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [3, 2]})
    width = 0.8 / max(1, len(methods))
    for i, m in enumerate(methods):
        vals = [next((r["speedup"] for r in rows if r["method"] == m and r["category"] == c), 0) for c in cats]
        ax1.bar([j + i * width for j in range(len(cats))], vals, width, label=m)
    ax1.axhline(1.0, color="black", lw=0.8)
    ax1.axhline(report["ceiling"]["speedup"], color="grey", ls="--", lw=0.8, label="oracle ceiling")
    ax1.set_xticks([j + width * (len(methods) - 1) / 2 for j in range(len(cats))], cats, rotation=30, ha="right", fontsize=8)
    ax1.set_ylabel("speedup over none (same run)")
    ax1.set_title("speedup by method and category (geometric mean)")
    ax1.legend(fontsize=8)
    for m in methods:
        row = next((r for r in report["summary"] if r["method"] == m and r["category"] == "all"), None)
        hist = row.get("accepted_len_hist", []) if row else []
        if sum(hist):
            xs = list(range(len(hist)))
            ax2.plot(xs, [h / sum(hist) for h in hist], marker="o", label=m)
    ax2.set_xlabel("tokens committed per target step")
    ax2.set_ylabel("share of steps")
    ax2.set_title("accepted length per step")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


_EVAL = re.compile(r"eval time =\s*([\d.]+) ms /\s*(\d+) (?:runs|tokens)")
_DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")


def run_llama_cpp(bin_dir: str, eng, prompts, cfg, repeat: int = 0) -> list[dict]:
    """llama.cpp's own llama-completion (plain) and llama-lookup on the same formatted prompts."""
    bind = Path(bin_dir)
    rows = []
    for item, toks, n in prompts:
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
            f.write(eng.target.detokenize(toks, special=True))
            pf = f.name
        try:
            for name, exe, extra in (("llama.cpp:completion", "llama-completion", ["-no-cnv"]),
                                     ("llama.cpp:lookup", "llama-lookup", [])):
                path = bind / exe
                if not path.exists():
                    raise EdgespecError(f"{path} not found (build it with shared/tools/build-llama-cpp-tools.sh)")
                cmd = [str(path), "-m", str(eng.target.path), "-f", pf, "-n", str(n), "--temp", "0",
                       "-t", str(eng.ctx.n_threads), "-c", str(eng.ctx.n_ctx), "-ctk", cfg.kv_type, "-ctv", cfg.kv_type,
                       *extra]
                t0 = time.perf_counter()
                r = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=600)
                tps = parse_eval_tps(r.stderr + r.stdout)
                if tps is None:
                    tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
                    print(f"edgespec: {exe} gave no timing on {item['id']}: {tail}", file=sys.stderr)
                    continue
                rows.append({"id": item["id"], "category": item["category"], "method": name, "repeat": repeat,
                             "tokens_per_s": tps, "n_generated": parse_eval_count(r.stderr + r.stdout),
                             "wall_s": time.perf_counter() - t0, "match": None})
        finally:
            os.unlink(pf)
    return rows


def parse_eval_count(text: str) -> int | None:
    """Tokens decoded one by one, as llama.cpp counts them (its `N runs` / `decoded N tokens`)."""
    m = _DECODED.search(text)
    if m:
        return int(m.group(1))
    for line in text.splitlines():
        m = _EVAL.search(line)
        if m and "prompt eval time" not in line:
            return int(m.group(2))
    return None


def parse_eval_tps(text: str) -> float | None:
    """Decode tokens/s as llama.cpp prints it: llama-lookup's `decoded N tokens in X seconds`,
    else the `eval time = X ms / N runs` line (prompt eval excluded)."""
    m = _DECODED.search(text)
    if m:
        n, sec = int(m.group(1)), float(m.group(2))
        return n / sec if sec > 0 else None
    for line in text.splitlines():
        if "prompt eval time" in line:
            continue
        m = _EVAL.search(line)
        if m:
            ms, runs = float(m.group(1)), int(m.group(2))
            return runs / (ms / 1e3) if ms > 0 else None
    return None


def parse_parallel(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        vals = []
    if not vals or any(v < 1 or v > 64 for v in vals):
        raise EdgespecError(f"--parallel takes sequence counts from 1 to 64, comma-separated (got {text!r})")
    return sorted(set(vals))


def run_batch_bench(a, engine_cfg, methods: list[str], suite: list[dict]) -> int:
    """Batch throughput: the whole suite as one batch per (sequences per decode, method), rounds
    rotated so that drift on a shared machine hits every cell alike. Greedy outputs are compared
    with `none` at one sequence."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from .batch import Request, run_requests
    from .runner import Engine

    nps = parse_parallel(a.parallel)
    if max(nps) > 1:
        from .multi import METHODS

        bad = [m for m in methods if m not in METHODS]
        if bad:
            raise EdgespecError(f"method {bad[0]} decodes one sequence at a time; --parallel above 1 takes none, "
                                "ngram, lookahead, auto")
    eng = Engine(engine_cfg, quiet=False)
    reqs = []
    for i, item in enumerate(suite):
        n = min(a.n_predict, int(item.get("max_tokens", a.n_predict)))
        if "messages" in item:
            reqs.append(Request(i + 1, item["id"], messages=item["messages"], max_tokens=n, sampling=GREEDY))
        else:
            reqs.append(Request(i + 1, item["id"], url="/v1/completions", prompt=item["prompt"], max_tokens=n,
                                sampling=GREEDY))
    run_requests(eng, reqs[:1], "none", 1, lambda r, rec: None, quiet=True)  # warm-up
    cells = [(p, m) for p in nps for m in methods]
    results: dict = {c: [] for c in cells}
    ref: dict = {}
    mismatches = []
    with Progress(TextColumn("bench"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  TextColumn("{task.fields[info]}"), transient=True, console=_stderr_console()) as prog:
        task = prog.add_task("bench", total=len(cells) * a.repeat, info="")
        for rep in range(a.repeat):
            k = rep % len(cells)
            for p, m in cells[k:] + cells[:k]:
                tot = run_requests(eng, reqs, m, p, lambda r, rec: None, quiet=True)
                results[(p, m)].append(tot)
                if (p, m) == (nps[0], "none") and not ref:
                    ref = dict(tot.outputs)
                prog.update(task, advance=1, info=f"-np {p} {m}: {tot.throughput:.1f} tok/s")
        for (p, m), tots in results.items():
            for tot in tots:
                for cid, toks in tot.outputs.items():
                    if ref and ref.get(cid) != toks:
                        mismatches.append((cid, f"{m} -np {p}"))
    base = results[(nps[0], "none")]
    rows = []
    for p, m in cells:
        tots = results[(p, m)]
        sp = [t.throughput / b.throughput for t, b in zip(tots, base) if b.throughput > 0]
        drafted, accepted = sum(t.drafted for t in tots), sum(t.accepted for t in tots)
        steps, out = sum(t.steps for t in tots), sum(t.tokens_out for t in tots)
        dsp = [t.decode_throughput / b.decode_throughput for t, b in zip(tots, base) if b.decode_throughput > 0]
        rows.append({"parallel": p, "method": m, "tokens_per_s": round(geomean([t.throughput for t in tots]), 1),
                     "speedup": _r(geomean(sp)),
                     "decode_tokens_per_s": round(geomean([t.decode_throughput for t in tots]), 1),
                     "decode_speedup": _r(geomean(dsp)), "prompt_s": round(sum(t.t_prompt for t in tots) / len(tots), 2), "wall_s": round(sum(t.wall for t in tots) / len(tots), 2),
                     "acceptance_rate": _r(accepted / drafted if drafted else None),
                     "mean_accepted_length": _r(out / steps if steps else None),
                     "failed": sum(t.failed for t in tots)})
    print(f"Batch throughput: {len(reqs)} requests per batch, {results[cells[0]][0].tokens_in} prompt tokens, {results[cells[0]][0].tokens_out} generated per batch; "
          f"speedup against -np {nps[0]} none, same round.\n")
    print("| -np | method | tokens/s out | speedup | generating: tokens/s | speedup | wall s | of which prompts | "
          "acceptance | mean acc. len | failed |")
    print("|" + "---|" * 11)
    for r in rows:
        acc = "-" if r["acceptance_rate"] is None else f"{100 * r['acceptance_rate']:.0f}%"
        mal = "-" if r["mean_accepted_length"] is None else f"{r['mean_accepted_length']:.2f}"
        print(f"| {r['parallel']} | {r['method']} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x | "
              f"{r['decode_tokens_per_s']:.1f} | {r['decode_speedup']:.2f}x | {r['wall_s']:.1f} | {r['prompt_s']:.1f} | "
              f"{acc} | {mal} | {r['failed']} |")
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        report = {"batch": rows, "config": {"model": engine_cfg.model, "threads": eng.ctx.n_threads,
                                            "kv_type": engine_cfg.kv_type, "n_predict": a.n_predict,
                                            "repeat": a.repeat, "suite": a.suite or "built-in",
                                            "requests": len(reqs), "parallel": nps, "methods": methods},
                  "mismatches": mismatches}
        (out / "report.json").write_text(json.dumps(report, indent=1))
        print(f"\nreport: {out / 'report.json'}", file=sys.stderr)
    eng.close()
    if mismatches:
        print(f"edgespec: error: {len(mismatches)} outputs differ from plain greedy decoding: "
              + ", ".join(f"{m} on {i}" for i, m in mismatches[:5]), file=sys.stderr)
        return 3
    return 0
