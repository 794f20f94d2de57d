"""What every drafter shares: the interface, the per-step budget and confidence calibration."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ..costmodel import CostModel
from ..draft import Draft
from ..sampling import SamplingConfig


@dataclass(frozen=True)
class Budget:
    """What one step may spend: rows left in the batch/context, sequence ids for branches, and
    the machine's verification cost curve to size the draft against."""

    max_nodes: int
    max_branches: int
    fixed_rows: int  # pending tokens that the decode carries anyway (normally 1)
    cost: CostModel
    sampling: SamplingConfig
    n_past: int = 0  # tokens already in the target's cache: every row attends to all of them
    n_min: int = 0  # --spec-draft-n-min: at least this many nodes whenever there are candidates

    def size(self, path_probs: list[float], per_node: float = 0.0) -> int:
        """How many candidates (in order, each with the chance its path is accepted) pay; at
        least `n_min` of them (bypassing the cost model, to measure acceptance where drafting
        does not pay)."""
        n = self.cost.best_size(path_probs, self.fixed_rows, per_node, n_past=self.n_past)
        return max(n, min(self.n_min, len(path_probs), self.max_nodes))


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

    def propose(self, context: list[int], budget: Budget) -> Draft:
        """Tokens that may follow `context` (all committed tokens). Empty: a plain step."""

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
    cost model weighs against a target step) and the calibration of their confidence."""

    t_token: float = 0.0
    calib: Calibration

    def _time_token(self, dt: float) -> None:
        self.t_token = dt if self.t_token == 0 else 0.9 * self.t_token + 0.1 * dt

    def accept(self, draft: Draft, accepted: list[int], committed: list[int]) -> None:
        if draft.tokens:
            self.calib.update(draft, accepted)


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
