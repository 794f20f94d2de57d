"""The target's own token embeddings and output matrix, read from its GGUF file.

Heads draft through the target's frozen LM head (Medusa with tied heads, EAGLE, MTP) and EAGLE
feeds the target's token embeddings into its layer. llama.cpp has no API for either, so the rows
are read from the file (memory-mapped, dequantized with the `gguf` package's ggml kernels in
numpy) only for the tokens asked: the draft vocabulary once, an embedding row per new token.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..errors import ModelError
from ..gguf_check import tensor_location

_EMBD = "token_embd.weight"
_OUTPUT = "output.weight"


class TensorRows:
    """Rows of one 2-D GGUF tensor ([n_rows, n_cols] as numpy sees it), dequantized on demand."""

    def __init__(self, path: str | os.PathLike, name: str, n_rows: int, n_cols: int):
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        loc = tensor_location(path, name)
        if loc is None:
            raise ModelError(f"{path} has no tensor {name}")
        self.qtype = GGMLQuantizationType(loc.ggml_type)
        block, type_size = GGML_QUANT_SIZES[self.qtype]
        self.row_bytes = n_cols // block * type_size
        if self.row_bytes * n_rows != loc.nbytes:
            raise ModelError(f"{path}: tensor {name} is {loc.nbytes} bytes, expected {n_rows} rows of {self.row_bytes}")
        self.raw = np.memmap(Path(path), dtype=np.uint8, mode="r", offset=loc.offset, shape=(n_rows, self.row_bytes))
        self.n_rows, self.n_cols = n_rows, n_cols

    def rows(self, ids) -> np.ndarray:
        """float32 [len(ids), n_cols]."""
        from gguf.quants import dequantize

        raw = np.ascontiguousarray(self.raw[np.asarray(ids, dtype=np.int64)])
        return dequantize(raw, self.qtype).astype(np.float32, copy=False).reshape(len(raw), self.n_cols)


class TargetWeights:
    """The token embedding table and the LM head of a target GGUF (tied when it has no `output`)."""

    def __init__(self, path: str | os.PathLike, n_vocab: int, n_embd: int):
        self.path, self.n_vocab, self.n_embd = Path(path), n_vocab, n_embd
        self.embd = TensorRows(path, _EMBD, n_vocab, n_embd)
        self.tied = tensor_location(path, _OUTPUT) is None
        self.out = self.embd if self.tied else TensorRows(path, _OUTPUT, n_vocab, n_embd)
        self._emb_cache: dict[int, np.ndarray] = {}

    def embed(self, tokens) -> np.ndarray:
        """float32 [len(tokens), n_embd]; rows are kept once read (a generation reuses few)."""
        cache = self._emb_cache
        missing = sorted({int(t) for t in tokens if int(t) not in cache})
        if missing:
            for t, row in zip(missing, self.embd.rows(missing)):
                cache[t] = row
        return np.stack([cache[int(t)] for t in tokens]) if len(tokens) else np.zeros((0, self.n_embd), np.float32)

    def lm_head(self, ids=None) -> np.ndarray:
        """The output matrix rows of `ids` (all tokens when None), float32 [K, n_embd]."""
        ids = np.arange(self.n_vocab) if ids is None else ids
        out = np.empty((len(ids), self.n_embd), np.float32)
        for s in range(0, len(ids), 8192):
            out[s : s + 8192] = self.out.rows(ids[s : s + 8192])
        return out
