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

    def __init__(self, model: Model, kv: KVSeq, n_max: int = 16, n_min: int = 0, p_min: float = 0.0, seed: int | None = None):
        self.model = model
        self.kv = kv
        self.n_max, self.n_min, self.p_min = n_max, n_min, p_min
        self.calib = Calibration(prior=1.0)
        self.rng = np.random.default_rng(None if seed is None else seed + 1)
        self.t_token = 0.0  # drafting time per token (EMA), charged against each draft token

    def begin(self, prompt: list[int]) -> None:
        pass  # the cache is synced to the context on every proposal

    def propose(self, context: list[int], budget: Budget) -> Draft:
        limit = min(self.n_max, budget.max_nodes, self.kv.room() - 2)
        if limit <= 0 or limit < self.n_min:
            return Draft()
        keep = self.kv.common_prefix(context)
        if keep == len(context):
            keep -= 1  # the last token must be decoded again to get its logits
        self.kv.truncate(keep)
        row = self.kv.extend(context[keep:])
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
            dt = time.perf_counter() - t0
            self.t_token = dt if self.t_token == 0 else 0.9 * self.t_token + 0.1 * dt
        n = max(self.n_min, budget.size(path, self.t_token)) if tokens else 0
        n = min(n, len(tokens))
        if n < max(1, self.n_min):
            return Draft()
        return Draft.chain(tokens[:n], probs[:n] if not greedy else None, self.name, est[:n])

    def accept(self, draft: Draft, accepted: list[int], committed: list[int]) -> None:
        if draft.tokens:
            self.calib.update(draft, accepted)

    def end(self) -> None:
        pass
