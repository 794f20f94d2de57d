"""The `edgespec batch` command: read the input, resume the output, serve with a progress bar,
summarize, and `--compare` with plain decoding."""

from __future__ import annotations

import json
import os
import sys
import time

from ...errors import EdgespecError
from ...sampling import SamplingConfig
from ...serving.loop import Totals, run_requests
from ...serving.requests import Defaults, Request
from ..console import stderr_console
from ..options import BatchOptions
from .output import Done, Writer, pending_requests, scan_output
from .requests import EXIT_SOME_FAILED, read_requests


def _read_input(path: str) -> list[str]:
    if path == "-":
        if sys.stdin is None:
            raise EdgespecError("no input: standard input is closed")
        return sys.stdin.read().splitlines()
    try:
        with open(path, encoding="utf-8-sig") as f:
            return f.read().splitlines()
    except FileNotFoundError:
        raise EdgespecError(f"input file not found: {path}") from None
    except IsADirectoryError:
        raise EdgespecError(f"input is a directory, not a JSONL file: {path}") from None
    except UnicodeDecodeError as e:
        raise EdgespecError(f"input {path} is not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise EdgespecError(f"cannot read input {path}: {e.strerror}") from None


def run_batch(a: BatchOptions, engine_cfg, sampling: SamplingConfig) -> int:
    """The `edgespec batch` command (options already validated by the CLI; `sampling`: the flags'
    settings, with --grammar-file / --json-schema, for requests that do not set theirs)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ...engine import Engine

    if a.output != "-" and a.input != "-" and os.path.abspath(a.input) == os.path.abspath(a.output):
        raise EdgespecError("the output file must not be the input file")
    defaults = Defaults(a.n_predict, sampling)
    reqs = read_requests(_read_input(a.input), defaults)
    if not reqs:
        raise EdgespecError(f"no requests in {a.input}")
    dups = [r for r in reqs if r.duplicate_of is not None]
    if dups:
        shown = ", ".join(f"{r.custom_id!r} (line {r.line_no}, first on line {r.duplicate_of})" for r in dups[:5])
        print(f"edgespec: {len(dups)} duplicate custom_id(s), reported as errors and not run: {shown}"
              + (" ..." if len(dups) > 5 else ""), file=sys.stderr)
    asked = sorted({r.model for r in reqs if r.model and r.error is None and r.model != engine_cfg.model})
    if asked:
        print(f"edgespec: requests name model {', '.join(map(repr, asked[:3]))}{' ...' if len(asked) > 3 else ''}; "
              f"{engine_cfg.model} answers them all (choose the model with -m)", file=sys.stderr)
    writer = Writer(a.output, overwrite=a.overwrite)  # locked before reading what it holds
    done = Done()
    if a.output != "-" and not a.overwrite:
        try:
            done = scan_output(a.output, retry_failed=a.retry_failed)
        except EdgespecError:
            writer.close()
            raise
        if done.restored:
            print(f"edgespec: {a.output}: restored from {a.output}.retry-backup (an earlier --retry-failed was "
                  "interrupted while rewriting it)", file=sys.stderr)
        if done.repaired:
            print(f"edgespec: {a.output}: removed a torn last line ({done.repaired} bytes) left by an interrupted run",
                  file=sys.stderr)
        if done.failed:
            print(f"edgespec: {a.output}: {done.failed} request(s) failed in an earlier run; "
                  + ("running them again" if a.retry_failed else "kept as they are (--retry-failed runs them again)"),
                  file=sys.stderr)
    todo = pending_requests(reqs, done)
    skipped = len(reqs) - len(todo)
    if skipped:
        print(f"edgespec: resuming {a.output}: {skipped} of {len(reqs)} requests already done", file=sys.stderr)
    if not todo:
        writer.close()
        print(f"edgespec: nothing to do: every request in {a.input} has a result in {a.output}", file=sys.stderr)
        return 0
    try:
        engine = Engine(engine_cfg, quiet=a.quiet)
    except BaseException:
        writer.close()
        raise
    show = not a.quiet and sys.stderr.isatty()
    live = {"tokens": 0, "drafted": 0, "accepted": 0, "t0": time.perf_counter(), "shown": 0.0}
    interrupted = False
    totals = Totals()
    try:
        with Progress(TextColumn("batch"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      TextColumn("{task.fields[info]}"), console=stderr_console(), disable=not show,
                      transient=False) as prog:
            task = prog.add_task("batch", total=len(todo), info="")

            def info() -> str:
                dt = time.perf_counter() - live["t0"]
                acc = f", accepted {100 * live['accepted'] / live['drafted']:.0f}%" if live["drafted"] else ""
                return f"{live['tokens'] / dt if dt > 0 else 0:.1f} tok/s{acc}"

            def on_step(ev) -> None:
                live["tokens"] += len(ev.tokens)
                live["drafted"] += ev.n_drafted
                live["accepted"] += ev.n_accept
                now = time.perf_counter()
                if show and now - live["shown"] > 0.5:
                    live["shown"] = now
                    prog.update(task, info=info())

            def emit(req: Request, rec: dict) -> None:
                writer.write(rec)
                prog.update(task, advance=1, info=info())

            try:
                run_requests(engine, todo, a.spec, a.parallel, emit, on_step, totals=totals,
                             reuse=a.reuse, cache=_cache(a))
            except KeyboardInterrupt:
                interrupted = True
    finally:
        writer.close()
    summary = {"input": a.input, "output": a.output, "skipped_as_done": skipped, "parallel": a.parallel,
               "method": a.spec, **totals.to_dict()}
    lines = [
        f"batch: {summary['requests']} requests ({totals.ok} ok, {totals.failed} failed"
        + (f", {skipped} already done" if skipped else "")
        + (f", {len(todo) - totals.ok - totals.failed} not run: interrupted" if interrupted else "")
        + f"), -np {a.parallel}, --spec {a.spec}",
        f"tokens: {totals.tokens_in} in"
        + (f" ({totals.tokens_cached} of them cached)" if totals.tokens_cached else "")
        + f", {totals.tokens_out} out; wall {totals.wall:.1f} s "
        f"({totals.t_prompt:.1f} s reading prompts); {totals.throughput:.1f} tokens/s out, "
        f"{totals.decode_throughput:.1f} while generating",
    ]
    if totals.drafted:
        lines.append(f"speculation: drafted {totals.drafted}, accepted {totals.accepted} "
                     f"({100 * totals.accepted / totals.drafted:.1f}%), mean accepted length "
                     f"{summary['mean_accepted_length']:.2f} tokens per step")
    if interrupted:
        engine.close()
        for line in lines:
            print(line, file=sys.stderr)
        print(f"edgespec: interrupted; finished results are in {a.output}; the same command resumes", file=sys.stderr)
        return 130
    if a.compare:
        base = _compare(engine, todo, a, totals)
        summary["compare"] = base
        lines.append(f"compare: --spec none -np {a.parallel} on the same requests: {base['tokens_per_s']:.1f} tokens/s "
                     f"out in {base['wall_s']:.1f} s; speedup {base['speedup']:.2f}x"
                     + (f"; greedy outputs identical {base['identical']}/{base['greedy']}" if base["greedy"] else ""))
    summary["exactness"] = engine.exactness_info()
    policy = summary["exactness"]["policy"]
    engine.close()
    for line in lines:
        print(line, file=sys.stderr)
    if a.stats:
        try:
            with open(a.stats, "w") as f:
                json.dump(summary, f, indent=1)
        except OSError as e:
            raise EdgespecError(f"cannot write {a.stats}: {e.strerror}") from None
    if a.compare and summary["compare"]["identical"] < summary["compare"]["greedy"]:
        if policy == "batched":  # near-ties are allowed by the policy in force
            print("edgespec: some speculative greedy outputs differ from plain decoding: near-ties under "
                  "--exactness batched", file=sys.stderr)
        else:
            print("edgespec: error: speculative greedy outputs differ from plain decoding", file=sys.stderr)
            return 3
    return EXIT_SOME_FAILED if totals.failed else 0


def _compare(engine, todo: list[Request], a: BatchOptions, spec: Totals) -> dict:
    """The same requests again without speculation (results not written)."""
    print(f"edgespec: --compare: running the {len(todo)} requests again with --spec none", file=sys.stderr)
    base = run_requests(engine, todo, "none", a.parallel, lambda req, rec: None, quiet=True,
                        reuse=a.reuse, cache=_cache(a))
    greedy = [r.custom_id for r in todo if r.error is None and r.sampling.greedy and r.custom_id in base.outputs]
    same = sum(1 for c in greedy if spec.outputs.get(c) == base.outputs[c])
    d = base.to_dict()
    d["speedup"] = round(spec.throughput / base.throughput, 3) if base.throughput > 0 else 0.0
    d["greedy"], d["identical"] = len(greedy), same
    return d


def _cache(a: BatchOptions):
    """A fresh host-RAM prompt cache for one run (`--cache-ram`, with `--reuse`), or None."""
    from ...promptcache import PromptCache

    mib = a.cache_ram or 0
    return PromptCache(mib << 20) if mib > 0 and a.reuse else None
