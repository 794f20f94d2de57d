"""KV cache types: names, the K/V spelling, and which pairs keep llama.cpp's CPU attention on one path."""

from __future__ import annotations

from .errors import EdgespecError

# KV cache types. A q8_0 K cache is the default because it keeps greedy speculation bit-exact on a
# CPU: llama.cpp's CPU flash attention has three paths (ggml-cpu ops.cpp), a split-KV one for a
# single row once 512 cells are in use and a tiled one for batches, both only when K and V are the
# same float type (f16/f32), and a one-row-at-a-time vector path otherwise. Those paths sum in
# other orders, so with an f16/f16 cache a verified batch can differ from plain decoding in the last
# bits (and flip a near-tie) past 256 tokens. With K and V of different types every row count takes
# the vector path; q8_0 K with f16 V is also the fastest pair here (the V accumulation skips the
# q8_0 dequantization), for one row and for many.
KV_TYPES = {"f16": 1, "q8_0": 8, "bf16": 30}
DEFAULT_KV = "q8_0/f16"


def kv_types(spec: str) -> tuple[str, str]:
    """K and V cache types from "T" (both) or "K/V"."""
    k, _, v = spec.partition("/")
    v = v or k
    for t in (k, v):
        if t not in KV_TYPES:
            raise EdgespecError(f"unknown KV cache type {t!r} in {spec!r}; choose from {', '.join(KV_TYPES)} "
                                f"(one type for both, or K/V such as q8_0/f16)")
    return k, v


def kv_spec(k: str, v: str | None = None) -> str:
    """The canonical spelling: "T" when K and V agree, else "K/V"."""
    v = v or k
    return k if k == v else f"{k}/{v}"


def kv_paths_agree(spec: str) -> bool:
    """Whether llama.cpp's CPU attention takes one path for one row and for many with this cache
    (K and V types differ, or neither is a float type); the load probe checks it either way."""
    k, v = kv_types(spec)
    return k != v or k not in ("f16", "bf16")
