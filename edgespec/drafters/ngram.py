"""Prompt-lookup n-gram drafting (as llama.cpp's `llama-lookup` and HF prompt lookup).

The last n tokens (n from `n_max` down to `n_min`) are looked up in everything seen so far,
prompt and output; the tokens that followed their latest earlier occurrence are the draft.
"""

from __future__ import annotations

import numpy as np

from ..draft import Draft
from .base import NOTHING, Budget, Calibration, Candidates, Proposal


class NgramIndex:
    """n-gram -> position right after its latest occurrence, for n in [n_min, n_max].

    Only occurrences with a known continuation are indexed, so a lookup never points at the end.
    """

    def __init__(self, n_min: int = 1, n_max: int = 3):
        self.n_min, self.n_max = n_min, n_max
        self.maps: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(n_min, n_max + 1)}
        self.indexed = 0  # continuation positions indexed so far

    def reset(self) -> None:
        for m in self.maps.values():
            m.clear()
        self.indexed = 0

    def update(self, tokens: list[int]) -> None:
        # position i is the continuation of the n-gram tokens[i-n:i]
        for i in range(max(self.indexed, 1), len(tokens)):
            for n, m in self.maps.items():
                if i >= n:
                    m[tuple(tokens[i - n : i])] = i
        self.indexed = max(self.indexed, len(tokens))

    def lookup(self, tokens: list[int], k: int) -> tuple[int, list[int]]:
        """(matched n, up to k continuation tokens) for the longest matching suffix."""
        self.update(tokens)
        for n in range(self.n_max, self.n_min - 1, -1):
            if len(tokens) < n:
                continue
            pos = self.maps[n].get(tuple(tokens[-n:]))
            if pos is not None:
                return n, tokens[pos : pos + k]
        return 0, []


class NgramDrafter:
    name = "ngram"
    reads = NOTHING
    taps = None

    def __init__(self, n_min: int = 1, n_max: int = 3, max_len: int = 16, is_stop=None):
        """`is_stop(token)`: the token ends a generation; a draft ends before it (see lookahead)."""
        self.index = NgramIndex(n_min, n_max)
        self.is_stop = is_stop
        self.max_len = max_len
        # Chance that a token is accepted given the one before it was, per matched n and depth;
        # longer matches start more trusted.
        self.cond = {n: Calibration(prior=min(0.9, 0.3 + 0.2 * n)) for n in range(n_min, n_max + 1)}
        self._last_n = 0

    def begin(self, prompt: list[int]) -> None:
        self.index.reset()
        self.index.update(prompt)

    def propose(self, context: list[int], budget: Budget) -> Proposal:
        k = min(self.max_len, budget.max_nodes)
        if k <= 0:
            return Draft()
        n, cont = self.index.lookup(context, k)
        if self.is_stop is not None:
            cut = next((i for i, t in enumerate(cont) if self.is_stop(t)), None)
            cont = cont if cut is None else cont[:cut]  # (see lookahead: an end token's row buys nothing)
        if not cont:
            return Draft()
        cal = self.cond[n]
        cond = [min(1.0, cal.factor(d + 1)) for d in range(len(cont))]
        return Candidates(list(np.cumprod(cond)), lambda size: self._take(cont, n, size))

    def _take(self, cont: list[int], n: int, size: int) -> Draft:
        if size == 0:
            # Not worth it now; still probe one token now and then so the estimate can recover.
            self._skipped = getattr(self, "_skipped", 0) + 1
            if self._skipped < 32:
                return Draft()
            size = 1
        self._skipped = 0
        self._last_n = n
        return Draft.chain(cont[:size], source=self.name, est=[1.0] * size)

    def accept(self, draft: Draft, accepted: list[int], committed: list[int]) -> None:
        if draft.tokens:
            self.cond[self._last_n].update(draft, accepted)

    def end(self) -> None:
        pass
