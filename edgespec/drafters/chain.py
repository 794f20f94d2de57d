"""`auto`'s chain of drafters, and the measurement that switches off a member that does not pay.

The chain asks its members in order; the first that drafts wins the step (as llama.cpp chains).
Each member already decides from its own predicted cost and confidence whether to draft. That
prediction can be wrong where it matters most: a draft model's catch-ups after skipped stretches,
its probes, and drafts that a capped verification cuts short all cost time the prediction does
not see. So every member after the first is also judged by what it actually did, in seconds:

- a plain step (nobody drafted) measures what a step of the chain without its later members costs
  (`base`: the step's time less the later members' time spent deciding not to draft);
- a step member i drafted gains `committed * base - (step time - earlier later-members' time)`:
  the time the same tokens would have cost by plain steps, less what the step cost;
- a step where member i was asked and did not draft loses its asking time.

When a member's gains over its last `window` askings sum below zero, it is switched off for a
while (64 steps, doubling while it keeps losing, at most 4096) and then tried again. The gates
outlive a generation (a chat's turns) and a process: the engine writes them beside its cost curve
(`costcache.store_extra`), keyed by the member and its model, so that the next `edgespec run`
does not pay again to learn that a draft model loses on this machine. This judges a member only
by the past; which member drafts never changes what the target commits (every draft is
verified), so greedy output stays identical to plain decoding and sampled output keeps the target's
distribution.
"""

from __future__ import annotations

import time
from collections import deque

from ..costcache import load_extra, store_extra
from ..costmodel import CostModel
from ..draft import Draft
from .base import FEATURES, NEXTN_ROWS, NOTHING, Budget, Drafter, sized


class MemberGate:
    """What one chained member has gained or lost lately, and whether it is on."""

    OFF_MIN, OFF_MAX = 64, 4096

    def __init__(self, window: int = 24):
        self.gains: deque[float] = deque(maxlen=window)
        self.off_for = 0  # steps left switched off
        self.off_next = self.OFF_MIN
        self.drafted = 0  # steps it drafted (for the stats line)
        self.switched_off = 0  # how many times it was switched off

    def state(self) -> dict:
        return {"gains": [round(g, 6) for g in self.gains], "off_for": self.off_for, "off_next": self.off_next,
                "switched_off": self.switched_off}

    def restore(self, d: dict) -> None:
        self.gains.extend(float(g) for g in d.get("gains", [])[-self.gains.maxlen:])
        self.off_for = max(0, int(d.get("off_for", 0)))
        self.off_next = min(self.OFF_MAX, max(self.OFF_MIN, int(d.get("off_next", self.OFF_MIN))))
        self.switched_off = max(0, int(d.get("switched_off", 0)))

    def on(self) -> bool:
        if self.off_for > 0:
            self.off_for -= 1
            return False
        return True

    def record(self, gain: float) -> None:
        self.gains.append(gain)
        if len(self.gains) == self.gains.maxlen:
            if sum(self.gains) < 0.0:
                self.off_for = self.off_next
                self.off_next = min(self.OFF_MAX, self.off_next * 2)
                self.switched_off += 1
                self.gains.clear()
            else:
                self.off_next = self.OFF_MIN


class ChainGates:
    """The gates of one engine's `auto` chain, kept across its generations (a chat's turns)."""

    def __init__(self):
        self.gates: dict[str, MemberGate] = {}
        self.base = 0.0  # measured time of a plain step of the chain's first member (EMA)

    def gate(self, name: str) -> MemberGate:
        return self.gates.setdefault(name, MemberGate())

    def state(self) -> dict:
        return {"base": self.base, "gates": {k: g.state() for k, g in self.gates.items()}}

    @classmethod
    def restore(cls, d: dict | None) -> "ChainGates":
        out = cls()
        try:
            out.base = max(0.0, float((d or {}).get("base", 0.0)))
            for k, g in ((d or {}).get("gates") or {}).items():
                out.gate(str(k)).restore(g)
        except (TypeError, ValueError, AttributeError):
            return cls()  # a record from another version: learn again
        return out


class KeptGates:
    """The gates as the engine's side context "auto": read from beside the target's cost curve
    when first needed, written back there when the engine closes."""

    bound = False

    def __init__(self, cost: CostModel):
        self.cost = cost
        self.value = ChainGates.restore(load_extra(cost, "chain"))

    def close(self) -> None:
        store_extra(self.cost, "chain", self.value.state())


class ChainDrafter:
    """Several drafters in order: the first that drafts wins the step. Members after the first
    are switched off by measurement where they do not pay (`ChainGates`).

    A member that reads the target's rows (MTP's nextn states) gets them after every step,
    whoever drafted it: its own cache follows every committed token. Members that need the
    target's features (trained heads, EAGLE-3) are not chained."""

    taps = None

    def __init__(self, drafters: list[Drafter], gates: ChainGates | None = None, keys: list[str] | None = None):
        """`keys`: each member's name in the gates (default its name; `auto` adds the draft
        model's file, so that another -md is judged afresh)."""
        if any(d.reads in FEATURES for d in drafters):
            raise ValueError("internal: a drafter that reads the target's features cannot be chained")
        self.drafters = drafters
        self.name = "+".join(d.name for d in drafters)
        self.gates = gates if gates is not None else ChainGates()
        self.keys = keys or [d.name for d in drafters]
        self._last: Drafter | None = None
        self._t0 = 0.0
        self._asked: list[tuple[int, float]] = []  # later members asked this step, with their time
        self._base_pred = 0.0
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
        self._asked = []
        self._t0 = time.perf_counter()
        if self.gates.base == 0.0:  # until a plain step is measured: the cost curve's
            self._base_pred = budget.cost.t(1, budget.n_past)
        for i, d in enumerate(self.drafters):
            if i and not self.gates.gate(self.keys[i]).on():
                continue
            t = time.perf_counter()
            draft = sized(d.propose(context, budget), budget)  # sized as the scheduler would: did it draft?
            if i:
                self._asked.append((i, time.perf_counter() - t))
            if draft.tokens:
                self._last = d
                return draft
        return Draft()

    def accept(self, draft: Draft, accepted: list[int], committed: list[int]) -> None:
        self._judge(len(committed))
        for d in self.drafters:
            d.accept(draft if d is self._last else Draft(), accepted if d is self._last else [], committed)

    def _judge(self, n_committed: int) -> None:
        step = time.perf_counter() - self._t0
        if not self._asked:
            if self._last is None:  # a plain step with no later member asked
                self._learn_base(step)
            return
        last = self.drafters.index(self._last) if self._last is not None else 0
        if last == 0:  # the first member drafted: nobody later was asked
            return
        asked = sum(dt for _, dt in self._asked)
        if self._last is None:  # asked, nobody drafted: a plain step plus the askings
            self._learn_base(step - asked)
            for i, dt in self._asked:
                self.gates.gate(self.keys[i]).record(-dt)
            return
        base = self.gates.base or self._base_pred
        before = 0.0
        for i, dt in self._asked:
            g = self.gates.gate(self.keys[i])
            if i < last:
                g.record(-dt)
                before += dt
            else:
                g.drafted += 1
                g.record(n_committed * base - (step - before))

    def _learn_base(self, seconds: float) -> None:
        b = self.gates.base
        self.gates.base = seconds if b == 0.0 else 0.9 * b + 0.1 * seconds

    def end(self) -> None:
        for d in self.drafters:
            d.end()
