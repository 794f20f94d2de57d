"""Sampling settings and the warp from logits to a distribution.

The same warp is applied to target and draft logits, so rejection sampling compares the two
distributions a user actually asked for. Order as llama.cpp's default chain: top-k, top-p, min-p
on the untempered distribution, then temperature over what survives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .errors import EdgespecError

RANDOM_SEED = -1  # llama.cpp's spelling of "no seed: fresh randomness"


@dataclass(frozen=True)
class SamplingConfig:
    temp: float = 0.0  # <= 0: greedy
    top_k: int = 40  # <= 0: off
    top_p: float = 0.95  # >= 1: off
    min_p: float = 0.05  # <= 0: off
    seed: int | None = None
    # What shapes the target's distribution beyond the warp (edgespec.rows): a GBNF grammar the
    # output must follow, OpenAI's presence/frequency penalties over the generated tokens, a
    # bias per token id; and how many top log-probabilities to report per token (None: none).
    grammar: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temp <= 0.0


class SamplingError(EdgespecError):
    """A sampling setting out of range (the CLI and batch lines share this check)."""


MAX_TOP_LOGPROBS = 20  # as OpenAI's API


def make_sampling(temp=0.0, top_k=40, top_p=0.95, min_p=0.05, seed=None, grammar=None, presence_penalty=0.0,
                  frequency_penalty=0.0, logit_bias=None, logprobs=None) -> SamplingConfig:
    """Validated settings, as the command line and request bodies give them. `seed` -1 (as in
    llama.cpp) or None means fresh randomness for every run. `logit_bias` maps token ids to a
    bias in [-100, 100] (OpenAI's range; -100 bans the token); `logprobs` is the number of top
    alternatives reported per token (0: only the chosen token's), at most 20."""

    def num(x) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

    def integer(x) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    if not num(temp) or not 0 <= temp <= 2:
        raise SamplingError("temperature must be a number in [0, 2]")
    if not integer(top_k) or top_k < 0:
        raise SamplingError("top_k must be a non-negative integer (0: off)")
    if not num(top_p) or not 0 < top_p <= 1:
        raise SamplingError("top_p must be a number in (0, 1] (1: off)")
    if not num(min_p) or not 0 <= min_p <= 1:
        raise SamplingError("min_p must be a number in [0, 1] (0: off)")
    if seed is not None and (not integer(seed) or seed < RANDOM_SEED or seed >= 2**63):
        raise SamplingError("seed must be an integer, non-negative, or -1 for a random seed")
    if seed == RANDOM_SEED:
        seed = None
    for name, v in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
        if not num(v) or not -2 <= v <= 2:
            raise SamplingError(f"{name} must be a number in [-2, 2]")
    bias: list[tuple[int, float]] = []
    for k, v in (logit_bias or {}).items():
        tok = int(k) if isinstance(k, str) and k.strip().lstrip("-").isdigit() else k
        if not integer(tok) or tok < 0:
            raise SamplingError(f"logit_bias keys must be token ids, not {k!r}")
        if not num(v) or not -100 <= v <= 100:
            raise SamplingError(f"logit_bias[{k}] must be a number in [-100, 100]")
        bias.append((tok, float(v)))
    if logprobs is not None and (not integer(logprobs) or not 0 <= logprobs <= MAX_TOP_LOGPROBS):
        raise SamplingError(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}]")
    if grammar is not None and (not isinstance(grammar, str) or not grammar.strip()):
        raise SamplingError("the grammar is empty")
    return SamplingConfig(float(temp), int(top_k), float(top_p), float(min_p), seed, grammar,
                          float(presence_penalty), float(frequency_penalty), tuple(sorted(bias)), logprobs)


def softmax(x: np.ndarray) -> np.ndarray:
    z = x - x.max()
    e = np.exp(z, dtype=np.float64)
    return e / e.sum()


def warp(logits: np.ndarray, cfg: SamplingConfig) -> np.ndarray:
    """Full-vocabulary probabilities (float64) after top-k / top-p / min-p / temperature."""
    x = np.asarray(logits, dtype=np.float64)
    n = x.shape[0]
    if cfg.top_k > 0 and cfg.top_k < n:
        idx = np.argpartition(-x, cfg.top_k - 1)[: cfg.top_k]
    else:
        idx = np.arange(n)
    sub = x[idx]
    order = np.argsort(-sub, kind="stable")
    idx, sub = idx[order], sub[order]
    p = softmax(sub)
    keep = len(p)
    if cfg.top_p < 1.0:
        c = np.cumsum(p)
        keep = min(keep, int(np.searchsorted(c, cfg.top_p, side="left")) + 1)
    if cfg.min_p > 0.0:
        keep = min(keep, max(1, int(np.count_nonzero(p >= cfg.min_p * p[0]))))
    idx, sub = idx[:keep], sub[:keep]
    out = np.zeros(n, dtype=np.float64)
    out[idx] = softmax(sub / max(cfg.temp, 1e-6))
    return out


def pick(logits: np.ndarray, cfg: SamplingConfig, rng: np.random.Generator) -> int:
    """The next token from one row of logits: argmax when greedy, else a draw after the warp."""
    if cfg.greedy:
        return int(np.argmax(logits))
    return sample(warp(logits, cfg), rng)


def sample(p: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one index from a (possibly unnormalized) non-negative vector."""
    c = np.cumsum(p)
    total = c[-1]
    if total <= 0:
        return int(np.argmax(p))
    return int(min(np.searchsorted(c, rng.random() * total, side="right"), len(p) - 1))
