"""The measured cost of verifying k tokens on this machine, and the draft size it pays for.

Verifying k rows costs t(k); on a 2-core CPU t(8) is several times t(1), on a GPU nearly t(1).
A step that drafts nodes with acceptance probabilities P_1 >= P_2 >= ... (each the chance that
the path to that node is accepted) yields 1 + sum(P_i) tokens for t(rows) seconds; plain
decoding yields 1 token for t(1). Drafters size each step to maximize that ratio.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass

from .llama import Context

KS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32)


@dataclass
class CostModel:
    ks: tuple[int, ...]
    ts: tuple[float, ...]  # seconds per decode of k rows, all with logits

    def t(self, k: int) -> float:
        ks, ts = self.ks, self.ts
        if k <= ks[0]:
            return ts[0]
        for i in range(1, len(ks)):
            if k <= ks[i]:
                f = (k - ks[i - 1]) / (ks[i] - ks[i - 1])
                return ts[i - 1] + f * (ts[i] - ts[i - 1])
        slope = (ts[-1] - ts[-2]) / (ks[-1] - ks[-2])
        return ts[-1] + slope * (k - ks[-1])

    def best_size(self, probs: list[float], fixed_rows: int = 1, per_node: float = 0.0, margin: float = 0.02) -> int:
        """How many of the candidate nodes (in the given order) to verify.

        `probs[i]` is the chance that node i's path is accepted; `per_node` the drafting time per
        node. Returns 0 when no size beats plain decoding by `margin`.
        """
        plain = 1.0 / self.t(fixed_rows)
        best_n, best_rate = 0, plain * (1.0 + margin)
        gain = 1.0
        for n, p in enumerate(probs, start=1):
            gain += p
            rate = gain / (self.t(fixed_rows + n) + per_node * n)
            if rate > best_rate:
                best_n, best_rate = n, rate
        return best_n

    def to_dict(self) -> dict:
        return {"k": list(self.ks), "ms": [round(t * 1e3, 3) for t in self.ts]}


def flat(seconds: float = 0.01) -> CostModel:
    """A machine where verifying k tokens costs as much as one (a fast GPU), for tests."""
    return CostModel(KS, tuple(seconds for _ in KS))


def _key(ctx: Context, n_gpu_layers: int) -> str:
    p = ctx.model.path
    st = p.stat()
    return f"{p.resolve()}|{st.st_size}|{st.st_mtime_ns}|t{ctx.n_threads}|ngl{n_gpu_layers}|{platform.node()}"


def measure(ctx: Context, kv, reps: int = 5) -> CostModel:
    """Time decodes of k rows (logits on every row, as verification needs) on an empty cache."""
    tok = ctx.model.bos if ctx.model.bos >= 0 else 0
    prefix = min(32, ctx.n_ctx // 4)  # a short context, so attention is not free
    ks = tuple(k for k in KS if k <= ctx.n_batch and prefix + k <= ctx.n_ctx)
    kv.reset()
    kv.extend([tok] * prefix, want_logits=False)
    # Repetitions interleave the sizes, so a burst of load elsewhere hits all sizes alike.
    best = {k: float("inf") for k in ks}
    ctx.decode([tok] * ks[-1], list(range(prefix, prefix + ks[-1])), None, [True] * ks[-1])  # warm-up
    ctx.mem_seq_rm(0, prefix, -1)
    for _ in range(reps):
        for k in ks:
            t0 = time.perf_counter()
            ctx.decode([tok] * k, list(range(prefix, prefix + k)), None, [True] * k)
            best[k] = min(best[k], time.perf_counter() - t0)
            ctx.mem_seq_rm(0, prefix, -1)
    ts = [best[k] for k in ks]
    kv.reset()
    # Costs are monotone in k; noise on a shared machine is not.
    for i in range(1, len(ts)):
        ts[i] = max(ts[i], ts[i - 1])
    return CostModel(ks, tuple(ts))


def load_or_measure(ctx: Context, kv, cache_file: str | os.PathLike, n_gpu_layers: int = 0) -> CostModel:
    key = _key(ctx, n_gpu_layers)
    data: dict = {}
    try:
        with open(cache_file) as f:
            data = json.load(f)
        rec = data.get(key)
        if rec:
            return CostModel(tuple(rec["k"]), tuple(t / 1e3 for t in rec["ms"]))
    except (OSError, ValueError, KeyError):
        data = {}
    cm = measure(ctx, kv)
    data[key] = cm.to_dict()
    try:
        os.makedirs(os.path.dirname(cache_file), exist_ok=True)
        tmp = f"{cache_file}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, cache_file)
    except OSError:
        pass
    return cm
