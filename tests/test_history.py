"""The user's past replies as a drafting source (edgespec.history): kept bounded across restarts,
one file per user or API key, drafted from with a calibration of its own, only where it pays on
the cost curve; greedy output identical to plain decoding, sampled output the target's
distribution."""

import os

import pytest

from conftest import GREEDY
from edgespec.costmodel import KS, CostModel, flat
from edgespec.drafters.base import Budget, Calibration, sized
from edgespec.drafters.lookahead import CLOSING, HISTORY, LookaheadDrafter, Sources, new_calibration
from edgespec.history import History, path_for
from edgespec.trie import TokenTrie

# this machine's curve, as measured (docs/drafting.md): a second row costs 1.67 plain steps,
# eight rows 2.4; and a GPU-like one where verifying 32 rows costs one
CPU = CostModel(KS, tuple(0.01 * (1 + 0.67 * min(k - 1, 1) + 0.105 * max(0, k - 2)) for k in KS), online=False)
GPU = flat(0.01)
REPLY = list(range(100, 130))  # a past reply: 30 tokens no prompt holds


def _budget(cost, n_min=0):
    return Budget(max_nodes=16, max_branches=1, fixed_rows=1, cost=cost, sampling=GREEDY, n_min=n_min)


def _drafter(history, history_calib=None):
    d = LookaheadDrafter(window=8, history=history, history_calib=history_calib)
    d.begin([1, 2, 3])
    return d


def test_history_is_kept_across_restarts_bounded_and_private(tmp_path):
    path = tmp_path / "history" / "local.npz"
    h = History.open(path)
    h.add(REPLY)
    h.save(soon=True)
    assert oct(os.stat(path).st_mode & 0o777) == "0o600" and oct(os.stat(path.parent).st_mode & 0o777) == "0o700"
    again = History.open(path)
    assert again.trie.walk(REPLY[:8]) is not None and again.trie.walk([1, 2]) is None
    # bounded: the trie prunes itself to its capacity
    small = History(None, TokenTrie(window=8, capacity=500))
    for i in range(50):
        small.add([1000 + (i * 7 + j) % 997 for j in range(40)])
        assert small.trie.n_nodes <= 500
    # between replies written at most once a minute (the first at once), always when closed
    h.add([7, 8, 9])
    h.save(soon=True)
    assert History.open(path).trie.walk([7, 8, 9]) is None
    h.close()
    assert History.open(path).trie.walk([7, 8, 9]) is not None
    # an unreadable file: a new history, rewritten at the next save
    path.write_bytes(b"not a trie")
    assert History.open(path).trie.n_nodes == 0


def test_each_api_key_has_its_own_file_and_the_key_is_not_written(tmp_path):
    a, b, local = path_for(tmp_path, "key-a"), path_for(tmp_path, "key-b"), path_for(tmp_path)
    assert len({a, b, local}) == 3 and "key-a" not in a.name
    assert path_for(tmp_path, "key-a") == a


def test_a_past_reply_is_drafted_as_its_own_source_and_learns_apart():
    h = History(None)
    h.add(REPLY)
    d = _drafter(h)
    budget = _budget(GPU)
    draft = sized(d.propose([1, 2, 3, 50] + REPLY[:6], budget), budget)
    assert draft.source == HISTORY and draft.tokens[:4] == REPLY[6:10]
    before_main = {s: c.factor(1) for s, c in d.calib.items()}
    before_hist = d.history_calib[6].factor(1)
    d.accept(draft, [], [7])  # rejected: the history's calibration learns it, lookahead's does not
    assert d.history_calib[6].factor(1) < before_hist
    assert {s: c.factor(1) for s, c in d.calib.items()} == before_main
    # the reply is added to the history when the generation ends
    context = [1, 2, 3, 60, 61, 62, 63]
    d2 = _drafter(h)
    d2.propose(context, budget)
    context += [64, 65]  # the generation's list grows in place
    d2.end()
    assert h.trie.walk([60, 61, 62, 63, 64, 65]) is not None and h.trie.walk([1, 2, 3]) is None


