"""`edgespec bench`: methods measured side by side, interleaved prompt by prompt, in one run.

Speedups are ratios against `none` from the same prompt and repeat, so a noisy shared machine
slows both sides alike. Every greedy output is compared with `none`'s token for token. The
ceiling is what an oracle drafter (always right) could reach on this machine's cost curve.
`stats`: the summary; `report`: Markdown and charts; `llamacpp`: llama.cpp's own tools.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

from ... import methods as registry
from ...errors import EdgespecError
from ...events import Stats
from ...sampling import SamplingConfig
from ..console import stderr_console
from ..options import BenchOptions
from .llamacpp import run_llama_cpp, same_answer
from .report import render_markdown, write_charts
from .stats import geomean, summarize, _r
from ...suites import load_suite

GREEDY = SamplingConfig(temp=0.0)

LLAMA_CPP = "llama.cpp"  # the entry of llama.cpp's tools in a repeat's order
MAX_ROUNDS = 16  # rounds of a repeat at most (--min-time)


def merge_runs(runs: list) -> dict:
    """One record for a repeat's rounds of a method: counts and times summed, rates from the
    sums (each run's first token comes with its prompt, so it is left out of each)."""
    total = Stats()
    for st in runs:
        total.merge(st)
    rec = total.to_dict()
    gen = sum(max(0, st.n_generated - 1) for st in runs)
    rec["tokens_per_s"] = round(gen / total.t_gen, 2) if total.t_gen > 0 and gen else 0.0
    rec["finish_reason"] = runs[0].finish_reason
    rec["runs"] = len(runs)
    return rec


def merge_llama_runs(runs: list[dict]) -> dict:
    """llama.cpp's records of a repeat's rounds for one tool: the first run's fields, its rates
    from the summed times (a run's time: its tokens over its rate) and whether every run kept
    llama.cpp's own plain answer."""
    rec = dict(runs[0])
    if len(runs) > 1:
        for key, count in (("tokens_per_s", "n_generated"), ("eval_tokens_per_s", "n_generated")):
            rates = [(r.get(count) or 1, r.get(key)) for r in runs]
            if all(v for _, v in rates):
                rec[key] = round(sum(c for c, _ in rates) / sum(c / v for c, v in rates), 2)
        rec["wall_s"] = sum(r.get("wall_s", 0.0) for r in runs)
        if any("same_as_own_plain" in r for r in runs):
            rec["same_as_own_plain"] = all(r.get("same_as_own_plain", True) for r in runs)
        rec["runs"] = len(runs)
    return rec


def run_method(eng, tokens: list[int], n: int, method: str, reuse: bool = False):
    """One greedy generation (a seam for tests that need a deliberately broken method)."""
    return eng.start(tokens, n, GREEDY, method, reuse=reuse).run()


def read_prompt_once(eng, tokens: list[int]) -> None:
    """--reuse: read all of a prompt but its last token into the target's cache once; every
    method then starts from it and reads only the last token (one row, the same for all of them),
    so a long prompt is not read again per method. Generation rates do not include the prompt's
    reading either way."""
    run_method(eng, tokens[:-1], 1, "none", reuse=False)


def run_curve(cost, ratios: list[tuple[float, ...]]):
    """The cost curve the ceilings are computed on: its online correction (measured against
    predicted, for one row and for many) averaged over the run, not as the last decodes left it
    (an average over the last ~20 decodes: the same cached curve gave ceilings of 1.70x to 2.22x
    from one run to the next here, depending on how the machine was loaded as each run ended)."""
    if not ratios:
        return cost
    curve = copy.copy(cost)
    curve.ratio = [sum(r[i] for r in ratios) / len(ratios) for i in range(len(ratios[0]))]
    return curve


def run_bench(a: BenchOptions, engine_cfg) -> int:
    from ...engine import Engine

    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    methods = ["none"] + [m for m in methods if m != "none"]
    for m in methods:
        method = registry.get(m)  # an unknown name: one clear line
        if method.needs_draft_model and not engine_cfg.draft:
            raise EdgespecError(f"method {m} needs a draft model: pass -md MODEL")
    suite = load_suite(a.suite, a.categories, a.limit)
    if a.parallel:
        return run_batch_bench(a, engine_cfg, methods, suite)
    eng = Engine(engine_cfg, quiet=False)
    try:
        return _run_sequential(a, engine_cfg, eng, methods, suite)
    finally:
        eng.close()  # writes back what the cost curve's correction and auto's gates learned


def _run_sequential(a: BenchOptions, engine_cfg, eng, methods: list[str], suite: list[dict]) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

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
    ratios: list[tuple[float, ...]] = []  # the cost curve's online correction after each run
    texts: dict[str, tuple[str, list[int], list[int]]] = {}  # id -> (category, prompt, plain output)
    total = len(prompts) * len(methods) * a.repeat
    with Progress(TextColumn("bench"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  TextColumn("{task.fields[info]}"), transient=True, console=stderr_console()) as prog:
        task = prog.add_task("bench", total=total, info="")
        llama_cpp = [LLAMA_CPP] if a.llama_cpp_bin else []
        min_time = a.min_time
        reuse = a.reuse
        for item, toks, n in prompts:
            if reuse:
                read_prompt_once(eng, toks)
            for rep in range(a.repeat):
                # interleaved (A B C A B C ...), the order rotated from one repeat (and round) to
                # the next, so that no method always runs first or right after another (llama.cpp's
                # tools count as one entry). A short answer runs in several rounds, until plain
                # decoding has generated for `min_time`: one hiccup of a shared machine is tens of
                # percent of a 15-token answer's 0.1 s.
                outputs, stable, cells, theirs_cells = {}, {}, {}, {}
                plain_time, rnd = 0.0, 0
                while True:
                    order = methods + llama_cpp
                    k = (rep + rnd) % len(order)
                    for m in order[k:] + order[:k]:
                        if m == LLAMA_CPP:
                            for rec in run_llama_cpp(a.llama_cpp_bin, eng, [(item, toks, n)], engine_cfg, rep,
                                                     a.llama_cpp_kv):
                                theirs_cells.setdefault(rec["method"], []).append(rec)
                            continue
                        g = run_method(eng, toks, n, m, reuse=reuse)
                        ratios.append(tuple(eng.cost.ratio))
                        # every round's output must be the same (and equal to none's)
                        stable[m] = stable.get(m, True) and g.tokens == outputs.setdefault(m, g.tokens)
                        cells.setdefault(m, []).append(g.stats)
                        if m == "none":
                            plain_time += g.stats.t_gen
                        prog.update(task, info=f"{item['id']} {m} {g.stats.tokens_per_s:.0f} tok/s")
                    rnd += 1
                    if plain_time >= min_time or rnd >= MAX_ROUNDS:
                        break
                step = [{"id": item["id"], "category": item["category"], "method": m, "repeat": rep,
                         **merge_runs(cells[m])} for m in methods]
                theirs = [merge_llama_runs(rs) for rs in theirs_cells.values()]
                prog.update(task, advance=len(methods))
                ref = outputs.get("none")
                if ref is not None and item["id"] not in texts:
                    texts[item["id"]] = (item["category"], toks, list(ref))
                # llama.cpp's text: the same as ours when its answer is our plain answer (another
                # KV cache type may change the answer: then its tokens/s is for another text)
                ref_text = eng.target.detokenize(ref).strip() if ref is not None else None
                for rec in theirs:
                    out, ans = rec.pop("stdout", ""), rec.pop("answer", None)
                    match = None if ref_text is None else same_answer(ref_text, ans) if ans is not None else ref_text in out
                    records.append({**rec, "match": match})
                for rec in sorted(step, key=lambda r: methods.index(r["method"])):
                    m = rec["method"]
                    match = outputs[m] == ref and stable[m] and stable["none"]
                    if not match:
                        mismatches.append((item["id"], m))
                        prog.console.print(f"[bold red]MISMATCH[/]: {m} output differs from none on {item['id']}")
                    records.append({**rec, "match": match})

    order = methods + sorted({r["method"] for r in records} - set(methods), reverse=True)
    n_past = int(sum(len(t) for _, t, _ in prompts) / len(prompts))
    report = summarize(records, order, run_curve(eng.cost, ratios), n_past, limit=eng.max_verify_rows, texts=texts)
    report["exactness"] = eng.exactness_info()
    report["config"] = {
        "model": engine_cfg.model, "draft": engine_cfg.draft, "threads": eng.ctx.n_threads, "kv_type": engine_cfg.kv_type,
        "llama_cpp_kv": a.llama_cpp_kv or engine_cfg.kv_type,
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
        shown = ", ".join(f"{m} on {i}" for i, m in mismatches[:5])
        if eng.policy == "batched":  # allowed at near-ties by the policy in force: reported, not an error
            print(f"edgespec: {len(mismatches)} outputs differ from plain greedy decoding ({shown}): near-ties under "
                  "--exactness batched", file=sys.stderr)
            return 0
        print(f"edgespec: error: {len(mismatches)} outputs differ from plain greedy decoding: {shown}", file=sys.stderr)
        return 3
    return 0


def parse_parallel(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        vals = []
    if not vals or any(v < 1 or v > 64 for v in vals):
        raise EdgespecError(f"--parallel takes sequence counts from 1 to 64, comma-separated (got {text!r})")
    return sorted(set(vals))


def run_batch_bench(a: BenchOptions, engine_cfg, methods: list[str], suite: list[dict]) -> int:
    """Batch throughput: the whole suite as one batch per (sequences per decode, method), rounds
    rotated so that drift on a shared machine hits every cell alike. Greedy outputs are compared
    with `none` at one sequence."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from ...engine import Engine
    from ...serving import Request, run_requests

    nps = parse_parallel(a.parallel)
    if max(nps) > 1:
        bad = [m for m in methods if not registry.get(m).multi_sequence]
        if bad:
            raise EdgespecError(f"method {bad[0]} decodes one sequence at a time; --parallel above 1 takes "
                                f"{', '.join(registry.multi_sequence())}")
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
                  TextColumn("{task.fields[info]}"), transient=True, console=stderr_console()) as prog:
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
                     # the end of generation a step yielded counts (Stats.mean_accepted_length)
                     "mean_accepted_length": _r((out + sum(t.stats.n_ended for t in tots)) / steps if steps else None),
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
