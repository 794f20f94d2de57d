"""auto's chain switches off a later member that loses time and keeps one that pays, judged by
what it did (seconds per committed token), not by what it predicted. A fake clock makes the
accounting deterministic; the members are stand-ins with a cost and a hit rate (the chain's
arithmetic is under test here; tests/test_lossless.py runs auto with a real draft model)."""

from types import SimpleNamespace

import pytest

from edgespec.drafters import chain as chain_mod
from edgespec.drafters.chain import ChainDrafter, ChainGates, MemberGate
from edgespec.draft import Draft


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class Member:
    """Drafts `n` tokens every `every`-th time it is asked, spending `cost` seconds per asking."""

    reads = "nothing"

    def __init__(self, name, clock, cost, every, n=3):
        self.name, self.clock, self.cost, self.every, self.n = name, clock, cost, every, n
        self.asked = 0

    def begin(self, prompt):
        pass

    def propose(self, context, budget):
        self.asked += 1
        self.clock.now += self.cost
        if self.every and self.asked % self.every == 0:
            return Draft.chain([1] * self.n, None, self.name, [0.9] * self.n)
        return Draft()

    def accept(self, draft, accepted, committed):
        pass

    def end(self):
        pass


BUDGET = SimpleNamespace(cost=SimpleNamespace(t=lambda k, n_past=0: 0.1), n_past=0)


def run(chain, clock, steps, step_s, rows_s, accept_all):
    """`steps` steps: a plain step costs `step_s`, each drafted row `rows_s` more; a draft is
    accepted whole or not at all."""
    for _ in range(steps):
        d = chain.propose([0], BUDGET)
        clock.now += step_s + rows_s * len(d.tokens)
        acc = list(range(len(d.tokens))) if accept_all else []
        chain.accept(d, acc, [1] * (len(acc) + 1))


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(chain_mod.time, "perf_counter", c)
    return c


def test_a_member_that_loses_is_switched_off_and_tried_again(clock):
    first = Member("lookahead", clock, 0.0, 0)
    slow = Member("draft", clock, 0.05, 2)  # costs half a plain step each time, drafts rejected
    gates = ChainGates()
    ch = ChainDrafter([first, slow], gates)
    run(ch, clock, 400, 0.1, 0.02, accept_all=False)
    g = gates.gates["draft"]
    assert g.switched_off >= 2
    # asked for a window, then off for 64, then for 128 ...: far fewer askings than steps
    assert slow.asked < 400 * 0.6
    assert gates.base == pytest.approx(0.1)
    # it is tried again after its pause
    asked = slow.asked
    run(ch, clock, g.off_for + 5, 0.1, 0.02, accept_all=False)
    assert slow.asked > asked


def test_a_member_that_pays_stays_on(clock):
    first = Member("lookahead", clock, 0.0, 0)
    good = Member("draft", clock, 0.01, 2, n=4)  # 4 tokens accepted at 0.01 s + 4 rows of 0.02 s
    gates = ChainGates()
    ch = ChainDrafter([first, good], gates)
    run(ch, clock, 300, 0.1, 0.02, accept_all=True)
    assert gates.gates["draft"].switched_off == 0 and good.asked == 300


def test_the_first_member_is_never_gated_and_gates_outlive_a_generation(clock):
    first = Member("lookahead", clock, 0.0, 1)  # drafts every step: later members never asked
    later = Member("draft", clock, 0.05, 2)
    gates = ChainGates()
    run(ChainDrafter([first, later], gates), clock, 50, 0.1, 0.02, accept_all=False)
    assert first.asked == 50 and later.asked == 0
    gates.gates["draft"] = g = MemberGate()
    g.off_for = 10
    ch = ChainDrafter([Member("lookahead", clock, 0.0, 0), later], gates)  # the next generation
    run(ch, clock, 10, 0.1, 0.0, accept_all=False)
    assert later.asked == 0 and g.off_for == 0


def test_gates_round_trip_beside_the_cost_curve(clock, tmp_path):
    """What the chain learned is written beside the target's cost curve and read back by the
    next process; a record it cannot read is learned again."""
    from edgespec.costcache import load_extra, store_extra
    from edgespec.costmodel import flat
    import json

    gates = ChainGates()
    ch = ChainDrafter([Member("lookahead", clock, 0.0, 0), Member("draft", clock, 0.05, 2)], gates,
                      ["lookahead", "draft:x.gguf"])
    run(ch, clock, 100, 0.1, 0.02, accept_all=False)
    g = gates.gates["draft:x.gguf"]
    assert g.switched_off >= 1
    cm = flat(0.01, 32)
    f = tmp_path / "costs.json"
    f.write_text(json.dumps({"k": {"curve": 1}}))
    cm.origin = (str(f), "k")
    store_extra(cm, "chain", gates.state())
    back = ChainGates.restore(load_extra(cm, "chain"))
    assert back.state() == gates.state() and back.gates["draft:x.gguf"].off_for == g.off_for
    assert json.loads(f.read_text())["k"]["curve"] == 1  # the rest of the record is kept
    assert ChainGates.restore({"gates": {"draft": "nonsense"}}).gates == {}
    assert ChainGates.restore(None).gates == {}
