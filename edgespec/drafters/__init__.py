"""Drafters: one module per method; `methods` (the registry) builds them by name."""

from __future__ import annotations

from ..draft import Draft
from .base import FEATURES, NEXTN_ROWS, NOTHING, Budget, Calibration, Drafter, NullDrafter

class ChainDrafter:
    """Several drafters in order: the first that drafts wins the step (as llama.cpp chains).
    Each member decides from its own measured cost and confidence whether it drafts at all, so
    a later one drafts exactly where the earlier ones found nothing worth a verified row.

    A member that reads the target's rows (MTP's nextn states) gets them after every step,
    whoever drafted it: its own cache follows every committed token. Members that need the
    target's features (trained heads, EAGLE-3) are not chained."""

    taps = None

    def __init__(self, drafters: list[Drafter]):
        if any(d.reads in FEATURES for d in drafters):
            raise ValueError("internal: a drafter that reads the target's features cannot be chained")
        self.drafters = drafters
        self.name = "+".join(d.name for d in drafters)
        self._last: Drafter | None = None
        self._readers = [d for d in drafters if d.reads == NEXTN_ROWS]
        self.reads = NEXTN_ROWS if self._readers else NOTHING

    def observe(self, pos: int, rows: list[int], hidden=None) -> None:
        for d in self._readers:
            d.observe(pos, rows, hidden)

    def begin(self, prompt: list[int]) -> None:
        for d in self.drafters:
            d.begin(prompt)

    def propose(self, context: list[int], budget: Budget) -> Draft:
        self._last = None
        for d in self.drafters:
            draft = d.propose(context, budget)
            if draft.tokens:
                self._last = d
                return draft
        return Draft()

    def accept(self, draft: Draft, accepted: list[int], committed: list[int]) -> None:
        for d in self.drafters:
            d.accept(draft if d is self._last else Draft(), accepted if d is self._last else [], committed)

    def end(self) -> None:
        for d in self.drafters:
            d.end()


__all__ = ["Budget", "Calibration", "ChainDrafter", "Draft", "Drafter", "NullDrafter"]
