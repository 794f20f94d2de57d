"""Draft-model drafting: a small GGUF with the target's vocabulary proposes a chain.

The draft model keeps its own context and KV cache. Its cache is synced to the committed tokens
at the start of every proposal (rejected draft tokens are dropped there), so it is rolled back
with the target's without the scheduler knowing it exists.
"""

from __future__ import annotations

import time

import numpy as np

from ..draft import Draft
from ..errors import VocabMismatchError
from ..gguf_check import compare_vocab
from ..kv import KVSeq
from ..llama import Model
from ..sampling import sample, warp
from .base import NOTHING, Budget, Calibration, TokenTimed, top_prob


def check_vocab(target: Model, draft: Model) -> None:
    """Raise a clear error naming what differs between the two vocabularies (every token)."""
    compare_vocab(target.info, draft.info)
    if target.vocab_type != draft.vocab_type:
        raise VocabMismatchError(f"draft tokenizer type {draft.vocab_type} differs from target's {target.vocab_type}")
    if target.n_vocab != draft.n_vocab:
        raise VocabMismatchError(
            f"draft vocabulary differs from target: {draft.n_vocab} tokens ({draft.arch}) vs "
            f"{target.n_vocab} ({target.arch})"
        )
    for name in ("bos", "eos"):
        a, b = getattr(target, name), getattr(draft, name)
        if a != b:
            raise VocabMismatchError(f"draft {name.upper()} token {b} differs from target's {a}")


class DraftModelDrafter(TokenTimed):
    name = "draft"
    reads = NOTHING
    taps = None

    def __init__(self, model: Model, kv: KVSeq, n_max: int = 16, n_min: int = 0, p_min: float = 0.0,
                 seed: int | None = None, t_token: float = 0.0, is_stop=None):
        """`is_stop(token)`: the token ends a generation; a greedy draft ends before it (the row
        before yields it where the target ends), a sampled one with it (never a filter on a drawn
        token: the drafted law stays the draft model's)."""
        self.model = model
        self.is_stop = is_stop
        self.kv = kv
        self.n_max, self.n_min, self.p_min = n_max, n_min, p_min
        self.calib = Calibration(prior=1.0)
        self.rng = np.random.default_rng(None if seed is None else seed + 1)
        self.t_token = t_token  # drafting time per token (measured at load, then EMA)
        self.mean_conf = 0.8  # the draft model's recent top-token confidence (EMA)
        self._skipped = 0
        self._probe_every = 32

    def begin(self, prompt: list[int]) -> None:
        pass  # the cache is synced to the context on every proposal

    def propose(self, context: list[int], budget: Budget) -> Draft:
        limit = min(self.n_max, budget.max_nodes, self.kv.room() - 2)
        if limit <= 0 or limit < self.n_min:
            return Draft()
        if self.n_min == 0 and self.t_token > 0:
            # Running the draft model costs even when its draft is then dropped. When even an
            # always-right draft would not pay for the draft model's time, never run it; skip
            # it while a draft as good as the recent ones would not pay, and probe now and then.
            if budget.gate([1.0] * limit, self.t_token) == 0:
                return Draft()
            a = min(0.99, self.calib.factor(1) * self.mean_conf)
            if budget.gate([a ** i for i in range(1, limit + 1)], self.t_token) == 0:
                self._skipped += 1
                if self._skipped < self._probe_every:
                    return Draft()
                # a probe costs a catch-up of the skipped tokens: probe less often each time
                self._probe_every = min(1024, self._probe_every * 2)
            else:
                self._probe_every = 32
            self._skipped = 0
        t0 = time.perf_counter()
        row, n_new = self.kv.sync(context)
        if n_new <= 2:  # a catch-up of a token or two costs about one draft step
            self._time_token(time.perf_counter() - t0)
        ctx, sampling, stop = self.kv.ctx, budget.sampling, self.is_stop
        logits = q = None
        probs: list[np.ndarray] = []

        def top() -> float:
            nonlocal logits, q
            logits = ctx.logits(row)
            q = None if sampling.greedy else warp(logits, sampling)
            t = top_prob(logits) if q is None else float(q.max())  # the distribution's, never the drawn token's
            self.mean_conf = 0.95 * self.mean_conf + 0.05 * t
            return t

        def draw() -> int | None:
            if q is None:
                x = int(np.argmax(logits))
                # greedy: the target ends here if the row before yields the end token, which it
                # does as the step's own token; the end token's row would buy nothing
                return None if stop is not None and stop(x) else x
            probs.append(q)
            return sample(q, self.rng)

        def advance(x: int, n: int) -> bool:
            nonlocal row
            if stop is not None and stop(x):
                return False  # sampled: a stop after a drafted token, never a filter on it (exactness)
            t0 = time.perf_counter()
            row = self.kv.extend([x])
            self._time_token(time.perf_counter() - t0)
            return True

        tokens, est, _ = self.gated_chain(budget, limit, self.n_min, self.p_min, top, draw, advance)
        if len(tokens) < max(1, self.n_min):
            return Draft()
        return Draft.chain(tokens, probs or None, self.name, est)

    def end(self) -> None:
        pass