def test_zero_rows_where_no_draft_pays_on_this_machines_curve():
    """A step drafts only where the expected tokens per second beat a plain step: on this
    machine's curve a short match whose source has been mostly rejected drafts nothing, a long
    copy of a reply that the target kept drafts; on a GPU-like curve both draft."""
    h = History(None)
    h.add(REPLY)
    context = [1, 2, 3, 50] + REPLY[:2]  # a 2-token match
    doubted = {s: Calibration(prior=0.3) for s in range(1, 9)}
    doubted[CLOSING] = Calibration(prior=0.3)
    assert len(sized(_drafter(h, doubted).propose(context, _budget(CPU)), _budget(CPU))) == 0
    assert len(sized(_drafter(h, doubted).propose(context, _budget(GPU)), _budget(GPU))) > 0
    trusted = new_calibration()
    for s in trusted:  # what a revision teaches: long copies kept
        trusted[s] = Calibration(prior=1.5)
    long_copy = [1, 2, 3, 50] + REPLY[:8]
    assert len(sized(_drafter(h, trusted).propose(long_copy, _budget(CPU)), _budget(CPU))) >= 2


def test_sources_calibrations_are_kept_beside_the_cost_curve(tmp_path):
    from edgespec.costcache import _store

    cm = flat(0.01)
    cm.online = True
    cm.origin = (str(tmp_path / "costs.json"), "key")
    _store(cm)
    first = Sources(cm)
    cal = first.value[HISTORY][5]
    prior = cal.factor(1)
    h = History(None)
    h.add(REPLY)
    d = _drafter(h, first.value[HISTORY])
    for _ in range(20):  # long copies kept: the factor rises
        draft = sized(d.propose([1, 2, 3, 50] + REPLY[:5], _budget(GPU)), _budget(GPU))
        d.accept(draft, list(range(len(draft))) if draft.is_chain else [0], [])
    learned = cal.factor(1)
    assert learned > prior
    first.close()
    assert Sources(cm).value[HISTORY][5].factor(1) == pytest.approx(learned, rel=1e-4)
    assert Sources(flat(0.01)).value[HISTORY][5].factor(1) == pytest.approx(prior)  # no cache: the prior


@pytest.fixture(scope="module")
def smol_history(tmp_path_factory):
    from edgespec.engine import Engine, EngineConfig

    path = tmp_path_factory.mktemp("history") / "local.npz"
    eng = Engine(EngineConfig(model="smollm2-135m-instruct:q4_0", n_ctx=2048, threads=2, history=str(path)))
    yield eng, path
    eng.close()


def test_greedy_conversations_with_the_history_are_plain_decodings_output(smol_history):
    """Two turns (the second repeats part of the first reply), then a new conversation asking
    the first question again: `auto` with the history drafts the repeated reply from it, and
    every reply is token for token plain decoding's."""
    from edgespec.frontends.session import ChatSession

    eng, path = smol_history
    saved = eng.cost
    eng.cost = flat(0.05, saved.max_exact_rows)  # drafting pays: every source is exercised
    question = "Name three uses of a paperclip, one per line."
    turns = [question, "Repeat the first line of your answer exactly."]

    def converse(method):
        s = ChatSession(eng, method, GREEDY, max_tokens=48)
        out = [s.send(t) for t in turns]
        s.clear()
        return out + [s.send(question)]

    try:
        plain = converse("none")
        spec = converse("auto")
    finally:
        eng.cost = saved
    assert [r.tokens for r in spec] == [r.tokens for r in plain]
    kept = spec[2].stats.by_source.get(HISTORY, [0, 0, 0])
    assert kept[2] >= len(spec[2].tokens) // 2, spec[2].stats.by_source  # the repeated reply, from history
    assert spec[2].stats.mean_accepted_length > 2
    # kept for the next process
    eng.side.release("history")
    assert History.open(path).trie.walk(spec[0].tokens[:6]) is not None


