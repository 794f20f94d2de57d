"""The stats' figures mean what their names say: a step that yields the end of generation is a
step that yielded a token, not one that kept nothing."""

from types import SimpleNamespace

from edgespec.draft import Draft
from edgespec.events import Stats
from edgespec.lifecycle import Lifecycle
from edgespec.sampling import SamplingConfig

END = 0


def _gen(max_tokens: int = 100) -> Lifecycle:
    engine = SimpleNamespace(target=SimpleNamespace(is_eog=lambda t: t == END))
    return Lifecycle(engine, [5, 6], max_tokens, SamplingConfig())


def test_plain_reply_is_one_token_per_step():
    # 11 tokens by plain steps, then the step that yields the end: 12 steps, 12 tokens yielded
    g = _gen()
    for i in range(11):
        ev, done = g._commit(i, Draft(), [], [100 + i], 0.0, 0.0, "none")
        assert not done and not ev.ended and ev.n_yielded == 1
    ev, done = g._commit(11, Draft(), [], [END], 0.0, 0.0, "none")
    assert done and ev.ended and ev.tokens == () and ev.n_yielded == 1
    st = g.stats
    assert (st.n_generated, st.n_steps, st.n_ended, st.finish_reason) == (11, 12, 1, "stop")
    assert st.mean_accepted_length == 1.0  # was 11 / 12
    assert st.accepted_len_hist == [0, 12]  # no step kept nothing
    assert st.to_dict()["mean_accepted_length"] == 1.0


def test_accepted_drafts_then_the_end():
    g = _gen()
    g._commit(0, Draft(), [], [7], 0.0, 0.0, "none")
    d = Draft([8, 9], [-1, 0], None, "lookahead")
    ev, done = g._commit(1, d, [0, 1], [8, 9, END], 0.0, 0.0, "lookahead")
    assert done and ev.ended and ev.tokens == (8, 9) and ev.n_accept == 2 and ev.n_yielded == 3
    assert g.stats.mean_accepted_length == 2.0 and g.stats.accepted_len_hist == [0, 1, 0, 1]


def test_a_cut_at_the_token_limit_yields_no_end():
    g = _gen(max_tokens=3)
    g._commit(0, Draft(), [], [7], 0.0, 0.0, "none")
    d = Draft([8, 9, 10], [-1, 0, 1], None, "lookahead")
    ev, done = g._commit(1, d, [0, 1, 2], [8, 9, 10, 11], 0.0, 0.0, "lookahead")
    assert done and not ev.ended and ev.tokens == (8, 9)
    st = g.stats
    assert (st.finish_reason, st.n_ended) == ("length", 0) and st.mean_accepted_length == 1.5


def test_merged_stats_keep_the_ends():
    a, b = Stats(n_generated=11, n_steps=12, n_ended=1), Stats(n_generated=20, n_steps=10, n_ended=1)
    a.merge(b)
    assert a.n_ended == 2 and a.mean_accepted_length == 33 / 22
