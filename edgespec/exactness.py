"""The exactness policy in force on an engine (docs/exactness.md): from what was asked
(`--exactness`), what the probe found bit-exact against one-row decodes (the cost curve's
`max_exact_rows`) and whether the target runs on a GPU; what it promises, the notes when it turns
speculation off or lets batches differ, and whether a model is loaded with per-row kernels. The
rules over one cost curve (`resolve_policy`, `verify_rows`, `guarantee`) are in costmodel.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from . import kernels
from .costmodel import CostModel, guarantee, resolve_policy, verify_rows
from .llama import batch_dependent, kv_paths_agree, use_exact_kernels

log = logging.getLogger(__name__)


def exact_kernels(requested: str, asked: bool, n_gpu_layers: int, rpc: bool, path: str | os.PathLike) -> bool:
    """Whether the target is loaded with per-row kernels (`--exact-kernels`, asked for it): under
    strict exactness (asked, or auto's choice on a CPU), for a model all on this CPU whose weights
    take batch-dependent kernels with llama.cpp's stock kernels (the repacked Q4_K GEMM from 4 rows
    and the tiled K-quant kernel from 8 made Qwen2.5-Coder-1.5B Q4_K_M exact to only 3 rows). Asks
    the CPU backend for them, so that verifying up to 32 rows stays bit-identical to plain decoding,
    at ~1.5x the plain step. Where edgespec's batch-invariant kernels are loaded (kernels.py) they
    already keep 32 rows exact at full speed, and the flag does nothing."""
    return (asked and requested != "batched" and n_gpu_layers == 0 and not rpc and not kernels.batch_invariant()
            and batch_dependent(path) and use_exact_kernels())


@dataclass(frozen=True)
class Exactness:
    """The policy in force for one cost curve on one backend (made on demand: the engine's curve
    is measured again at times, and tests swap it)."""

    requested: str  # auto | strict | batched (--exactness)
    cost: CostModel
    gpu: bool  # the target runs (partly) on a GPU here
    exact_kernels: bool = False  # loaded with per-row kernels (exact_kernels above)

    @property
    def policy(self) -> str:
        """strict or batched (costmodel.resolve_policy)."""
        return resolve_policy(self.requested, self.cost.max_exact_rows, self.gpu)

    @property
    def max_verify_rows(self) -> int:
        """The most rows one verification decodes under the policy in force."""
        return verify_rows(self.cost, self.policy)

    @property
    def kernels(self) -> str:
        """The CPU kernels the probe read: 'batch-invariant' (edgespec's patched ggml-cpu), 'per-row'
        (stock, weights not repacked and the tiled kernel off: --exact-kernels) or 'stock'."""
        if self.exact_kernels:
            return "per-row"
        return "batch-invariant" if kernels.batch_invariant() else "stock"

    def info(self) -> dict:
        """The probe's result and the policy in force, as stats, bench and the UI show them."""
        c, policy = self.cost, self.policy
        return {"policy": policy, "requested": self.requested, "backend": "gpu" if self.gpu else "cpu",
                "kernels": self.kernels,
                "max_exact_rows": c.max_exact_rows, "max_verify_rows": self.max_verify_rows,
                "batch_logit_diff": c.batch_logit_diff, "guarantee": guarantee(policy, c)}

    def warn(self, name: str, kv_type: str) -> None:
        """Log what the policy costs for model `name` with a `kv_type` KV cache, where it costs
        something: batches verified though they differ from one-row decodes, or nothing verified
        beyond one row."""
        c, policy = self.cost, self.policy
        if policy == "batched" and c.max_exact_rows < 32:
            log.warning("%s: batched logits differ from one-row decodes on this backend (bit-exact up to %d rows, "
                        "max |delta logit| %s): verifying in batches anyway (--exactness %s): %s; --exactness strict "
                        "keeps greedy output bit-identical instead", name, c.max_exact_rows,
                        "?" if c.batch_logit_diff is None else f"{c.batch_logit_diff:.3g}", self.requested,
                        "sampled output follows the distribution as this backend computes it, greedy output can "
                        "differ from plain decoding at near-ties")
        elif policy == "strict" and c.max_exact_rows <= 1:
            log.warning("%s: no batch of rows is bit-exact against one-row decodes on this backend, so strict "
                        "exactness leaves nothing to verify: speculation is off (--exactness batched turns it on, "
                        "guaranteeing the distribution, not bit-identical greedy output)", name)
        if not kv_paths_agree(kv_type) and c.max_exact_rows <= 1 and policy == "strict":
            log.warning("with an %s KV cache, llama.cpp's CPU attention takes one kernel for one row and another for "
                        "many past 512 cells (the probe found no batch bit-identical to one-row decodes): "
                        "speculation then verifies one row at a time; a q8_0 K cache (the q8_0/f16 default) keeps "
                        "batches exact", kv_type)
