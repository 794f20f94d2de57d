"""A draft: a tree of proposed tokens. A chain is the tree with one branch."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Draft:
    """Nodes in preorder (a parent always comes before its children).

    `parents[i]` is the index of node i's parent, or -1 when its parent is the root (the last
    committed token). `probs[i]`, when given, is the full distribution the drafter sampled node i
    from; `probs=None` means the drafter has no distribution and the verifier samples from the
    target and follows the matching child (still lossless).
    """

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    probs: list[np.ndarray] | None = None
    source: str = ""
    # The drafter's raw chance that node i is accepted given its parent was, before calibration.
    est: list[float] | None = None
    # Seconds of this step's drafting that serve later steps too (the part of a draft model's
    # catch-up its gate weighs as spread over them): the loss bound charges the rest now.
    spread: float = 0.0

    @classmethod
    def chain(cls, tokens: list[int], probs: list[np.ndarray] | None = None, source: str = "",
              est: list[float] | None = None) -> "Draft":
        return cls(list(tokens), list(range(-1, len(tokens) - 1)), probs, source, est)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def children(self) -> dict[int, list[int]]:
        """Parent index (-1 for root) -> child node indices, in node order."""
        out: dict[int, list[int]] = {}
        for i, p in enumerate(self.parents):
            out.setdefault(p, []).append(i)
        return out

    def depths(self) -> list[int]:
        d: list[int] = []
        for p in self.parents:
            d.append(1 if p < 0 else d[p] + 1)
        return d

    def leaves(self) -> list[int]:
        has_child = set(p for p in self.parents if p >= 0)
        return [i for i in range(len(self.tokens)) if i not in has_child]

    def path_to(self, node: int) -> list[int]:
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

