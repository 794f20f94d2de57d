"""Drafters: one module per method; `methods` (the registry) builds them by name."""

from __future__ import annotations

from ..draft import Draft
from .base import Budget, Calibration, Drafter, NullDrafter

class ChainDrafter:
    """Several drafters in order: the first that drafts wins the step (as llama.cpp chains).
    Each member decides from its own measured cost and confidence whether it drafts at all, so
    a later one drafts exactly where the earlier ones found nothing worth a verified row.

    A member that reads the target's rows (MTP's nextn states, `observe_rows`) gets them after
    every step, whoever drafted it: its own cache follows every committed token. Members that
    need the target's post-norm features (trained heads) are not chained."""

    needs_target_hidden = False
    needs_prompt_hidden = False

    def __init__(self, drafters: list[Drafter]):
        if any(getattr(d, "needs_target_hidden", False) for d in drafters):
            raise ValueError("internal: a drafter that reads the target's features cannot be chained")
        self.drafters = drafters
        self.name = "+".join(d.name for d in drafters)
        self._last: Drafter | None = None
        readers = [d.observe_rows for d in drafters if hasattr(d, "observe_rows")]
        if readers:
            def observe_rows(pos: int, rows: list[int]) -> None:
                for read in readers:
                    read(pos, rows)

            self.observe_rows = observe_rows

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