@pytest.mark.parametrize("n_parallel", [1, 2])
def test_a_servers_key_drafts_from_its_past_replies_at_any_np(smol_history, n_parallel):
    """A server with an API key (requests of share "", the engine's history the key's file):
    one sequence at a time or several per decode, each finished reply joins the key's history,
    and a later run (a fresh lookahead trie, as after a restart) drafts a repeated answer from
    it; a keyless request (share None) neither reads nor grows it. Every output is plain
    decoding's."""
    from edgespec.serving.loop import run_requests
    from edgespec.serving.requests import Request

    eng, path = smol_history
    question = f"List {3 + n_parallel} colours of the rainbow, one per line, nothing else."

    def serve(method, share):
        reqs = [Request(0, "a", messages=[{"role": "user", "content": question}], max_tokens=40,
                        sampling=GREEDY, share=share)]
        return run_requests(eng, reqs, method, n_parallel, lambda r, rec: None, quiet=True)

    saved = eng.cost
    eng.cost = flat(0.05, saved.max_exact_rows)  # drafting pays: the history is drafted from
    try:
        plain = serve("none", "")
        keyless = serve("lookahead", None)
        grown = History.open(path).trie.n_nodes if path.exists() else 0
        eng.side.release("history")  # written: a keyless reply added nothing
        assert (History.open(path).trie.n_nodes if path.exists() else 0) == grown
        first = serve("lookahead", "")
        again = serve("lookahead", "")
    finally:
        eng.cost = saved
    out = plain.outputs["a"]
    assert keyless.outputs["a"] == first.outputs["a"] == again.outputs["a"] == out
    assert HISTORY not in keyless.stats.by_source
    kept = again.stats.by_source.get(HISTORY, [0, 0, 0])
    assert kept[2] >= len(out) // 2, again.stats.by_source
    eng.side.release("history")
    assert History.open(path).trie.walk(out[:6]) is not None
    # sampled and seeded: drafts from the history carry no distribution of their own, the
    # verifier draws every token from the target once, so the text is plain sampling's (at
    # temperature 1 the draft is rejected on some step: with the textbook bug planted, kept by its
    # own probability else a draw from p, this fails at -np 1 and 2)
    from edgespec.sampling import SamplingConfig

    hot = SamplingConfig(temp=1.0, seed=5)

    def sample(method):
        reqs = [Request(0, "s", messages=[{"role": "user", "content": question}], max_tokens=40, sampling=hot,
                        share="")]
        return run_requests(eng, reqs, method, n_parallel, lambda r, rec: None, quiet=True)

    eng.cost = flat(0.05, saved.max_exact_rows)
    try:
        spec, base = sample("lookahead"), sample("none")
    finally:
        eng.cost = saved
    assert spec.outputs["s"] == base.outputs["s"]
    assert spec.stats.by_source.get(HISTORY, [0, 0, 0])[1] > 0, spec.stats.by_source


def test_sampled_output_with_the_history_is_the_target_distribution(tiny_pair):
    """The history source under sampling: drafts from past replies verified by the rejection
    rule keep the target's distribution (test_distribution's harness: N completions, seeded and
    not, chi-square at ALPHA), with the history drafting."""
    from test_distribution import ALPHA, CFG, PROMPT, _flat, completions, exact_distribution, forced, gof

    from edgespec.sampling import SamplingConfig

    flat_cost = _flat(tiny_pair)
    eng = next(flat_cost)
    try:
        toks = eng.prompt_tokens(PROMPT, raw=True)
        expected = exact_distribution(eng, toks, SamplingConfig(**CFG))
        h = History(None)
        for reply in (" blue. red, green, yellow.", " yellow. red, green, blue.", " blue, red."):
            h.add(eng.prompt_tokens(reply, raw=True))
        low = {s: Calibration(prior=0.05) for s in range(0, 9)}  # the prompt's trie loses: history drafts
        sources = []

        class Logged(LookaheadDrafter):
            def accept(self, draft, accepted, committed):
                if draft.tokens:
                    sources.append(draft.source)
                super().accept(draft, accepted, committed)

        make = forced(eng, lambda cfg: Logged(calib=low, history=h, is_stop=eng.target.is_eog))
        for seeded in (True, False):
            p = gof(completions(make, seeded), expected)
            assert p > ALPHA, (seeded, p)
        assert sources.count(HISTORY) > 50
    finally:
        next(flat_cost, None)  # the engine's own curve back
