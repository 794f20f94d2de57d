"""Greedy speculative output equals plain greedy output token for token, on real models."""

import pytest

from conftest import PROMPTS, Spy, generate
from edgespec.engine import Engine, EngineConfig

N = 64


@pytest.fixture(scope="module")
def plain_smol(smol):
    return {p: generate(smol, smol.prompt_tokens(p), N).tokens for p in PROMPTS}


@pytest.mark.parametrize("method", ["ngram", "lookahead"])
@pytest.mark.parametrize("gpu_like", [False, True])
def test_draft_free_methods_equal_plain(smol, plain_smol, method, gpu_like):
    drafted = accepted = 0
    multi_branch_steps = relaid = eog_nodes = 0
    eog = smol.target.is_eog
    for p in PROMPTS:
        spy = Spy(smol.make_drafter(method))
        g = generate(smol, smol.prompt_tokens(p), N, drafter=spy, gpu_like=gpu_like)
        assert g.tokens == plain_smol[p], f"{method} diverged from plain on {p[:30]!r}"
        drafted += g.stats.n_drafted
        accepted += g.stats.n_accept
        for draft, acc in spy.log:
            multi_branch_steps += len(draft.leaves()) > 1
            relaid += bool(acc) and not all(draft.parents[a] == a - 1 for a in acc)
            # the prompt's continuations run on into the chat template; a draft goes up to the end
            # of generation, without it (the row before yields it where the target ends)
            eog_nodes += sum(map(eog, draft.tokens))
    assert drafted > 0 and accepted > 0
    assert eog_nodes == 0, "a draft holds an end-of-generation token"
    if method == "lookahead" and gpu_like:
        assert multi_branch_steps > 0, "no tree with several branches was verified"
        assert relaid > 0, "no accepted path off the first branch (re-laid KV) was exercised"


def test_draft_model_equals_plain(smol_pair):
    eng = smol_pair
    steps_plain = steps_spec = accepted = 0
    for p in PROMPTS[:3]:
        toks = eng.prompt_tokens(p)
        plain = generate(eng, toks, N)
        spec = generate(eng, toks, N, "draft")
        assert spec.tokens == plain.tokens
        spec = generate(eng, toks, N, "draft", gpu_like=True)  # drafts even where a CPU would not
        assert spec.tokens == plain.tokens
        steps_plain += plain.stats.n_steps
        steps_spec += spec.stats.n_steps
        accepted += spec.stats.n_accept
        auto = generate(eng, toks, N, "auto")
        assert auto.tokens == plain.tokens
    assert accepted > 0 and steps_spec < steps_plain


def test_draft_model_drafts_end_at_the_end_of_generation(smol_pair):
    """A one-sentence answer (drafting cheap, as on a GPU): greedy, the draft model's draft stops
    before the end token it would draft, since the row before yields it where the target ends;
    the output is plain decoding's."""
    eng = smol_pair
    eog = eng.target.is_eog
    toks = eng.prompt_tokens(PROMPTS[2])
    spy = Spy(eng.make_drafter("draft"))
    g = generate(eng, toks, N, drafter=spy, gpu_like=True)
    assert g.tokens == generate(eng, toks, N).tokens
    assert g.stats.finish_reason == "stop"
    assert not any(eog(t) for draft, _ in spy.log for t in draft.tokens), "a draft holds the end token"
    # drafting as cheap as on a GPU, the draft model drafts every step it can: the last step's
    # draft is empty because its next token is the end, and the target's own row yields it
    assert all(d.tokens for d, _ in spy.log[:-1]) and not spy.log[-1][0].tokens


@pytest.mark.slow
def test_draft_model_forced_drafts_equal_plain():
    """--draft-min forces a draft every step: rollback of both caches on every rejection."""
    eng = Engine(EngineConfig(model="smollm2-135m-instruct:q8_0", draft="smollm2-135m-instruct:q4_0",
                              n_ctx=2048, threads=2, draft_n_min=3, draft_n_max=6))
    try:
        for p in (PROMPTS[1], PROMPTS[4]):
            toks = eng.prompt_tokens(p)
            plain = generate(eng, toks, N)
            spec = generate(eng, toks, N, "draft")
            assert spec.tokens == plain.tokens
            assert spec.stats.n_draft_steps >= spec.stats.n_steps - 2
            assert 0 < spec.stats.n_accept < spec.stats.n_drafted  # both accepts and rejections
    finally:
        eng.close()


