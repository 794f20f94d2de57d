"""The draft model runs only where its known costs can pay (docs/drafting.md): its time per drafted
token and per token it must read to catch up are weighed on the target's cost curve before it
runs at all, with its confidence calibrated against what the target accepted; and what it learned
outlives the generation and, beside the cost curve, the process. Real models (SmolLM2 Q8_0 with
its Q4_0 as the draft); curves injected, so that only the gate decides."""

import json

import pytest

from edgespec.costmodel import KS, CostModel, flat
from edgespec.drafters.draft_model import DraftState, KeptDraftState

from conftest import GREEDY, PROMPTS


def _key(eng) -> str:
    return f"draft-state:{eng.draft_model.path.name}"


@pytest.fixture
def pair(smol_pair):
    """smol_pair with a fresh kept draft state and its own curve back after the test."""
    saved = smol_pair.cost
    smol_pair.side.release(_key(smol_pair))
    yield smol_pair
    smol_pair.cost = saved
    smol_pair.side.release(_key(smol_pair))


def _run(eng, method, prompt=PROMPTS[0], n=48):
    toks = eng.prompt_tokens(prompt)
    eng.draft_kv.reset()
    g = eng.start(toks, n, GREEDY, method).run()
    return list(g.tokens), g.stats


def test_a_draft_model_that_cannot_pay_is_never_run(pair):
    """Where a verified row costs as much as a plain step (a CPU's steep curve taken to its end),
    not even an always-right draft pays for the draft model's own decodes: it never runs, under
    `draft` or `auto` (its cache stays empty), and the output is plain decoding's."""
    plain, _ = _run(pair, "none")
    pair.cost = CostModel(KS, tuple(0.02 * k for k in KS), 0.0, 32, pair.cost.max_exact_rows, online=False)
    for method in ("draft", "auto"):
        out, st = _run(pair, method)
        assert out == plain
        assert pair.draft_kv.tokens == [], method
    assert pair.side[_key(pair)].value.skipped == 0  # not even counted as a skip: it can never pay


def test_catching_up_is_weighed_before_the_draft_model_runs(pair):
    """On a curve where drafting pays (verifying k rows costs one) the draft model drafts; when
    reading the text it missed would cost more than any draft could save, it does not run."""
    pair.cost = flat(0.05, pair.cost.max_exact_rows)
    out, st = _run(pair, "draft")
    assert st.n_drafted > 0 and pair.draft_kv.tokens
    state = pair.side[_key(pair)].value
    state.t_read = 10.0  # seconds per token read: a prompt's catch-up never pays
    state.probe_every = 1 << 20
    out2, st2 = _run(pair, "draft")
    assert out2 == out and st2.n_drafted == 0 and pair.draft_kv.tokens == []


def test_what_the_draft_model_learned_outlives_the_process(tmp_path):
    """Its calibration, confidence and times are written beside the target's cost curve and read
    back by the next process; a record it cannot read is learned again."""
    cm = flat(0.01, 32)
    f = tmp_path / "costs.json"
    f.write_text(json.dumps({"k": {"curve": 1}}))
    cm.origin = (str(f), "k")
    kept = KeptDraftState(cm, "draft-state:d.gguf", 0.02, 0.005)
    s = kept.value
    s.calib.est[:] = 40.0
    s.calib.acc[:] = 22.0
    s.mean_conf, s.t_token, s.t_read, s.probe_every = 0.61, 0.031, 0.004, 256
    kept.close()
    back = KeptDraftState(cm, "draft-state:d.gguf", 0.02, 0.005).value
    assert back.to_dict() == s.to_dict() and back.calib.factor(1) == pytest.approx(22 / 40)
    assert json.loads(f.read_text())["k"]["curve"] == 1
    fresh = DraftState.from_dict({"est": "x"}, 0.02, 0.005)
    assert fresh.mean_conf == DraftState().mean_conf and fresh.t_token == 0.02 and fresh.t_read == 0.005


def test_drafts_never_kept_cost_a_reply_at_most_its_loss_share(smol):
    """A drafter whose every token is wrong, at a confidence (0.3) that pays on this curve (a
    second row costs 1.12 steps): once the reply is its loss share behind plain decoding, it drafts
    only as the reply's length carries the loss (a quarter of the steps here), not every step;
    output identical to plain."""
    from edgespec.costmodel import LOSS_SHARE
    from edgespec.draft import Draft
    from edgespec.drafters.base import Candidates, NullDrafter

    toks = smol.prompt_tokens(PROMPTS[0])
    n = 48
    ref = smol.generate(toks, n, GREEDY).run()

    class Wrong(NullDrafter):
        name = "wrong"

        def propose(self, context, budget):
            i = len(context) - len(toks)
            bad = (ref.tokens[i] + 1) % 1000 if i < len(ref.tokens) else 5
            return Candidates([0.3], lambda k: Draft.chain([bad] * k))

    saved = smol.cost
    smol.cost = CostModel(KS, tuple(0.01 * (1 + 0.12 * (k - 1)) for k in KS), online=False,
                          max_exact_rows=saved.max_exact_rows)
    try:
        g = smol.generate(toks, n, GREEDY, Wrong()).run()
    finally:
        smol.cost = saved
    assert list(g.tokens) == list(ref.tokens) and g.stats.n_accept == 0
    assert 0 < g.stats.n_drafted <= LOSS_SHARE * len(g.tokens) / 0.12 + 2, g.stats.n_drafted


