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
from ..kv import KVSeq
from ..llama import Model
from ..sampling import sample, warp
from .base import Budget, Calibration


def check_vocab(target: Model, draft: Model) -> None:
    """Raise a clear error naming what differs between the two vocabularies."""
    if target.n_vocab != draft.n_vocab:
        raise VocabMismatchError(
            f"draft vocabulary differs from target: {draft.n_vocab} tokens ({draft.arch}) vs "
            f"{target.n_vocab} ({target.arch})"
        )
    if target.vocab_type != draft.vocab_type:
        raise VocabMismatchError(f"draft tokenizer type {draft.vocab_type} differs from target's {target.vocab_type}")
    for name in ("bos", "eos"):
        a, b = getattr(target, name), getattr(draft, name)
        if a != b:
            raise VocabMismatchError(f"draft {name.upper()} token {b} differs from target's {a}")
    step = max(1, target.n_vocab // 997)
    for t in range(0, target.n_vocab, step):
        if target.token_text(t) != draft.token_text(t):
            raise VocabMismatchError(
                f"draft vocabulary differs from target at token {t}: {draft.token_text(t)!r} vs {target.token_text(t)!r}"
            )


class DraftModelDrafter:
    name = "draft"
    needs_target_hidden = False

    def __init__(self, model: Model, kv: KVSeq, n_max: int = 16, n_min: int = 0, p_min: float = 0.0,
                 seed: int | None = None, t_token: float = 0.0):
        self.model = model
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
            if budget.size([1.0] * limit, self.t_token) == 0:
                return Draft()
            a = min(0.99, self.calib.factor(1) * self.mean_conf)
            if budget.size([a ** i for i in range(1, limit + 1)], self.t_token) == 0:
                self._skipped += 1
                if self._skipped < self._probe_every:
                    return Draft()
                # a probe costs a catch-up of the skipped tokens: probe less often each time
                self._probe_every = min(1024, self._probe_every * 2)
            else:
                self._probe_every = 32
            self._skipped = 0
        keep = self.kv.common_prefix(context)
        if keep == len(context):
            keep -= 1  # the last token must be decoded again to get its logits
        self.kv.truncate(keep)
        t0 = time.perf_counter()
        row = self.kv.extend(context[keep:])
        if len(context) - keep <= 2:  # a catch-up of a token or two costs about one draft step
            self._time_token(time.perf_counter() - t0)
        ctx = self.kv.ctx
        greedy = budget.sampling.greedy
        tokens: list[int] = []
        probs: list[np.ndarray] = []
        est: list[float] = []
        path: list[float] = []
        while True:
            logits = ctx.logits(row)
            if greedy:
                x = int(np.argmax(logits))
                conf = float(1.0 / np.exp(logits - logits[x]).sum())
            else:
                q = warp(logits, budget.sampling)
                x = sample(q, self.rng)
                conf = float(q[x])
                probs.append(q)
            d = len(tokens) + 1
            self.mean_conf = 0.95 * self.mean_conf + 0.05 * conf
            cond = min(1.0, conf * self.calib.factor(d))
            if len(tokens) >= self.n_min and self.p_min > 0 and conf < self.p_min:
                if not greedy:
                    probs.pop()
                break
            tokens.append(x)
            est.append(min(1.0, conf))
            path.append((path[-1] if path else 1.0) * cond)
            if len(tokens) >= limit:
                break
            if len(tokens) > self.n_min and budget.size(path, self.t_token) < len(tokens):
                break
            t0 = time.perf_counter()
            row = self.kv.extend([x])
            self._time_token(time.perf_counter() - t0)
        n = max(self.n_min, budget.size(path, self.t_token)) if tokens else 0
        n = min(n, len(tokens))
        if n < max(1, self.n_min):
            return Draft()
        return Draft.chain(tokens[:n], probs[:n] if not greedy else None, self.name, est[:n])

    def _time_token(self, dt: float) -> None:
        self.t_token = dt if self.t_token == 0 else 0.9 * self.t_token + 0.1 * dt

    def accept(self, draft: Draft, accepted: list[int], committed: list[int]) -> None:
        if draft.tokens:
            self.calib.update(draft, accepted)

    def end(self) -> None:
        pass