@pytest.mark.slow
def test_gemma3_sliding_window_with_requantized_draft():
    # the requantized draft costs about what the target does, so force drafts with n_min
    eng = Engine(EngineConfig(model="gemma3-270m", draft="gemma3-270m:q4_0", n_ctx=1024, threads=2, draft_n_min=2))
    try:
        for text in ("The history of the printing press", "def fibonacci(n):\n    "):
            toks = eng.prompt_tokens(text, raw=True)
            plain = generate(eng, toks, 48)
            spec = generate(eng, toks, 48, "draft", gpu_like=True)
            assert spec.tokens == plain.tokens
            assert spec.stats.n_accept > 0
            spy = Spy(eng.make_drafter("lookahead"))
            look = generate(eng, toks, 48, drafter=spy, gpu_like=True)
            assert look.tokens == plain.tokens
            # Q4_K weights are not bit-exact in batches this large on every CPU: the probe caps them
            assert all(len(d) + 1 <= eng.cost.max_exact_rows for d, _ in spy.log)
    finally:
        eng.close()


def test_stats_are_consistent(smol):
    g = generate(smol, smol.prompt_tokens(PROMPTS[3]), N, "lookahead")
    st = g.stats
    assert st.n_generated == len(g.tokens)
    assert st.n_accept <= st.n_drafted
    # each step commits its accepted drafts plus one token of the target's own (the last may be cut)
    assert st.n_steps + st.n_accept - 1 <= st.n_generated <= st.n_steps + st.n_accept
    # tokens per step, the end of generation counted where a step yielded it (never below 1)
    assert st.n_ended == (st.finish_reason == "stop")
    assert abs(st.mean_accepted_length - (st.n_generated + st.n_ended) / st.n_steps) < 1e-9
    assert st.mean_accepted_length >= 1.0 and st.accepted_len_hist[0] == 0
    assert sum(st.accepted_at) == st.n_accept
    d = st.to_dict()
    for key in ("n_drafted", "n_accept", "acceptance_rate", "mean_accepted_length", "t_draft", "t_verify",
                "n_prompt", "t_prompt", "tokens_per_s", "acceptance_by_position"):
        assert key in d


def test_sampled_lookahead_tree_runs_and_is_seeded(smol):
    from edgespec.sampling import SamplingConfig

    # the list's items follow "- " in several ways: the trie has branches whatever is drawn (the
    # sentence of PROMPTS[3] drew trees on one CPU and none on another, its sampled text differing)
    toks = smol.prompt_tokens(PROMPTS[0])
    cfg = SamplingConfig(temp=0.7, seed=5)
    runs = []
    for _ in range(2):
        spy = Spy(smol.make_drafter("lookahead"))
        g = generate(smol, toks, 48, sampling=cfg, drafter=spy, gpu_like=True)
        runs.append(g.tokens)
        assert g.stats.n_drafted > 0
    assert runs[0] == runs[1]
    assert any(len(d.leaves()) > 1 for d, _ in spy.log)


def test_lookahead_cache_persists_output_branches(tmp_path):
    path = tmp_path / "trie.npz"
    eng = Engine(EngineConfig(model="smollm2-135m-instruct:q4_0", n_ctx=1024, threads=2, lookahead_cache=str(path)))
    try:
        toks = eng.prompt_tokens("Name three fruits, separated by commas.")
        first = generate(eng, toks, 24, "lookahead")
        assert path.exists()
        drafter = eng.make_drafter("lookahead")
        # the loaded trie holds the previous answer's n-grams (and no prompt branches)
        assert drafter.trie.walk(first.tokens[:3]) is not None
        assert drafter.trie.walk(toks[-4:]) is None or drafter.trie.walk(toks[-4:]).fp == 0
        second = generate(eng, toks, 24, drafter=drafter, gpu_like=True)
        assert second.tokens == first.tokens
        assert second.stats.n_accept > 0  # the same question drafts from the saved answer
    finally:
        eng.close()
