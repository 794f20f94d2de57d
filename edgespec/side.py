"""Side contexts: what a drafter keeps on the engine from one generation to the next.

Some drafters hold llama.cpp state that outlives a generation: the MTP context over the target
model, the EAGLE-3 draft model with its context partnered with the target's, the numpy runtime of
trained heads, lookahead's learned calibration. The engine holds them in one declared map
(`Engine.side`), by name, and closes them without knowing what they are: every entry has `close()`
and says whether it is `bound` to the target's current context (made over it, or sharing its
positions), in which case it is closed before that context is swapped (`Engine.use_streams`) or
freed. Side contexts are always closed before the engine's own contexts and models, which they
may run on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, TypeVar


class SideContext(Protocol):
    bound: bool  # made over the target's current context: closed when that context is swapped

    def close(self) -> None: ...


S = TypeVar("S", bound=SideContext)


@dataclass
class Kept:
    """Plain state kept across generations (no llama.cpp resources): nothing to free."""

    value: Any
    bound: bool = False

    def close(self) -> None:
        pass


class SideContexts(dict):
    """name -> SideContext, in the order they were made."""

    def keep(self, name: str, make: Callable[[], S], fits: Callable[[S], bool] | None = None) -> S:
        """The side context `name`: the one held while `fits` says it still serves, else a new one
        from `make()`, the old one closed first (a failed `make` leaves none held)."""
        old = self.pop(name, None)
        if old is not None:
            if fits is None or fits(old):
                self[name] = old
                return old
            old.close()
        new = make()
        self[name] = new
        return new

    def release(self, name: str) -> None:
        """Close and forget `name`, if held."""
        s = self.pop(name, None)
        if s is not None:
            s.close()

    def close_all(self, bound_only: bool = False) -> None:
        """Close every side context (or only those bound to the target's context), the last made
        first."""
        for name in reversed(list(self)):
            if not bound_only or self[name].bound:
                self.release(name)
