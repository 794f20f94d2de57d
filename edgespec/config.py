"""What an engine is loaded with: the models, the contexts' sizes, threads and offload, the
drafting settings the methods read, exactness, RPC servers. Plain data: the command line builds
it without loading anything (`edgespec.engine.Engine` loads it).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    model: str
    draft: str | None = None
    draft_why: str = ""  # how the draft model was chosen: "-md", "catalog pair" or "same vocabulary"
    n_ctx: int = 4096
    n_batch: int = 512
    threads: int = 0
    threads_draft: int = 0
    n_gpu_layers: int = 0
    n_gpu_layers_draft: int = 0
    draft_n_max: int = 16
    draft_n_min: int = 0
    draft_p_min: float = 0.0
    lookahead_cache: str | None = None
    history: str | None = None  # the user's reply history file, a drafting source (edgespec.history); None: off
    max_branches: int = 8
    kv_type: str = "q8_0/f16"  # K/V cache types (llama.kv_types)
    pearl_gamma: int = 4
    heads: str | None = None  # a heads file (--heads): Medusa or EAGLE
    exactness: str = "auto"  # auto | strict | batched (see edgespec.exactness)
    # K-quant weights on a CPU under strict: per-row kernels at every batch size (docs/exactness.md)
    exact_kernels: bool = False
    rpc: tuple[str, ...] = ()  # llama.cpp RPC servers (HOST:PORT) for the target's offloaded layers
    rpc_draft: tuple[str, ...] = ()  # and for the draft model's (default: the draft stays here)
