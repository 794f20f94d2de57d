"""Greedy speculative output equals plain greedy output token for token, on real models."""

import pytest

from conftest import GREEDY, PROMPTS, Spy, generate
from edgespec.runner import Engine, EngineConfig

N = 64


@pytest.fixture(scope="module")
def plain_smol(smol):
    return {p: generate(smol, smol.prompt_tokens(p), N).tokens for p in PROMPTS}


@pytest.mark.parametrize("method", ["ngram", "lookahead"])
@pytest.mark.parametrize("gpu_like", [False, True])
def test_draft_free_methods_equal_plain(smol, plain_smol, method, gpu_like):
    drafted = accepted = 0
    multi_branch_steps = relaid = 0
    for p in PROMPTS:
        spy = Spy(smol.make_drafter(method))
        g = generate(smol, smol.prompt_tokens(p), N, drafter=spy, gpu_like=gpu_like)
        assert g.tokens == plain_smol[p], f"{method} diverged from plain on {p[:30]!r}"
        drafted += g.stats.n_drafted
        accepted += g.stats.n_accept
        for draft, acc in spy.log:
            multi_branch_steps += len(draft.leaves()) > 1
            relaid += bool(acc) and not all(draft.parents[a] == a - 1 for a in acc)
    assert drafted > 0 and accepted > 0
    if method == "lookahead" and gpu_like:
        assert multi_branch_steps > 0, "no tree with several branches was verified"
        assert relaid > 0, "no accepted path off the first branch (re-laid KV) was exercised"


def test_draft_model_equals_plain(smol_pair):
    eng = smol_pair
    accepted = 0
    for p in PROMPTS[:3]:
        toks = eng.prompt_tokens(p)
        plain = generate(eng, toks, N)
        spec = generate(eng, toks, N, "draft")
        assert spec.tokens == plain.tokens
        spec = generate(eng, toks, N, "draft", gpu_like=True)  # drafts even where a CPU would not
        assert spec.tokens == plain.tokens
        assert spec.stats.n_steps < plain.stats.n_steps
        accepted += spec.stats.n_accept
        auto = generate(eng, toks, N, "auto")
        assert auto.tokens == plain.tokens
    assert accepted > 0


def test_gemma3_sliding_window_with_requantized_draft():
    eng = Engine(EngineConfig(model="gemma3-270m", draft="gemma3-270m:q4_0", n_ctx=1024, threads=2))
    try:
        for text in ("The history of the printing press", "def fibonacci(n):\n    "):
            toks = eng.prompt_tokens(text, raw=True)
            plain = generate(eng, toks, 48)
            spec = generate(eng, toks, 48, "draft", gpu_like=True)
            assert spec.tokens == plain.tokens
            assert spec.stats.n_accept > 0
            look = generate(eng, toks, 48, "lookahead", gpu_like=True)
            assert look.tokens == plain.tokens
    finally:
        eng.close()


def test_stats_are_consistent(smol):
    g = generate(smol, smol.prompt_tokens(PROMPTS[3]), N, "lookahead")
    st = g.stats
    assert st.n_generated == len(g.tokens)
    assert st.n_accept <= st.n_drafted
    assert st.n_generated == st.n_steps + st.n_accept  # each step: accepted drafts + one own token
    assert abs(st.mean_accepted_length - st.n_generated / st.n_steps) < 1e-9
    assert sum(st.accepted_at) == st.n_accept
    d = st.to_dict()
    for key in ("n_drafted", "n_accept", "acceptance_rate", "mean_accepted_length", "t_draft", "t_verify",
                "n_prompt", "t_prompt", "tokens_per_s", "acceptance_by_position"):
        assert key in d
