"""Drafters: one module per method; `methods` (the registry) builds them by name."""

from __future__ import annotations

from ..draft import Draft
from .base import Budget, Calibration, Drafter, NullDrafter

class ChainDrafter:
    """Several drafters in order: the first that drafts wins the step (as llama.cpp chains)."""

    needs_target_hidden = False

    def __init__(self, drafters: list[Drafter]):
        self.drafters = drafters
        self.name = "+".join(d.name for d in drafters)
        self._last: Drafter | None = None

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
