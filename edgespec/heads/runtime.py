"""Medusa heads and the EAGLE head evaluated in numpy, from a heads file and the target's weights.

Both are small beside the target (a ResBlock per Medusa head; one decoder layer for EAGLE); what
dominates is the projection onto the vocabulary, so it is computed only over the draft
vocabulary (`draft_vocab`, K tokens) with the target's own LM head rows (or the heads' own).
EAGLE keeps a KV cache of its own over the committed text: one entry per position i, built from
the target's feature at i and the token at i+1. Draft tree nodes get temporary entries that
attend to the cache and to their ancestors only.
"""

from __future__ import annotations

import numpy as np

from .format import HeadsError, HeadsFile
from .target import TargetWeights


def softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    e = np.exp(x)
    return e / e.sum(axis=-1, keepdims=True)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x: np.ndarray, pos: np.ndarray, theta: float) -> np.ndarray:
    """Rotary embedding as Hugging Face's LLaMA applies it (halves rotated): x [n, heads, hd]."""
    hd = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd)
    ang = pos.astype(np.float64)[:, None] * inv[None, :]
    cos = np.cos(np.concatenate([ang, ang], -1)).astype(np.float32)[:, None, :]
    sin = np.sin(np.concatenate([ang, ang], -1)).astype(np.float32)[:, None, :]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return x * cos + np.concatenate([-x2, x1], -1) * sin


class DraftVocab:
    """The LM head restricted to the draft vocabulary: features -> probabilities over K tokens."""

    def __init__(self, ids: np.ndarray, weight: np.ndarray):
        self.ids = ids.astype(np.int64)
        self.w_t = np.ascontiguousarray(weight.T, dtype=np.float32)  # [d, K]

    def probs(self, h: np.ndarray) -> np.ndarray:
        return softmax(h @ self.w_t)


def _vocab(heads: HeadsFile, target: TargetWeights, own: np.ndarray | None) -> DraftVocab:
    ids = heads.draft_vocab
    if ids is None:
        ids = np.arange(target.n_vocab)
    if own is not None:
        w = own[ids] if own.shape[0] == target.n_vocab else own
        if w.shape[0] != len(ids):
            raise HeadsError(f"LM head of {w.shape[0]} rows for a draft vocabulary of {len(ids)}")
        return DraftVocab(ids, w.astype(np.float32))
    return DraftVocab(ids, target.lm_head(ids))


class MedusaHeads:
    """Head k (0-based) maps the feature at position i to the token at i+2+k."""

    def __init__(self, heads: HeadsFile, target: TargetWeights):
        t = heads.tensors
        self.n_heads = int(heads.get("medusa.n_heads"))
        self.n_layers = int(heads.get("medusa.n_layers"))
        self.res = [[(np.ascontiguousarray(t[f"medusa.{h}.res.{l}.weight"].astype(np.float32).T),
                      t[f"medusa.{h}.res.{l}.bias"].astype(np.float32)) for l in range(self.n_layers)]
                    for h in range(self.n_heads)]
        own = [t.get(f"medusa.{h}.output.weight") for h in range(self.n_heads)]
        if all(o is None for o in own):
            shared = _vocab(heads, target, None)
            self.vocab = [shared] * self.n_heads
        else:
            self.vocab = [_vocab(heads, target, o) for o in own]
        self.tied = all(o is None for o in own)

    def hidden(self, h: np.ndarray) -> np.ndarray:
        """[n_heads, d]: each head's ResBlocks over one feature."""
        out = []
        for blocks in self.res:
            x = h
            for w_t, b in blocks:
                x = x + silu(x @ w_t + b)
            out.append(x)
        return np.stack(out)

    def probs(self, h: np.ndarray) -> np.ndarray:
        """[n_heads, K] probabilities over the draft vocabulary."""
        x = self.hidden(h)
        if self.tied:
            return self.vocab[0].probs(x)
        return np.stack([v.probs(x[i]) for i, v in enumerate(self.vocab)])


