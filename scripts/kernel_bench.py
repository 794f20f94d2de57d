"""Microbenchmark of the CPU matrix-vector kernels a decode of N rows runs, per weight type, beside
their floors (issue 57). Compiles scripts/kernel_bench.c against llama-cpp-python's headers and
libggml-base, and runs it once per build of `libggml-cpu.so.0` named with --lib, in alternated rounds,
each under the machine's CPU lock (`flock /tmp/edgespec-cpu.lock`), so builds are compared side by side.

    python scripts/kernel_bench.py MODEL.gguf --lib stock --lib patched=edgespec/_kernels \
        --lib new=/work/kern-src/build/bin --rows 1,2,3,4,8 --rounds 3 --check

`stock` is llama-cpp-python's own library. The default tensors are those of a Qwen2 Q4_K_M file that
matter: the output layer (Q6_K), one Q6_K and one Q4_K ffn_down, a Q4_K ffn_gate and attn_q. Each is
copied until the copies exceed --mb (512 MB: far beyond the last-level cache, so the weights stream
from memory as in a decode). Times are per product (the activations' quantization included), the
median of --reps passes; a round's figure is its median, the table shows the median over rounds and
each row count's cost relative to one row of the same build. The floors: the weights' bytes at the
read bandwidth of the same threads (`read_gbs`), and the int8 multiply-adds of N rows at the rate of
`vpmaddubsw ymm` (`maddubs_gmacs`). --check counts the output values of an N-row product that differ
from one-row products in their bits (must be 0 for the batch-invariant kernels).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "kernel_bench.c"
LOCK = "/tmp/edgespec-cpu.lock"
DEFAULT_TENSORS = "output.weight,blk.0.ffn_down.weight,blk.2.ffn_down.weight,blk.0.ffn_gate.weight,blk.0.attn_q.weight"


def llama_dirs() -> tuple[Path, Path]:
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("llama-cpp-python is not installed")
    pkg = Path(list(spec.submodule_search_locations)[0])
    include = pkg.parent / "include"
    if not (include / "ggml-cpu.h").is_file():
        sys.exit(f"no ggml headers in {include}")
    return pkg / "lib", include


def compile_harness(out: Path, lib_dir: Path, include: Path) -> Path:
    exe = out / "kernel_bench"
    cc = os.environ.get("CC", "cc")
    cmd = [cc, "-O2", "-mavx2", "-mfma", "-o", str(exe), str(SOURCE), f"-I{include}", f"-L{lib_dir}",
           "-l:libggml-base.so.0", "-l:libggml-cpu.so.0", "-lm", "-lpthread"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"compiling the harness failed:\n{r.stderr}")
    return exe


def lib_folder(spec: str, lib_dir: Path, tmp: Path) -> tuple[str, Path]:
    """A folder holding the named build's libggml-cpu.so.0 beside llama-cpp-python's libggml-base."""
    name, _, path = spec.partition("=")
    src = lib_dir if name == "stock" and not path else Path(path or name).expanduser().resolve()
    lib = src / "libggml-cpu.so.0"
    if not lib.is_file():
        sys.exit(f"no libggml-cpu.so.0 in {src}")
    folder = tmp / name
    folder.mkdir()
    (folder / "libggml-cpu.so.0").symlink_to(lib.resolve())
    (folder / "libggml-base.so.0").symlink_to((lib_dir / "libggml-base.so.0").resolve())
    return name, folder


def run_one(exe: Path, folder: Path, args, extra: list[str]) -> dict:
    # edgespec's setting for its kernels (kernels.TILED_MIN_ROWS): the tiled K-quant kernel from 33 rows
    env = {**os.environ, "LD_LIBRARY_PATH": str(folder), "OMP_NUM_THREADS": str(args.threads),
           "GGML_CPU_TILED_MM_MIN_ROWS": str(args.tiled_min_rows)}
    cmd = [str(exe), str(args.model), args.tensors, "--rows", args.rows, "--threads", str(args.threads),
           "--reps", str(args.reps), "--mb", str(args.mb), "--slice", str(args.slice)] + extra
    if shutil.which("flock") and not args.no_lock:
        cmd = ["flock", LOCK] + cmd
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--lib", action="append", default=[], help="NAME=FOLDER of a libggml-cpu.so.0 build; 'stock' alone "
                    "is llama-cpp-python's own (repeatable; builds are alternated)")
    ap.add_argument("--tensors", default=DEFAULT_TENSORS)
    ap.add_argument("--rows", default="1,2,3,4,8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--mb", type=float, default=512)
    ap.add_argument("--slice", type=int, default=0, help="time the tensors' first SLICE rows only (-K: K KB of rows; "
                    "with a small --mb, the weights stay in the caches: the arithmetic alone)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--metric", choices=("wall", "cpu"), help="wall-clock time, or the calling thread's CPU time "
                    "(meaningful with --threads 1: robust to other processes on a shared machine); default cpu "
                    "with one thread, wall otherwise")
    ap.add_argument("--tiled-min-rows", type=int, default=33)
    ap.add_argument("--check", action="store_true", help="count values differing from one-row products")
    ap.add_argument("--json", type=Path, help="write every round's figures here")
    ap.add_argument("--no-lock", action="store_true")
    ap.add_argument("--quiet", action="store_true", help="no table (with --json)")
    args = ap.parse_args()
    args.metric = args.metric or ("cpu" if args.threads == 1 else "wall")
    lib_dir, include = llama_dirs()
    libs = args.lib or ["stock"]
    with tempfile.TemporaryDirectory(prefix="kernel-bench-") as t:
        tmp = Path(t)
        exe = compile_harness(tmp, lib_dir, include)
        folders = [lib_folder(s, lib_dir, tmp) for s in libs]
        floors = {} if args.quiet else run_one(exe, folders[0][1], args, ["--floors-only"])
        rounds: dict[str, list[dict]] = {name: [] for name, _ in folders}
        for k in range(args.rounds):
            order = folders if k % 2 == 0 else folders[::-1]
            for name, folder in order:
                rounds[name].append(run_one(exe, folder, args, ["--check"] if args.check else []))
    if not args.quiet:
        report(floors, rounds, args)
    if args.json:
        args.json.write_text(json.dumps({"floors": floors, "rounds": rounds}, indent=1))


def report(floors: dict, rounds: dict[str, list[dict]], args) -> None:
    gbs, gmacs = floors["read_gbs"], floors["maddubs_gmacs"]
    rows = [int(r) for r in args.rows.split(",")]
    key = "cpu_min" if args.metric == "cpu" else "median"
    print(f"{args.threads} threads, {args.metric} time, {args.rounds} rounds; read bandwidth {gbs:.1f} GB/s; vpmaddubsw ymm {gmacs:.0f} G int8 multiply-adds/s")
    names = list(rounds)
    first = rounds[names[0]][0]["tensors"]
    for ti, t in enumerate(first):
        mem_ms = t["bytes"] / gbs / 1e6
        macs = t["ne"][0] * t["ne"][1]
        print(f"\n{t['name']} {t['type']} {t['ne'][0]}x{t['ne'][1]} ({t['bytes'] / 1e6:.1f} MB"
              f"{', repacked' if t['repacked'] else ''}); memory floor {mem_ms:.3f} ms")
        head = "| rows | floor ms (mem, arith) |" + "".join(f" {n} ms | {n} / 1 row |" for n in names)
        print(head)
        print("|---" * (2 + 2 * len(names)) + "|")
        for n in rows:
            ar_ms = macs * n / gmacs / 1e6
            cells = []
            for name in names:
                meds = [r["tensors"][ti]["ms"][str(n)][key] for r in rounds[name]]
                ones = [r["tensors"][ti]["ms"]["1"][key] for r in rounds[name]] if "1" in rounds[name][0]["tensors"][ti]["ms"] else None
                ms = statistics.median(meds)
                ratio = f"{ms / statistics.median(ones):.2f}x" if ones else "-"
                bad = [r["tensors"][ti]["ms"][str(n)].get("mismatches") for r in rounds[name]]
                flag = "" if bad[0] is None else (" exact" if not any(bad) else f" {max(bad)} differ")
                cells.append(f" {ms:.4g} ({min(meds):.4g}-{max(meds):.4g}){flag} | {ratio} |")
            print(f"| {n} | {max(mem_ms, ar_ms):.4g} ({mem_ms:.4g}, {ar_ms:.4g}) |" + "".join(cells))


if __name__ == "__main__":
    main()
