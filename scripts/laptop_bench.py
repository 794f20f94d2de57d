"""The laptop-class model against llama.cpp's own tools, and the evidence for its exactness policy.

For every prompt of the given suites, up to four `edgespec bench` runs, each in a process of its own
and under a CPU lock when one is given (`--lock FILE`, so that other jobs on a shared machine
wait between prompts rather than during one):

  A  default settings (edgespec's batch-invariant kernels where installed): none, lookahead, auto
     (with the catalog's draft when it is cached), and llama.cpp's llama-completion and llama-lookup
     as users run them (their own f16 KV cache);
  N  the same without a draft model (`-md none`): none, auto (what a user without the 0.5B gets);
  S  llama.cpp's stock kernels (EDGESPEC_KERNELS=stock): none, lookahead, auto (what the kernels gain);
  B  `--exactness batched`: none, lookahead (how often batched verification changes the text).

Each prompt's methods run side by side in one process (ratios, not absolute rates, are the
result on a shared machine); the prompt is read once per run (`bench --reuse`). The table is
printed and written to OUT/summary.json.

  python scripts/laptop_bench.py -m qwen2.5-coder-1.5b-instruct -t 2 --bin DIR \\
      --suite ../shared/bench/prompts.jsonl --suite humaneval:6 --suite mtbench:6 --out bench-out/laptop
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

RUNS = {
    "A": ["--methods", "none,lookahead,auto"],
    "N": ["--methods", "none,auto", "-md", "none"],
    "S": ["--methods", "none,lookahead,auto"],
    "B": ["--methods", "none,lookahead", "--exactness", "batched"],
}
ENV = {"S": {"EDGESPEC_KERNELS": "stock"}}


def suite_items(spec: str) -> list[dict]:
    """FILE, humaneval[:N], mtbench[:N[:CAT,CAT]] (then N of each category)."""
    from edgespec.suites import load_suite

    name, limit, cats = (spec.split(":") + ["", ""])[:3]
    if not cats:
        return load_suite(name, None, int(limit) if limit else 0)
    return [x for c in cats.split(",") for x in load_suite(name, c, int(limit) if limit else 0)]


COPY = ("code-edit", "quote-summarize", "rag", "extraction")


def group(category: str) -> str:
    if category in COPY:
        return "copy-heavy"
    if category.startswith("chat"):
        return "chat"
    return category.split("-")[0]  # humaneval, mtbench


def bench(args, item: dict, run: str, out: Path) -> dict | None:
    rep = out / f"{run}-{item['id'].replace('/', '_')}"
    if (rep / "report.json").exists():
        return json.loads((rep / "report.json").read_text())
    if args.table_only:
        return None
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        f.write(json.dumps(item) + "\n")
    cmd = [sys.executable, "-m", "edgespec", "bench", "-m", args.model, "-t", str(args.threads), "--suite", f.name,
           "-n", str(args.n_predict), "--min-time", "0", "--reuse", "--out", str(rep), *RUNS[run]]
    if run == "A" and args.bin:
        cmd += ["--llama-cpp-bin", args.bin, "--llama-cpp-kv", "default"]
    if args.lock:
        cmd = ["flock", args.lock, *cmd]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env={**os.environ, **ENV.get(run, {})})
    finally:
        os.unlink(f.name)
    if r.returncode != 0:
        print(f"{run} {item['id']}: failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}", file=sys.stderr)
        return None
    return json.loads((rep / "report.json").read_text())


def rates(report: dict, tag: str) -> dict:
    return {f"{tag}:{r['method']}": (r["tokens_per_s"], r.get("match"), r.get("mean_accepted_length"))
            for r in report["records"]}


def geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-n", "--n-predict", type=int, default=128)
    ap.add_argument("--bin", default=None, help="llama.cpp's tools (shared/tools/build-llama-cpp-tools.sh)")
    ap.add_argument("--suite", action="append", default=None, help="FILE, humaneval[:N] or mtbench[:N]")
    ap.add_argument("--runs", default="ANSB")
    ap.add_argument("--lock", default=None, help="hold this flock file during each bench process")
    ap.add_argument("--out", default="bench-out/laptop")
    ap.add_argument("--table-only", action="store_true", help="run nothing: the table of the reports in --out")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for spec in args.suite or ["../shared/bench/prompts.jsonl"]:
        for item in suite_items(spec):
            row = {"id": item["id"], "category": item["category"]}
            for run in args.runs:
                rep = bench(args, item, run, out)
                if rep is not None:
                    row.update(rates(rep, run))
            rows.append(row)
            print(json.dumps(row), flush=True)
    (out / "summary.json").write_text(json.dumps(rows, indent=1))
    table(rows)
    return 0


def table(rows: list[dict]) -> None:
    """Per category: tok/s ratios against llama-completion and against each run's own `none`."""
    cols = [("A:llama.cpp:completion", "llama-completion"), ("A:llama.cpp:lookup", "llama-lookup"),
            ("A:none", "none"), ("A:lookahead", "lookahead"), ("A:auto", "auto (default, 0.5B cached)"),
            ("N:auto", "auto, no draft model"), ("S:none", "none, stock kernels"),
            ("S:lookahead", "lookahead, stock kernels"), ("S:auto", "auto, stock kernels"),
            ("B:lookahead", "lookahead, batched")]
    names = list(dict.fromkeys(group(r["category"]) for r in rows))
    groups = [(c, [r for r in rows if group(r["category"]) == c]) for c in names] + [("all", rows)]
    print("\n| tool | " + " | ".join(f"{c} ({len(g)})" for c, g in groups) + " |")
    print("|---|" + "---|" * len(groups))
    for key, label in cols:
        cells = []
        for _, g in groups:
            xs = [r[key][0] / r["A:llama.cpp:completion"][0] for r in g
                  if key in r and "A:llama.cpp:completion" in r]
            cells.append(f"{geomean(xs):.2f}x" if xs else "-")
        print(f"| {label} | " + " | ".join(cells) + " |")
    for key, base, label in (("A:lookahead", "A:none", "lookahead / none"), ("A:auto", "A:none", "auto / none"),
                             ("A:auto", "A:lookahead", "auto / lookahead"),
                             ("N:auto", "N:none", "auto without draft / its none"),
                             ("S:lookahead", "S:none", "stock kernels: lookahead / none"),
                             ("S:auto", "S:none", "stock kernels: auto / none"),
                             ("A:none", "S:none", "none: patched / stock kernels"),
                             ("B:lookahead", "B:none", "batched lookahead / its none"),
                             ("A:llama.cpp:lookup", "A:none", "llama-lookup / none")):
        cells = []
        for _, g in groups:
            xs = [r[key][0] / r[base][0] for r in g if key in r and base in r]
            cells.append(f"{geomean(xs):.2f}x" if xs else "-")
        print(f"| {label} | " + " | ".join(cells) + " |")
    for key in ("A:lookahead", "A:auto", "N:auto", "S:lookahead", "S:auto", "B:lookahead", "A:llama.cpp:lookup"):
        ms = [r[key][1] for r in rows if key in r]
        print(f"{key}: output = its plain on {sum(1 for m in ms if m)}/{len(ms)}")


if __name__ == "__main__":
    sys.exit(main())