def _slow_and_wrong(smol, monkeypatch, prompt, spread: bool, **flags):
    """Plain decoding's tokens, then two generations with a drafter charged as the draft model is
    (`CHARGED_SOURCES`) that says a draft costs a tenth of a step and takes a whole one, every
    draft wrong, on a flat curve (rows free): one as the scheduler stands, one with `flags`
    (sequential's switches) set. `spread`: the whole step declared as serving later steps
    (`Draft.spread`, a draft model's catch-up)."""
    import time

    from edgespec.draft import Draft
    from edgespec.drafters.base import Candidates, NullDrafter
    from edgespec.schedulers import sequential

    toks = smol.prompt_tokens(prompt)
    ref = smol.generate(toks, 48, GREEDY).run()
    step = 0.01

    class Slow(NullDrafter):
        name = "slow"

        def propose(self, context, budget):
            i = len(context) - len(toks)
            bad = (ref.tokens[i] + 1) % 1000 if i < len(ref.tokens) else 5

            def take(k):
                t0 = time.perf_counter()
                time.sleep(step)  # a whole step's drafting, declared as a tenth
                d = Draft.chain([bad] * k)
                if spread:
                    d.spread = time.perf_counter() - t0
                return d
            return Candidates([0.5], take, per_node=0.1 * step)

    assert "draft" in sequential.CHARGED_SOURCES  # the draft model's time is charged
    monkeypatch.setattr(sequential, "CHARGED_SOURCES", sequential.CHARGED_SOURCES | {"slow"})
    saved = smol.cost
    smol.cost = CostModel(KS, tuple(step for _ in KS), online=False, max_exact_rows=saved.max_exact_rows)
    try:
        as_is = smol.generate(toks, 48, GREEDY, Slow()).run()
        with monkeypatch.context() as m:
            for name, value in flags.items():
                m.setattr(sequential, name, value)
            other = smol.generate(toks, 48, GREEDY, Slow()).run()
    finally:
        smol.cost = saved
    for g in (as_is, other):
        assert list(g.tokens) == list(ref.tokens) and g.stats.n_accept == 0
    return as_is, other


def test_drafting_time_counts_against_a_replys_loss_share(smol, monkeypatch):
    """The loss bound charges what a draft model's drafting took, as measured: a drafter charged as
    one that says a draft costs a tenth of a step but takes a whole one (a draft model's decodes),
    every draft wrong, on a flat curve (rows free): with its time charged it drafts only while the
    reply carries the loss; blind to it (as before), on every step. Output identical to plain
    either way."""
    from edgespec.costmodel import LOSS_SHARE

    charged, blind = _slow_and_wrong(smol, monkeypatch, PROMPTS[0], False, CHARGE_DRAFTING=False)
    assert blind.stats.n_draft_steps >= len(blind.tokens) - 4, blind.stats.n_draft_steps
    assert 0 < charged.stats.n_draft_steps <= LOSS_SHARE * len(charged.tokens) + 3, charged.stats.n_draft_steps


def test_runs_that_draft_nothing_are_weighed_before_the_draft_model_runs(pair, monkeypatch):
    """The gate passes on the confidence of recent drafts; the chain then decides token by token
    and may draft nothing, after the catch-up and a decode were paid. Under --draft-p-min above any
    confidence every run drafts nothing: weighed by the share of runs that drafted, the draft model
    soon stops running (a probe now and then); blind to it, it runs on nearly every step. Output
    identical to plain decoding either way, nothing drafted."""
    import dataclasses

    from edgespec.drafters import draft_model

    plain, _ = _run(pair, "none", PROMPTS[1], 64)
    assert len(plain) == 64
    pair.cost = flat(0.05, pair.cost.max_exact_rows)  # rows free: the gate passes on any confidence
    cfg = pair.cfg
    pair.cfg = dataclasses.replace(cfg, draft_p_min=1.01)
    syncs = []
    sync = pair.draft_kv.sync
    monkeypatch.setattr(pair.draft_kv, "sync", lambda ctx: syncs.append(len(ctx)) or sync(ctx))
    runs = {}
    try:
        for weigh in (False, True):
            monkeypatch.setattr(draft_model, "WEIGH_HITS", weigh)
            pair.side.release(_key(pair))
            # a new user's hit rate (1, the prior), and a catch-up of the prompt priced free, so
            # that the first step runs the draft model (a busy machine's timed catch-ups would
            # keep it from ever running, and this test from seeing what its runs teach)
            st = pair.side.keep(_key(pair), lambda: KeptDraftState(pair.cost, _key(pair), pair.draft_cost.t(1), 0.0)).value
            st.hit, st.t_read, st.t_token = 1.0, 0.0, pair.draft_cost.t(1)
            syncs.clear()
            out, st = _run(pair, "draft", PROMPTS[1], 64)
            assert out == plain and st.n_drafted == 0
            runs[weigh] = len(syncs)
        assert pair.side[_key(pair)].value.hit < 0.5
    finally:
        pair.cfg = cfg
    assert runs[False] >= len(plain) - 4, runs
    assert runs[True] <= runs[False] / 2, runs


def test_a_catch_up_is_charged_as_its_gate_spreads_it(smol, monkeypatch):
    """The part of a step's drafting time a drafter declares as serving later steps too
    (`Draft.spread`: a draft model's catch-up, less the share its gate weighs on this step) is
    not charged to the reply's loss bound now; charged whole (SPREAD_CATCH_UP off) it is. The
    drafter above with its whole step declared spread: it drafts on nearly every step; charged
    whole, only while the reply carries the loss. Output identical to plain either way."""
    from edgespec.costmodel import LOSS_SHARE

    spread, whole = _slow_and_wrong(smol, monkeypatch, PROMPTS[1], True, SPREAD_CATCH_UP=False)
    assert spread.stats.n_draft_steps >= len(spread.tokens) - 4, spread.stats.n_draft_steps
    assert 0 < whole.stats.n_draft_steps <= LOSS_SHARE * len(whole.tokens) + 3, whole.stats.n_draft_steps