class EagleHead:
    """EAGLE-1/2: fc(cat(embedding(token at i+1), feature at i)) -> one LLaMA decoder layer (no
    input norm) -> the predicted feature at i+1, read through the target's LM head.

    MTP (DeepSeek-V3's module, heads kind "mtp") is the same shape with norms: fc (eh_proj) over
    cat(RMSNorm(embedding), RMSNorm(feature)), a pre-norm decoder layer, a final RMSNorm before
    the shared LM head; trained for the token after next only."""

    def __init__(self, heads: HeadsFile, target: TargetWeights, capacity: int):
        t = heads.tensors
        k = heads.kind  # tensor prefix: "eagle" or "mtp"
        f32 = lambda name: None if t.get(name.replace("eagle.", k + ".", 1)) is None else \
            t[name.replace("eagle.", k + ".", 1)].astype(np.float32)  # noqa: E731
        self.enorm, self.hnorm = f32("eagle.enorm.weight"), f32("eagle.hnorm.weight")
        self.attn_norm, self.out_norm = f32("eagle.attn_norm.weight"), f32("eagle.output_norm.weight")
        self.n_head = int(heads.get(f"{k}.n_head"))
        self.n_kv = int(heads.get(f"{k}.n_head_kv"))
        self.hd = int(heads.get(f"{k}.head_dim"))
        self.theta = float(heads.get(f"{k}.rope_theta", 10000.0))
        self.eps = float(heads.get(f"{k}.rms_eps", 1e-5))
        # Weights are kept as [in, out] (x @ W, the fastest layout for a few rows here: drafting
        # reads every weight once per call, so it is bound by memory bandwidth); q, k, v are one
        # matrix and so are gate and up: fewer calls.
        T = lambda a: np.ascontiguousarray(a.T)  # noqa: E731
        self.fc, self.fc_b = T(f32("eagle.fc.weight")), f32("eagle.fc.bias")
        self.w_qkv = T(np.concatenate([f32(f"eagle.attn_{x}.weight") for x in "qkv"]))
        bias = [f32(f"eagle.attn_{x}.bias") for x in "qkv"]
        self.b_qkv = None if all(b is None for b in bias) else np.concatenate(
            [b if b is not None else np.zeros(w, np.float32) for b, w in
             zip(bias, (self.n_head * self.hd, self.n_kv * self.hd, self.n_kv * self.hd))])
        self.wo = T(f32("eagle.attn_output.weight"))
        self.ffn_norm = f32("eagle.ffn_norm.weight")
        self.n_ff = f32("eagle.ffn_gate.weight").shape[0]
        self.w_gate_up = T(np.concatenate([f32("eagle.ffn_gate.weight"), f32("eagle.ffn_up.weight")]))
        self.w_down = T(f32("eagle.ffn_down.weight"))
        own_embd = f32("eagle.token_embd.weight")
        self._embd = own_embd.astype(np.float32) if own_embd is not None else None
        self.target = target
        self.vocab = _vocab(heads, target, t.get(f"{k}.output.weight"))
        self.capacity = capacity
        self.k_cache = np.zeros((capacity, self.n_kv, self.hd), np.float32)
        self.v_cache = np.zeros((capacity, self.n_kv, self.hd), np.float32)
        self.n = 0
        self.committed: list[int] | None = None  # the text whose first n entries the cache holds

    def embed(self, tokens) -> np.ndarray:
        if self._embd is not None:
            return self._embd[np.asarray(tokens, dtype=np.int64)]
        return self.target.embed(tokens)

    def reset(self) -> None:
        self.n = 0
        self.committed = None

    def truncate(self, n: int) -> None:
        """Keep the first `n` entries (the prefix a new generation shares with the last)."""
        self.n = max(0, min(self.n, n))

    def probs(self, out: np.ndarray) -> np.ndarray:
        """Probabilities over the draft vocabulary from the layer's output features."""
        return self.vocab.probs(out if self.out_norm is None else rms_norm(out, self.out_norm, self.eps))

    def layer(self, tokens, feats: np.ndarray, pos: np.ndarray, k_extra: np.ndarray, v_extra: np.ndarray,
              mask_extra: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Rows (token at i+1, feature at i) at positions `pos`; each attends to the whole cache
        plus the extra entries that `mask_extra` [n, n_extra + n] allows (extra, then itself and
        the other new rows). Returns (output features, their k, their v)."""
        n = len(pos)
        e = self.embed(tokens)
        if self.enorm is not None:
            e, feats = rms_norm(e, self.enorm, self.eps), rms_norm(feats, self.hnorm, self.eps)
        x = np.concatenate([e, feats], -1) @ self.fc
        if self.fc_b is not None:
            x = x + self.fc_b
        qkv = (x if self.attn_norm is None else rms_norm(x, self.attn_norm, self.eps)) @ self.w_qkv
        if self.b_qkv is not None:
            qkv = qkv + self.b_qkv
        nq, nk = self.n_head * self.hd, self.n_kv * self.hd
        q, k, v = qkv[:, :nq], qkv[:, nq : nq + nk], qkv[:, nq + nk :]
        q = rope(q.reshape(n, self.n_head, self.hd), pos, self.theta)
        k = rope(k.reshape(n, self.n_kv, self.hd), pos, self.theta)
        v = v.reshape(n, self.n_kv, self.hd)
        keys = np.concatenate([self.k_cache[: self.n], k_extra, k])
        vals = np.concatenate([self.v_cache[: self.n], v_extra, v])
        mask = np.concatenate([np.ones((n, self.n), bool), mask_extra], 1)  # [n, M]
        g = self.n_head // self.n_kv
        qg = q.reshape(n, self.n_kv, g, self.hd)
        s = np.einsum("nkgd,mkd->nkgm", qg, keys) * float(self.hd ** -0.5)  # a Python float keeps float32
        s = np.where(mask[:, None, None, :], s, -np.inf)
        a = softmax(s)
        o = np.einsum("nkgm,mkd->nkgd", a, vals).reshape(n, self.n_head * self.hd) @ self.wo
        x = x + o
        gu = rms_norm(x, self.ffn_norm, self.eps) @ self.w_gate_up
        x = x + (silu(gu[:, : self.n_ff]) * gu[:, self.n_ff :]) @ self.w_down
        return x, k, v

    def commit(self, tokens, feats: np.ndarray, pos0: int) -> np.ndarray:
        """Append committed pairs at positions pos0.. (causal among themselves); returns their outputs."""
        n = len(tokens)
        if pos0 != self.n:
            raise HeadsError(f"internal: EAGLE cache at {self.n}, pairs from {pos0}")
        if self.n + n > self.capacity:
            raise HeadsError("internal: EAGLE cache full")
        empty = np.zeros((0, self.n_kv, self.hd), np.float32)
        out, k, v = self.layer(tokens, feats, np.arange(pos0, pos0 + n), empty, empty, np.tril(np.ones((n, n), bool)))
        self.k_cache[self.n : self.n + n] = k
        self.v_cache[self.n : self.n + n] = v
        self.n += n
        return out
