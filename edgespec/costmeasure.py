"""Measuring the cost curve and the exactness probe: one pass that reads little context.

The first run of a model waits for this, so it measures what the sizing needs and nothing twice
(Qwen2.5-Coder-1.5B Q4_K_M, 2 threads: about 18 s, where separate passes took about 70):

- **Short context** (32 tokens): 32 random rows are decoded one at a time (the probe's reference
  logits, and one-row timings), then as batches of every size in `KS`, interleaved, on two passes
  and a third for the sizes whose two timings disagree: each batch is timed (the curve) and its
  rows compared with the one-row references (the probe's first stage). One set of reference rows
  serves every batch size: row i of a batch of b is compared with the one-row decode of the same
  token at the same position, which is what a batch-dependent kernel gets wrong.
- **Long context** (600 tokens, past llama.cpp's 512-cell switch): read once, and used twice:
  the probe's second stage (sizes up to the first stage's limit), and one row and eight timed
  (the attention term, with the probe's own decodes of those sizes). A wrong term shows in the
  online correction's attention check (`CostModel.far_off`), and the curve is measured again.

A draft model's curve is read for its time per token only: `measure_one_row`, a fraction of a
second, in place of all this.

A busy machine shows as a low CPU share (the CPU time our threads got against the wall time);
such a curve is measured with one pass instead of two or three (the probe compares every size
on the first) and without its attention term, kept, and measured again as soon as the machine
is quiet (`cpu_share`, between
generations: see costcache.due), not here again and again. Progress is reported through logging
(`extra={"progress": True, "task", "done", "total"}`, seconds): front ends draw it.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

import numpy as np

from .costmodel import KS, QUIET_SHARE, CostModel
from .llama import Context

log = logging.getLogger(__name__)

PROBE_ROWS = tuple(k for k in KS if k > 1)  # batch sizes compared with one-row decodes: 2 to 32
LONG_PROBE = 600  # cells of context for the probe's second stage (past llama.cpp's 512-cell switch)
PREFIX = 32  # the short context's tokens: attention is not free
REPS = 3  # passes over the sizes at most: two, and a third for sizes whose two disagree (AGREE)
AGREE = 1.03
LONG_REPS = 5  # one row and eight timed this many times at the long context and the short one again (attention)


class Meter:
    """What is left of a measurement (decodes by row count, tokens to read), priced at what was
    measured so far, reported as progress: seconds done and an estimate of the total."""

    def __init__(self, task: str, report: bool, every: float = 0.25):
        self.task, self.report, self.every = task, report, every
        self.t0 = self._last = time.perf_counter()
        self.left: Counter[int] = Counter()  # planned decodes of k rows not yet done
        self.read_left = 0
        self.best: dict[int, float] = {}
        self.per_token = 0.0  # reading, seconds per token

    def plan(self, k: int, n: int = 1) -> None:
        self.left[k] += n

    def did(self, k: int, seconds: float) -> None:
        self.left[k] -= 1
        self.best[k] = min(seconds, self.best.get(k, seconds))

    def read(self, n: int, seconds: float) -> None:
        self.read_left -= n
        if n >= 16:
            self.per_token = seconds / n

    def price(self, k: int) -> float:
        if k in self.best:
            return self.best[k]
        one = self.best.get(1, 0.05)
        big = max((j for j in self.best if j > 1), default=0)
        slope = (self.best[big] - one) / (big - 1) if big else 0.25 * one  # a 2-core CPU's, until known
        return one + slope * (k - 1)

    def eta(self) -> float:
        rows = sum(n * self.price(k) for k, n in self.left.items() if n > 0)
        return rows + self.read_left * (self.per_token or 0.2 * self.price(1))

    def note(self, what: str, force: bool = False) -> None:
        now = time.perf_counter()
        if not self.report or (not force and now - self._last < self.every):
            return
        self._last = now
        done = now - self.t0
        log.info("%s", what, extra={"progress": True, "task": self.task, "done": done, "total": done + self.eta()})

    def finish(self, what: str) -> None:
        if self.report:
            done = time.perf_counter() - self.t0
            log.info("%s", what, extra={"progress": True, "task": self.task, "done": done, "total": done})


def measure(ctx: Context, kv, report: bool = False, seed: int = 1234) -> CostModel:
    """The cost curve and the exactness probe, measured now in one pass (see the module doc):
    `max_exact_rows` and `batch_logit_diff` are set on the curve returned."""
    return _Pass(ctx, kv, True, report, seed).run()


def measure_curve(ctx: Context, kv, report: bool = False, seed: int = 1234) -> CostModel:
    """The cost curve alone (its probe fields unset): a curve measured again (costcache.heal)."""
    return _Pass(ctx, kv, False, report, seed).run()


def measure_one_row(ctx: Context, kv, reps: int = 4) -> CostModel:
    """What a draft model's curve is read for, its time per drafted token (t(1)), and t(2)
    beside it: a few decodes (a fraction of a second), not cached, not corrected online."""
    tok = ctx.model.bos if ctx.model.bos >= 0 else 0
    kv.reset()
    kv.extend([tok] * min(PREFIX, ctx.n_ctx // 4), want_logits=False)
    best = {1: float("inf"), 2: float("inf")}
    for rep in range(reps + 1):  # the first: a warm-up
        for k in best:
            base, t0 = kv.n, time.perf_counter()
            kv.extend([tok] * k, all_rows=True)
            best[k] = min(best[k], time.perf_counter() - t0) if rep else best[k]
            kv.truncate(base)
    kv.reset()
    return CostModel((1, 2), (best[1], max(best[1], best[2])), 0.0, PREFIX, online=False)


def probe_exactness(ctx: Context, kv, seed: int = 1234) -> tuple[int, float]:
    """The largest batch size whose every row's logits equal those of one-row decodes, and the
    largest |difference| seen at any probed size (measured with the curve, see `measure`).

    Some CPU kernels process several rows together with another summation order (repacked Q4_K
    weights go through a 4-row GEMM, other K-quants through a tiled kernel from 8 rows, unless the
    engine takes the per-row kernels: docs/exactness.md), and GPU backends typically run one row
    through matrix-vector kernels and batches through matrix-matrix ones, so a batched
    verification can differ from plain decoding in the last bits and flip a near-tie. Greedy
    speculation is only bit-exact up to the first size; the difference is the near-tie margin
    beyond it."""
    cm = measure(ctx, kv, seed=seed)
    return cm.max_exact_rows, cm.batch_logit_diff


class _Pass:
    """One measurement: the short context's stage, then the long context's (module doc)."""

    def __init__(self, ctx: Context, kv, probe: bool, report: bool, seed: int):
        self.ctx, self.kv, self.probe = ctx, kv, probe
        self.name = ctx.model.path.name
        rng = np.random.default_rng(seed)
        n_vocab = ctx.model.n_vocab
        self.prefix_n = min(PREFIX, ctx.n_ctx // 4)
        self.ks = tuple(k for k in KS if k <= ctx.n_batch and self.prefix_n + k <= ctx.n_ctx)
        self.probed = [b for b in PROBE_ROWS if b in self.ks]
        self.rows = [int(x) for x in rng.integers(1, n_vocab, self.ks[-1])]
        # the long context: the probe's second stage where it fits past 512 cells, and the
        # attention term (one row and eight: the extra time per cached token is attn0 + attn * k)
        long_n = min(LONG_PROBE, ctx.n_ctx - self.ks[-1] - 1)
        self.long_n = long_n if long_n > 4 * self.prefix_n and 8 in self.ks else 0
        self.long_probe = probe and long_n >= 520
        self.context = [int(x) for x in rng.integers(1, n_vocab, max(self.prefix_n, self.long_n))]
        self.clock = [0.0, 0.0]  # wall, CPU seconds of the timed decodes
        self.meter = m = Meter("cost", report)
        m.read_left = max(self.prefix_n, self.long_n)
        m.plan(1, len(self.rows) if probe else 0)
        for k in self.ks:
            m.plan(k, 2)
        if self.long_n:
            m.plan(1, 2 * LONG_REPS)
            m.plan(8, 2 * LONG_REPS)
        if self.long_probe:
            m.plan(1, len(self.rows))
            for b in self.probed:
                m.plan(b)

    def timed(self, toks: list[int], all_rows: bool = True) -> float:
        kv, base = self.kv, self.kv.n
        c0, t0 = time.process_time(), time.perf_counter()
        kv.extend(toks, all_rows=all_rows)
        dt = time.perf_counter() - t0
        self.clock[1] += time.process_time() - c0
        self.clock[0] += dt
        self.meter.did(len(toks), dt)
        return dt

    def share(self) -> float:
        """The share of its threads' CPU time the timed decodes got so far."""
        wall, cpu = self.clock
        return min(1.0, cpu / (wall * max(1, self.ctx.n_threads))) if wall > 0 else 1.0

    def busy(self) -> bool:
        return self.share() < QUIET_SHARE

    def read(self, upto: int) -> None:
        kv = self.kv
        t0, n = time.perf_counter(), upto - kv.n
        kv.extend(self.context[kv.n:upto], want_logits=False)
        self.meter.read(n, time.perf_counter() - t0)

    def references(self, toks: list[int]) -> tuple[list[np.ndarray], float]:
        """`toks` decoded one at a time after the cache: each row's logits alone, and the
        fastest of those decodes."""
        base, out, fastest = self.kv.n, [], float("inf")
        for t in toks:
            fastest = min(fastest, self.timed([t], all_rows=False))
            out.append(self.ctx.logits(0).copy())
            self.meter.note(f"{self.name}: one-row decodes, the exactness probe's reference ({len(out)} of {len(toks)})")
        self.kv.truncate(base)
        return out, fastest

    def diff(self, ref: list[np.ndarray], b: int) -> float:
        """After a batch of `rows[:b]` decoded with all logits: the largest |difference| from `ref`."""
        return max(float(np.max(np.abs(self.ctx.logits(i) - ref[i]))) for i in range(b))

    def run(self) -> CostModel:
        try:
            return self._run()
        except BaseException:
            self.meter.finish(f"{self.name}: measurement stopped")  # a front end's bar ends too
            raise

    def _run(self) -> CostModel:
        kv, meter = self.kv, self.meter
        kv.reset()
        meter.note(f"{self.name}: reading a short context", force=True)
        self.read(self.prefix_n)
        kv.extend(self.rows[:1])  # a warm-up: the weights paged in, the threads awake
        kv.truncate(self.prefix_n)
        best, limit, worst = self.short()
        attn = attn0 = 0.0
        if self.long_n:
            meter.note(f"{self.name}: reading {self.long_n} tokens of context", force=True)
            self.read(self.long_n)
            far = {1: float("inf"), 8: float("inf")}
            if self.long_probe:
                limit, worst = self.probe_long(limit, worst, far)
            if self.busy():
                # times taken while other work takes the CPU make the small difference the
                # attention term is (here 690 us per row per cached token, against 3-5 quiet):
                # left at 0 (cheap long contexts draft, and so bring evidence) until the curve
                # is measured again on a quiet machine
                meter.left[1] = meter.left[8] = 0
            else:
                self.attention(far, best)
                # the extra time per cached token of one row and of eight: attn0 + attn * k
                per = {k: max(0.0, far[k] - best[k]) / (self.long_n - self.prefix_n) for k in (1, 8)}
                attn = max(0.0, (per[8] - per[1]) / 7)
                attn0 = max(0.0, per[1] - attn)
        kv.reset()
        ts = [best[k] for k in self.ks]
        for i in range(1, len(ts)):  # costs are monotone in k; noise on a shared machine is not
            ts[i] = max(ts[i], ts[i - 1])
        cm = CostModel(self.ks, tuple(ts), attn, self.prefix_n, attn0=attn0)
        share = self.share()
        cm.share = round(share, 3)
        if self.probe:
            cm.max_exact_rows, cm.batch_logit_diff = limit, worst
        took = time.perf_counter() - meter.t0
        meter.finish(f"{self.name}: measured in {took:.0f} s" + ("" if share >= QUIET_SHARE else
                     f" (other work took the CPU: it had {share:.0%}; measured again when the machine is quiet)"))
        return cm

    def short(self) -> tuple[dict[int, float], int, float]:
        """The curve at the short context, each batch's rows compared with one-row decodes (the
        probe's first stage): the fastest time per size, the largest size up to which every
        probed one was exact, the largest difference seen."""
        kv, rows = self.kv, self.rows
        ref = self.references(rows)[0] if self.probe else []
        times: dict[int, list[float]] = {k: [] for k in self.ks}
        worst, inexact = 0.0, set()
        for rep in range(REPS):
            if rep and self.busy():
                break  # one pass only: this curve is measured again when the machine is quiet
            todo = self.ks if rep < 2 else [k for k in self.ks if max(times[k]) > AGREE * min(times[k])]
            for k in todo:
                base = kv.n
                times[k].append(self.timed(rows[:k]))
                if self.probe and k > 1:
                    d = self.diff(ref, k)
                    worst = max(worst, d)
                    if d != 0.0:
                        inexact.add(k)
                kv.truncate(base)
                self.meter.note(f"{self.name}: verifying {k} row{'s' if k > 1 else ''} (pass {rep + 1})")
        limit = 1
        for k in self.probed:
            if k in inexact:
                break
            limit = k
        if self.long_probe:  # the second stage checks sizes up to the first's limit only
            self.meter.left[1] -= len(rows) - limit
            for b in self.probed:
                if b > limit:
                    self.meter.left[b] -= 1
        return {k: min(v) for k, v in times.items()}, limit, worst

    def probe_long(self, limit: int, worst: float, far: dict[int, float]) -> tuple[int, float]:
        """The probe's second stage at the long context: sizes up to `limit`, the limit lowered
        at the first that differs; the times of one row and of eight kept in `far`."""
        kv, rows, n = self.kv, self.rows, self.long_n
        ref, far[1] = self.references(rows[:limit])
        last = 1
        for b in self.probed:
            if b > limit:
                break
            dt = self.timed(rows[:b])
            if b in far:
                far[b] = min(far[b], dt)
            d = self.diff(ref, b)
            kv.truncate(n)
            worst = max(worst, d)
            self.meter.note(f"{self.name}: exactness past 512 cells, {b} rows")
            if d != 0.0:
                return last, worst
            last = b
        return limit, worst

    def attention(self, far: dict[int, float], near: dict[int, float]) -> None:
        """One row and eight timed at the long context (into `far`), then at the short one
        again (into `near`; dropping cells is free): the extra time per cached token is a small
        difference of two times, so both are timed as often, and on both sides of the long
        context's (a machine drifts by a few percent)."""
        kv, rows = self.kv, self.rows
        for n, into in ((self.long_n, far), (self.prefix_n, near)):
            kv.truncate(n)
            for _ in range(LONG_REPS):
                for k in (1, 8):
                    into[k] = min(into[k], self.timed(rows[:k]))
                    kv.truncate(n)
                self.meter.note(f"{self.name}: attention after {n} tokens")


def cpu_share(ctx: Context, kv, seconds: float = 0.15) -> float:
    """The share of its threads' CPU time a one-row decode gets now (1.0: the machine is quiet
    for us), from decodes after what `kv` holds, dropped after: cheap (a few decodes), for
    between generations."""
    if kv.room() < 1:
        return 0.0
    tok = ctx.model.bos if ctx.model.bos >= 0 else 0
    base = kv.n
    kv.extend([tok])  # warm: the threads wake
    kv.truncate(base)
    wall = cpu = 0.0
    n = 0
    while n < 2 or wall < seconds:
        c0, t0 = time.process_time(), time.perf_counter()
        kv.extend([tok])
        wall += time.perf_counter() - t0
        cpu += time.process_time() - c0
        kv.truncate(base)
        n += 1
        if n >= 32:
            break
    return min(1.0, cpu / (wall * max(1, ctx.n_threads))) if wall > 0 else 1.0
