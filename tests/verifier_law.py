"""The exact output law of a verifier on one captured step, by enumerating its random draws.

A verifier (edgespec/verify.py) draws only through `rng.random()`, and each draw is compared with
thresholds made of the step's distributions: p(x)/q(x) for the rejection rule, cumulative sums
for an inverse-CDF draw from p or from the residual. So every draw's outcome is constant between
consecutive thresholds: `law` runs the verifier once per interval of every draw it makes (the
intervals of that draw that lead to the same outcome merged), each weighted by its length, and
sums the outcomes. With every threshold among `hints` the result is exact (to rounding).

`conditional_error` then compares that law with the target's: wherever a verifier stops, given
the tokens emitted so far and that it emits one more, the next token must follow the target's
row at that point. `Step` is a verification captured from a real run (tests/test_distribution.py),
on the few tokens it can involve, with the laws to check on it.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, Hashable

import numpy as np

from edgespec.draft import Draft
from edgespec.sampling import SamplingConfig


class Draws:
    """An rng whose draws are given: `prefix[i]` for the i-th, 0.5 past the prefix (counted in `n`)."""

    def __init__(self, prefix: list[float]):
        self.prefix, self.n = prefix, 0

    def random(self) -> float:
        u = self.prefix[self.n] if self.n < len(self.prefix) else 0.5
        self.n += 1
        return u


def hints_of(rows: list[np.ndarray], ratios: list[float] = ()) -> np.ndarray:
    """Every threshold a verifier may compare a draw with: each row's cumulative sums and single
    values (normalized), and the ratios given (p/q where a draft drew from q)."""
    hs = [0.0, 1.0]
    for r in rows:
        r = np.asarray(r, np.float64)
        s = r.sum()
        if s > 0:
            hs += list(np.cumsum(r) / s) + list(r[r > 0] / s)
    hs += [x for x in ratios if 0.0 < x < 1.0]
    h = np.unique(np.clip(np.array(hs), 0.0, 1.0))
    return h


def law(run: Callable[[Draws], Hashable], hints: np.ndarray) -> dict:
    """{outcome: probability} of `run(rng)` over independent uniform draws."""
    out: dict = defaultdict(float)
    edges = np.asarray(hints, np.float64)
    mids = (edges[:-1] + edges[1:]) / 2
    widths = edges[1:] - edges[:-1]
    keep = widths > 0
    mids, widths = mids[keep], widths[keep]

    def go(prefix: list[float], weight: float) -> None:
        rng = Draws(prefix)
        res = run(rng)
        if rng.n <= len(prefix):  # every draw it made was given: one outcome
            out[res] += weight
            return
        # the next draw is free: one run per interval, adjacent intervals with the same outcome merged
        groups: list[list] = []  # [outcome, draws made, first mid, total width]
        for u, w in zip(mids, widths):
            r = Draws(prefix + [float(u)])
            o = run(r)
            if groups and groups[-1][0] == o and groups[-1][1] == r.n:
                groups[-1][3] += w
            else:
                groups.append([o, r.n, float(u), float(w)])
        for o, n, u, w in groups:
            if n <= len(prefix) + 1:
                out[o] += weight * w
            else:
                go(prefix + [u], weight * w)

    go([], 1.0)
    return dict(out)


def conditional_error(outcomes: dict[tuple, float], rows: dict[tuple, np.ndarray]) -> float:
    """The largest |P(emit prefix + t) - P(emit prefix, then one more) * p_prefix(t)| over the
    law `outcomes` ({emitted tokens: probability}), for each prefix of `rows` ({tokens emitted so
    far: the target's distribution after them}); and how far the law's total is from 1."""
    mass: dict[tuple, float] = defaultdict(float)
    for seq, w in outcomes.items():
        for j in range(1, len(seq) + 1):
            mass[seq[:j]] += w
    worst = abs(sum(outcomes.values()) - 1.0)
    for prefix, p in rows.items():
        nxt = np.array([mass.get(prefix + (t,), 0.0) for t in range(len(p))])
        worst = max(worst, float(np.abs(nxt - nxt.sum() * p).max()))
    return worst


# captured rows are distributions already: a verifier that warps logits gets their logs, through a
# warp that keeps them
PLAIN = SamplingConfig(temp=1.0, top_k=0, top_p=1.0, min_p=0.0)


def logits_of(probs):
    def at(n):
        with np.errstate(divide="ignore"):
            return np.log(probs(n))
    return at


CHAIN_DEPTH = 3  # a chain's positions checked: enumerating deeper ones costs more than they add


class Step:
    """One captured verification on the tokens it can involve (the rows' supports and the draft's
    tokens, renumbered 0..): the draft, the target's distribution after each node (-1: the root),
    and `verifier(draft, probs_at, rng) -> (accepted, next)`, the scheduler's own on them."""

    def __init__(self, draft: Draft, rows: dict[int, np.ndarray], verifier):
        self.draft, self.rows, self.verifier = draft, rows, verifier

    @classmethod
    def of(cls, draft: Draft, probs_at, verifier) -> "Step":
        full = {n: np.asarray(probs_at(n), np.float64) for n in range(-1, len(draft.tokens))}
        ids = {int(t) for r in full.values() for t in np.flatnonzero(r)} | set(draft.tokens)
        if draft.probs is not None:
            ids |= {int(t) for q in draft.probs for t in np.flatnonzero(q)}
        ids = np.array(sorted(ids))
        local = {int(t): i for i, t in enumerate(ids)}
        small = Draft([local[t] for t in draft.tokens], list(draft.parents),
                      [np.asarray(q, np.float64)[ids] for q in draft.probs] if draft.probs is not None else None)
        return cls(small, {n: r[ids] for n, r in full.items()}, verifier)

    def laws(self):
        """(law, rows) pairs for `conditional_error`: the law of the tokens a
        verification emits, and the target's distribution after each prefix it must follow. A
        tree (no draft distributions) as drafted: the law of the walk, whatever the tree. A
        chain sampled from q is exact only over q's draws: for each position i, the drafted
        tokens before it and token i each of q_i's (weighted by q_i), the law after the tokens
        before it (the first CHAIN_DEPTH positions)."""
        d, tok, rows, hints = self.draft, self.draft.tokens, self.rows, self.hints()
        if d.probs is None:
            paths = {(): rows[-1]}
            for n in range(len(tok)):
                paths.setdefault(tuple(tok[a] for a in d.path_to(n)), rows[n])
            yield law(lambda rng: self._emitted(d, rng), hints), paths
            return
        for i in range(min(len(tok), CHAIN_DEPTH)):
            mixed: dict = {}
            for x in np.flatnonzero(d.probs[i]):
                chain = Draft.chain(tok[:i] + [int(x)], d.probs[: i + 1])
                for out, w in law(lambda rng: self._emitted(chain, rng), hints).items():
                    mixed[out] = mixed.get(out, 0.0) + float(d.probs[i][x]) * w
            yield mixed, {tuple(tok[:i]): rows[i - 1]}

    def _emitted(self, d: Draft, rng) -> tuple:
        accepted, nxt = self.verifier(d, lambda n: self.rows[n], rng)
        return tuple(d.tokens[a] for a in accepted) + (() if nxt is None else (int(nxt),))

    def hints(self) -> np.ndarray:
        """Every threshold the rejection rule and the draws from p, q and the residual compare with."""
        rows = list(self.rows.values())
        ratios: list[float] = []
        if self.draft.probs is not None:
            for i, q in enumerate(self.draft.probs):
                p = self.rows[self.draft.parents[i]]
                rows += [q, np.maximum(p - q, 0.0)]
                ratios += list(p[q > 0] / q[q > 0])
        return hints_of(rows, ratios)

    def informative(self) -> bool:
        """Whether the textbook bug would change this step's law: a drafted token whose parent's
        row gives it a probability strictly between 0 and 1."""
        return any(0.0 < self.rows[p][t] < 1.0 for t, p in zip(self.draft.tokens, self.draft.parents))


def kept_by_own_probability(draft: Draft, target_probs, rng, bonus: bool = True):
    """The textbook bug, to plant in place of edgespec.verify's verifiers: each drafted token kept
    with its own target probability (not min(1, p/q)), else a draw from p (not the residual)."""
    from edgespec import verify

    kids, accepted, node = draft.children(), [], -1
    while True:
        p = target_probs(node)
        nxt = next((c for c in kids.get(node, ()) if rng.random() < p[draft.tokens[c]]), None)
        if nxt is None:
            if not bonus and accepted and len(accepted) == len(draft.tokens):
                return accepted, None
            return accepted, verify.sample(p, rng)
        accepted.append(nxt)
        node = nxt
