"""What every drafter shares: the interface, the per-step budget, the sizing step, confidence calibration
and the confidence-gated chain loop."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Protocol, Union

import numpy as np

from ..costmodel import CostModel
from ..draft import Draft
from ..sampling import SamplingConfig


@dataclass(frozen=True)
class Budget:
    """What one step may spend: rows left in the batch/context, sequence ids for branches, and
    the machine's verification cost curve to size the draft against.

    The scheduler sizes what a drafter proposes (`sized`); a drafter reads the budget to bound
    its work: `max_nodes` and `max_branches`, and `gate` where it must decide while drafting
    whether more would pay (whether to run a draft model at all, a chain's next token, a tree's
    next depth)."""

    max_nodes: int
    max_branches: int
    fixed_rows: int  # pending tokens that the decode carries anyway (normally 1)
    cost: CostModel
    sampling: SamplingConfig
    n_past: int = 0  # tokens already in the target's cache: every row attends to all of them
    n_min: int = 0  # --spec-draft-n-min: at least this many nodes whenever there are candidates
    # False where the scheduler sizes several sequences' drafts together (multi): a drafter's
    # gates then let everything within max_nodes through, and the scheduler weighs it all
    gated: bool = True
    # plain steps the generation may still lose on drafts not kept (costmodel.loss_slack): a draft
    # that could lose more must expect to gain more than it risks (CostModel.best_size)
    slack: float = math.inf

    def size(self, path_probs: list[float], per_node: float = 0.0, fixed: float = 0.0) -> int:
        """How many candidates (in order, each with the chance its path is accepted) pay, with
        `per_node` drafting seconds per candidate and `fixed` per step; at least `n_min` of them
        (bypassing the cost model, to measure acceptance where drafting does not pay)."""
        n = self.cost.best_size(path_probs, self.fixed_rows, per_node, n_past=self.n_past, fixed=fixed,
                                slack=self.slack)
        return max(n, min(self.n_min, len(path_probs), self.max_nodes))

    def may_probe(self) -> bool:
        """Whether a one-node draft that does not pay (a drafter's probe, to learn again) fits in
        what the generation may still lose."""
        if self.slack == math.inf:
            return True
        return self.cost.step_loss(self.fixed_rows + 1, self.fixed_rows, self.n_past) <= max(self.slack, 0.0)

    def gate(self, path_probs: list[float], per_node: float = 0.0, fixed: float = 0.0) -> int:
        """For a drafter deciding while it drafts: how many of these candidates would pay
        (`size`), or all of them where the scheduler sizes several sequences together."""
        return self.size(path_probs, per_node, fixed) if self.gated else len(path_probs)


@dataclass(frozen=True)
class Candidates:
    """What a drafter proposes for the scheduler to size: candidates in rank order (a parent
    before its children, so that every prefix is a tree), `path[i]` the calibrated chance that
    the path to candidate i is accepted, and `take(n)`, the first n laid out as a Draft.

    `take(0)` may still return the best candidate now and then (a probe: a drafter whose
    confidence fell below what pays learns again only from what it drafts)."""

    path: list[float]
    take: Callable[[int], Draft]
    per_node: float = 0.0  # drafting seconds per candidate kept (EAGLE-3's tree), weighed by the sizing


# A drafter proposes Candidates, or a Draft it sized itself while drafting: a chain whose length
# is a stopping time (`TokenTimed.gated_chain`), which must not be cut afterwards (a sampled chain
# cut by the confidences of its later tokens would filter tokens by their own draws).
Proposal = Union[Draft, Candidates]


def sized(proposal: Proposal, budget: Budget) -> Draft:
    """The sizing step of one sequence (the sequential scheduler, and `auto`'s chain for each
    member): as many candidates as pay on the cost curve, at least `budget.n_min`."""
    if isinstance(proposal, Draft):
        return proposal
    n = budget.size(proposal.path, proposal.per_node) if proposal.path else 0
    if n == 0 and not budget.may_probe():
        return Draft()  # no room for a probe's loss now (take(0) may probe)
    return proposal.take(n)


def every(proposal: Proposal) -> tuple[Draft, list[float]]:
    """Every candidate and the path chances of those that have them, for a scheduler that sizes
    several sequences' drafts together (multi)."""
    if isinstance(proposal, Draft):
        return proposal, []
    return proposal.take(len(proposal.path)), proposal.path


# What a drafter reads from the target, declared once per drafter (`Drafter.reads`); the scheduler
# provides it through `observe` and leaves the target's context as it found it.
NOTHING = "nothing"  # tokens only: n-grams, the trie, a draft model
LAST_ROW = "last row"  # post-norm features: the prompt's last row, then each step's root and accepted rows (Medusa)
ALL_ROWS = "all rows"  # the same with every prompt row (an EAGLE head, a trained MTP module)
LAYER_TAPS = "layer taps"  # the inputs of the target layers `taps` instead, every prompt row (EAGLE-3)
NEXTN_ROWS = "nextn rows"  # the batch rows of every target decode, prompt chunks included, read by the
# drafter itself right after the decode (llama.cpp's nextn states: native MTP)
FEATURES = (LAST_ROW, ALL_ROWS, LAYER_TAPS)  # the scheduler hands over the target's features (`hidden`)


class Drafter(Protocol):
    name: str
    reads: str  # one of NOTHING, LAST_ROW, ALL_ROWS, LAYER_TAPS, NEXTN_ROWS
    taps: tuple[int, ...] | None  # LAYER_TAPS: the target layers whose inputs it reads

    def begin(self, prompt: list[int]) -> None:
        """A new generation starts after `prompt`."""

    def observe(self, pos: int, rows: list[int], hidden: np.ndarray | None) -> None:
        """What the drafter `reads` of committed positions pos, pos+1, ... (called only when it
        reads something): `rows` are their batch rows in the target decode that just ran (a
        prompt chunk, or a verification's root and accepted nodes; read from the context now,
        before anything else decodes), empty for the prompt's features handed over at once;
        `hidden` their features (row i predicts the token after position pos+i) for FEATURES
        readers, else None."""

    def propose(self, context: list[int], budget: Budget) -> Proposal:
        """Tokens that may follow `context` (all committed tokens), for the scheduler to size
        (`sized`). Empty: a plain step."""

    def accept(self, draft: Draft, accepted: list[int], committed: list[int]) -> None:
        """The target kept draft nodes `accepted` (a path) and committed `committed` tokens."""

    def end(self) -> None:
        """The generation is over (finished, stopped or failed)."""


class Calibration:
    """Per-depth correction of a drafter's own confidence, learned from what the target accepts.

    For every draft node the target reached (its parent was accepted) we compare the drafter's
    raw conditional estimate (`Draft.est`, before this correction) with the outcome; the factor
    is the decayed ratio of the two. With `depth=1` (the default) all draft positions share one
    factor: deep positions are drafted rarely, and a factor of their own would stay at the prior.
    """

    def __init__(self, prior: float = 1.0, weight: float = 2.0, decay: float = 0.995, depth: int = 1):
        self.est = np.full(depth, weight, dtype=np.float64)
        self.acc = np.full(depth, weight * prior, dtype=np.float64)
        self.decay = decay

    def factor(self, depth: int) -> float:
        d = min(depth, len(self.est)) - 1
        return float(self.acc[d] / self.est[d])

    def state(self) -> list[list[float]]:
        """What it learned (the decayed sums per depth), as JSON: kept beside the cost curve."""
        return [[round(float(x), 6) for x in self.est], [round(float(x), 6) for x in self.acc]]

    def restore(self, state) -> None:
        est, acc = (np.asarray(x, dtype=np.float64) for x in state)
        if est.shape != self.est.shape or acc.shape != self.est.shape or not (est > 0).all() or (acc < 0).any():
            raise ValueError("a calibration of another shape")
        self.est, self.acc = est, acc

    def update(self, draft: Draft, accepted: list[int], skip: set[int] | frozenset[int] = frozenset()) -> None:
        """Learn from one verified draft; nodes in `skip` are left to another calibration."""
        if not draft.tokens or draft.est is None:
            return
        reached_parents = {-1, *accepted}
        acc = set(accepted)
        depths = draft.depths()
        self.est *= self.decay
        self.acc *= self.decay
        for i, p in enumerate(draft.parents):
            if p in reached_parents and i not in skip:
                d = min(depths[i], len(self.est)) - 1
                self.est[d] += draft.est[i]
                self.acc[d] += 1.0 if i in acc else 0.0


def top_prob(logits: np.ndarray) -> float:
    """The softmax probability of the most likely token."""
    return float(1.0 / np.exp(logits - logits.max()).sum())


class TokenTimed:
    """What drafters that draft token by token share: the time per draft token (an average the
    cost model weighs against a target step), the calibration of their confidence, and the
    confidence-gated chain loop."""

    t_token: float = 0.0
    calib: Calibration

    def _time_token(self, dt: float) -> None:
        self.t_token = dt if self.t_token == 0 else 0.9 * self.t_token + 0.1 * dt

    def accept(self, draft: Draft, accepted: list[int], committed: list[int]) -> None:
        if draft.tokens:
            self.calib.update(draft, accepted)

    def gated_chain(self, budget: Budget, limit: int, n_min: int, p_min: float, top: Callable[[], float],
                    draw: Callable[[], int | None], advance: Callable[[int, int], bool]
                    ) -> tuple[list[int], list[float], list[float]]:
        """Draft a chain token by token while one more token pays (the draft model, MTP and
        EAGLE-3's chains): `top()` is the next token's confidence, known before it is drawn; its
        calibrated value times the path's chance so far is the chance that the chain up to it is
        accepted. The chain stops where one more token would not pay for its row and its
        drafting (`Budget.gate`, at `t_token` a token), below `p_min`, or at `limit`, never
        before `n_min` tokens. `draw()` gives the token (None: stop before it, an end of
        generation); `advance(token, n)`, with n tokens drafted, readies the next position
        (False: stop).

        The length is a stopping time: decided from what is known before each token is drawn,
        never from the drawn token's own probability. A sampled token kept or dropped by its own
        probability would reach the verifier with another law than the draft's, and the
        rejection rule would no longer give the target's distribution (toy: q = (0.9, 0.1),
        p = (0.5, 0.5), "keep x if q[x] >= 0.5" commits 0.545 / 0.455); so the chain is sized
        here, and the scheduler takes it whole. Returns (tokens, raw confidences, path chances)."""
        tokens: list[int] = []
        est: list[float] = []
        path: list[float] = []
        factor = self.calib.factor
        while len(tokens) < limit:
            t = top()
            nxt = (path[-1] if path else 1.0) * min(1.0, t * factor(len(tokens) + 1))
            if len(tokens) >= n_min:
                if p_min > 0 and t < p_min:
                    break
                if budget.gate(path + [nxt], self.t_token) <= len(tokens):
                    break  # one more token would not pay for its row and its drafting
            x = draw()
            if x is None:
                break
            tokens.append(x)
            est.append(min(1.0, t))
            path.append(nxt)
            if len(tokens) < limit and not advance(x, len(tokens)):
                break
        return tokens, est, path


class NullDrafter:
    """Plain decoding through the same loop: every step verifies one token."""

    name = "none"
    reads = NOTHING
    taps = None

    def begin(self, prompt: list[int]) -> None:
        pass

    def propose(self, context: list[int], budget: Budget) -> Draft:
        return Draft()

    def accept(self, draft: Draft, accepted: list[int], committed: list[int]) -> None:
        pass

    def end(self) -> None:
        pass
