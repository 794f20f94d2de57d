"""Turn target outputs plus a draft into (accepted nodes, next token). Pure numpy, no llama.cpp.

`target(node)` gives the target's output for the row that follows `node` (node -1: the root).
Greedy: it returns the argmax token. Sampled: it returns the warped distribution p.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from .draft import Draft
from .sampling import SamplingConfig, sample, warp


def verify_greedy(
    draft: Draft, target_argmax: Callable[[int], int], bonus: bool = True
) -> tuple[list[int], int | None]:
    """Walk the tree along the target's argmax; keep the longest matching path.

    The token that stops the walk is the target's own next token (the bonus when the walk ends
    at a leaf), so every step commits at least one token. With `bonus=False` a walk that ends
    at a leaf returns None instead (PEARL carries that verdict to its next draft).
    """
    kids = draft.children()
    accepted: list[int] = []
    node = -1
    while True:
        if not bonus and draft.tokens and node not in kids:
            return accepted, None
        t = target_argmax(node)
        nxt = next((c for c in kids.get(node, ()) if draft.tokens[c] == t), None)
        if nxt is None:
            return accepted, t
        accepted.append(nxt)
        node = nxt


def verify_sampled_tree(
    draft: Draft, target_probs: Callable[[int], np.ndarray], rng: np.random.Generator
) -> tuple[list[int], int]:
    """Drafts without probabilities: sample y from the target at each node and follow the child
    whose token is y. Every emitted token is a plain draw from the target, so the output
    distribution is exactly the target's, whatever the tree holds."""
    kids = draft.children()
    accepted: list[int] = []
    node = -1
    while True:
        y = sample(target_probs(node), rng)
        nxt = next((c for c in kids.get(node, ()) if draft.tokens[c] == y), None)
        if nxt is None:
            return accepted, y
        accepted.append(nxt)
        node = nxt


def verify_rejection_chain(
    draft: Draft, target_probs: Callable[[int], np.ndarray], rng: np.random.Generator, bonus: bool = True
) -> tuple[list[int], int | None]:
    """The standard rejection rule for a chain sampled from draft distributions q.

    Accept x_i with probability min(1, p(x_i)/q(x_i)); on the first rejection draw from the
    normalized residual max(0, p - q); when every token is accepted draw a bonus token from p
    at the last row (with `bonus=False`, return None there instead).
    """
    assert draft.probs is not None
    accepted: list[int] = []
    for i, x in enumerate(draft.tokens):
        p = target_probs(i - 1)
        q = draft.probs[i]
        px, qx = float(p[x]), float(q[x])
        if qx <= 0.0 or rng.random() * qx > px or px <= 0.0:  # (a draw of exactly 0 never takes p(x) = 0)
            resid = np.maximum(p - q, 0.0)
            if resid.sum() <= 0.0:
                resid = p
            return accepted, sample(resid, rng)
        accepted.append(i)
    if not bonus:
        return accepted, None
    return accepted, sample(target_probs(len(draft.tokens) - 1), rng)


def verify_step(
    draft: Draft, logits_at: Callable[[int], np.ndarray], cfg: SamplingConfig, rng: np.random.Generator,
    shaper=None,
) -> tuple[list[int], int]:
    """One step's verdict from the target's logits (`logits_at(node)`, node -1: the root):
    greedy walk; the rejection rule for a chain with draft distributions; else the tree walk.

    Every method, plain decoding too, reads its rows here. With a `shaper` (rows.Shaper: grammar,
    penalties, logit bias, logprobs) each row is shaped by the state along the draft path to it."""
    if shaper is not None:
        return _verify_shaped(draft, shaper.view(draft, logits_at), cfg, rng)
    if cfg.greedy:
        if not draft.tokens:  # a plain step
            return [], int(np.argmax(logits_at(-1)))
        return verify_greedy(draft, lambda n: int(np.argmax(logits_at(n))))
    probs = lambda n: warp(logits_at(n), cfg)  # noqa: E731
    if draft.probs is not None and draft.is_chain:
        return verify_rejection_chain(draft, probs, rng)
    return verify_sampled_tree(draft, probs, rng)


def _verify_shaped(draft: Draft, rows, cfg: SamplingConfig, rng: np.random.Generator) -> tuple[list[int], int]:
    if cfg.greedy:
        accepted, nxt = ([], rows.argmax(-1)) if not draft.tokens else verify_greedy(draft, rows.argmax)
    else:
        probs = lambda n: rows.probs(n, cfg)  # noqa: E731
        if draft.probs is not None and draft.is_chain:
            accepted, nxt = verify_rejection_chain(draft, probs, rng)
        else:
            accepted, nxt = verify_sampled_tree(draft, probs, rng)
    rows.verdict([-1] + accepted, [draft.tokens[a] for a in accepted] + [nxt])
    return accepted, nxt
