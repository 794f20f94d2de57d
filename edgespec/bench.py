"""`edgespec bench`: methods measured side by side, interleaved prompt by prompt, in one run.

Speedups are ratios against `none` from the same prompt and repeat, so a noisy shared machine
slows both sides alike. Every greedy output is compared with `none`'s token for token.
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
from importlib import resources
from pathlib import Path

from .errors import EdgespecError
from .sampling import SamplingConfig

GREEDY = SamplingConfig(temp=0.0)


def load_suite(path: str | None, categories: str | None, limit: int) -> list[dict]:
    if path is None:
        text = resources.files("edgespec").joinpath("data/suite.jsonl").read_text(encoding="utf-8")
        src = "built-in suite"
    else:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as e:
            raise EdgespecError(f"cannot read suite {path}: {e.strerror}") from None
        src = path
    items = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise EdgespecError(f"{src} line {i}: not JSON ({e.msg})") from None
        if "messages" not in obj and "prompt" not in obj:
            raise EdgespecError(f"{src} line {i}: needs 'messages' or 'prompt'")
        obj.setdefault("id", f"p{i}")
        obj.setdefault("category", "default")
        items.append(obj)
    if categories:
        keep = set(categories.split(","))
        items = [x for x in items if x["category"] in keep]
    if limit:
        items = items[:limit]
    if not items:
        raise EdgespecError("no prompts to run (check --suite and --categories)")
    return items


def geomean(xs: list[float]) -> float:
    xs = [x for x in xs if x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else 0.0


def run_bench(a, engine_cfg) -> int:
    from tqdm import tqdm

    from .runner import Engine

    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    if "none" in methods:
        methods.remove("none")
    methods = ["none"] + methods
    suite = load_suite(a.suite, a.categories, a.limit)
    eng = Engine(engine_cfg, quiet=False)
    for m in methods:
        eng.make_drafter(m)  # fail early on a method that cannot run
    prompts = []
    for item in suite:
        toks = eng.prompt_tokens(messages=item["messages"]) if "messages" in item else eng.prompt_tokens(item["prompt"], raw=True)
        n = min(a.n_predict, int(item.get("max_tokens", a.n_predict)))
        prompts.append((item, toks, n))
    # warm-up: page the weights in and settle the CPU clocks before anything is measured
    eng.generate(prompts[0][1], 16, GREEDY, eng.make_drafter("none")).run()

    records = []
    mismatches = []
    bar = tqdm(total=len(prompts) * len(methods) * a.repeat, desc="bench", unit="run", file=sys.stderr)
    for item, toks, n in prompts:
        for rep in range(a.repeat):
            ref = None
            for m in methods:  # interleaved: A B C A B C ...
                g = eng.generate(toks, n, GREEDY, eng.make_drafter(m)).run()
                st = g.stats
                if m == "none":
                    ref = g.tokens
                match = g.tokens == ref
                if not match:
                    mismatches.append((item["id"], m))
                    tqdm.write(f"edgespec: MISMATCH: {m} output differs from none on {item['id']}", file=sys.stderr)
                records.append({
                    "id": item["id"], "category": item["category"], "method": m, "repeat": rep,
                    "match": match, **st.to_dict(),
                })
                bar.set_postfix_str(f"{m} {st.tokens_per_s:.0f} tok/s")
                bar.update(1)
    bar.close()

    llama_rows = []
    if getattr(a, "llama_cpp_bin", None):
        llama_rows = run_llama_cpp(a.llama_cpp_bin, eng, prompts, engine_cfg)
        records.extend(llama_rows)

    report = summarize(records, methods + sorted({r["method"] for r in llama_rows}, reverse=True), eng)
    report["config"] = {
        "model": engine_cfg.model, "draft": engine_cfg.draft, "threads": eng.ctx.n_threads,
        "n_predict": a.n_predict, "repeat": a.repeat, "suite": a.suite or "built-in", "methods": methods,
    }
    report["mismatches"] = mismatches
    print(render_markdown(report))
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.json").write_text(json.dumps({**report, "records": records}, indent=1))
        print(f"\nreport: {out / 'report.json'}", file=sys.stderr)
    if mismatches:
        print(f"edgespec: error: {len(mismatches)} outputs differ from plain greedy decoding", file=sys.stderr)
        return 3
    return 0


def summarize(records: list[dict], methods: list[str], eng) -> dict:
    base = {(r["id"], r["repeat"]): r for r in records if r["method"] == "none"}
    rows = []
    cats = sorted({r["category"] for r in records})
    for m in methods:
        mine = [r for r in records if r["method"] == m]
        if not mine:
            continue
        for cat in cats + ["all"]:
            sel = [r for r in mine if cat == "all" or r["category"] == cat]
            if not sel:
                continue
            sp = [r["tokens_per_s"] / base[(r["id"], r["repeat"])]["tokens_per_s"] for r in sel
                  if (r["id"], r["repeat"]) in base and base[(r["id"], r["repeat"])]["tokens_per_s"] > 0]
            drafted = sum(r.get("n_drafted", 0) for r in sel)
            accepted = sum(r.get("n_accept", 0) for r in sel)
            gen = sum(r["n_generated"] for r in sel)
            steps = sum(r.get("n_steps", 0) for r in sel)
            tdraft = sum(r.get("t_draft", 0.0) for r in sel)
            tver = sum(r.get("t_verify", 0.0) for r in sel)
            tgen = sum(r.get("t_gen", 0.0) for r in sel)
            rows.append({
                "method": m, "category": cat, "prompts": len(sel),
                "tokens_per_s": round(geomean([r["tokens_per_s"] for r in sel]), 1),
                "speedup": round(geomean(sp), 3) if sp else None,
                "speedup_min": round(min(sp), 3) if sp else None,
                "speedup_max": round(max(sp), 3) if sp else None,
                "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
                "mean_accepted_length": round(gen / steps, 3) if steps else None,
                "draft_share": round(tdraft / tgen, 3) if tgen else None,
                "verify_share": round(tver / tgen, 3) if tgen else None,
                "all_match": all(r.get("match", True) for r in sel),
            })
    return {"summary": rows, "cost_ms": eng.cost.to_dict()}


def render_markdown(report: dict) -> str:
    head = ("| method | category | prompts | tok/s | speedup (min-max) | acceptance | mean acc. len | "
            "draft/verify time | output = none |")
    lines = [head, "|" + "---|" * 9]
    for r in report["summary"]:
        sp = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x ({r['speedup_min']:.2f}-{r['speedup_max']:.2f})"
        acc = "-" if r["acceptance_rate"] is None else f"{100 * r['acceptance_rate']:.0f}%"
        mal = "-" if r["mean_accepted_length"] is None else f"{r['mean_accepted_length']:.2f}"
        share = "-" if r["draft_share"] is None else f"{100 * r['draft_share']:.0f}% / {100 * r['verify_share']:.0f}%"
        ok = "yes" if r["all_match"] else "**NO**"
        lines.append(f"| {r['method']} | {r['category']} | {r['prompts']} | {r['tokens_per_s']:.1f} | {sp} | {acc} | {mal} | {share} | {ok} |")
    return "\n".join(lines)


_EVAL = re.compile(r"eval time =\s*([\d.]+) ms /\s*(\d+) (?:runs|tokens)")
_DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")


def run_llama_cpp(bin_dir: str, eng, prompts, cfg) -> list[dict]:
    """llama.cpp's own llama-completion (plain) and llama-lookup on the same formatted prompts."""
    bind = Path(bin_dir)
    model = str(eng.target.path)
    rows = []
    for item, toks, n in prompts:
        text = eng.target.detokenize(toks, special=True)
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
            f.write(text)
            pf = f.name
        try:
            base_tps = None
            for name, exe, extra in (
                ("llama.cpp:completion", "llama-completion", ["-no-cnv"]),
                ("llama.cpp:lookup", "llama-lookup", []),
            ):
                path = bind / exe
                if not path.exists():
                    raise EdgespecError(f"{path} not found (build it with shared/tools/build-llama-cpp-tools.sh)")
                cmd = [str(path), "-m", model, "-f", pf, "-n", str(n), "--temp", "0", "-t", str(eng.ctx.n_threads),
                       "-c", str(eng.ctx.n_ctx), "-ctk", cfg.kv_type, "-ctv", cfg.kv_type, "--ignore-eos", *extra]
                t0 = time.perf_counter()
                r = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=600)
                wall = time.perf_counter() - t0
                tps = parse_eval_tps(r.stderr + r.stdout)
                if tps is None:
                    tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
                    print(f"edgespec: {exe} gave no timing on {item['id']}: {tail}", file=sys.stderr)
                    continue
                rows.append({"id": item["id"], "category": item["category"], "method": name, "repeat": 0,
                             "tokens_per_s": tps, "n_generated": n, "wall_s": wall, "match": True})
                base_tps = base_tps or tps
        finally:
            os.unlink(pf)
    return rows


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
