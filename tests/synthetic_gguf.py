"""The hyperparameters every llama-like synthetic test model states (synthetic_tiny, synthetic_kquant,
synthetic_mtp): a GGUFWriter with them written; each caller adds its own keys and tensors."""

from __future__ import annotations

from pathlib import Path

import gguf


def llama_like_writer(path: str | Path, arch: str, *, n_ctx: int, n_embd: int, n_layer: int, n_ff: int,
                      n_head: int, n_head_kv: int, head_dim: int, n_vocab: int) -> gguf.GGUFWriter:
    wr = gguf.GGUFWriter(str(path), arch)
    wr.add_uint32(f"{arch}.context_length", n_ctx)
    wr.add_uint32(f"{arch}.embedding_length", n_embd)
    wr.add_uint32(f"{arch}.block_count", n_layer)
    wr.add_uint32(f"{arch}.feed_forward_length", n_ff)
    wr.add_uint32(f"{arch}.attention.head_count", n_head)
    wr.add_uint32(f"{arch}.attention.head_count_kv", n_head_kv)
    wr.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    wr.add_float32(f"{arch}.rope.freq_base", 10000.0)
    wr.add_uint32(f"{arch}.rope.dimension_count", head_dim)
    wr.add_uint32(f"{arch}.vocab_size", n_vocab)
    wr.add_uint32("general.file_type", 0)
    return wr
