"""Sampled output is the target's distribution, end to end, for every method.

The exact distribution of the first few tokens is computed from the target itself (every
continuation inside the top-k cut is scored), then each method samples the same prompt many
times through the real loop, with a seed per run and without seeds (as users run it), and a
chi-square goodness-of-fit test compares the completions with it. Drafting is forced where a
CPU would decline it (a cost curve under which drafting pays), and the draft model runs with a
`--spec-draft-p-min` cut: the paths where a drafter could bias the output.

Seeded runs use fixed seeds, so their verdicts do not vary between runs; unseeded runs are
judged at alpha = 1e-4.
"""

from collections import Counter

import numpy as np
import pytest
from scipy.stats import chisquare

from edgespec.costmodel import flat
from edgespec.drafters.draft_model import DraftModelDrafter
from edgespec.engine import Engine, EngineConfig
from edgespec.sampling import SamplingConfig, warp

L = 3  # tokens per completion: the first comes from the prefill, the others from drafted steps
# Sized by the power the test needs, and no smaller: the textbook bug (a drafted token kept with
# its own probability p, the rejected case sampled from p again instead of the residual) moves a
# 0.65/0.32/0.03 position to 0.88/0.11/0.01 (w^2 = 0.23). Over 3-9 pooled outcomes at ALPHA, 150
# completions catch it with probability 0.79-0.95; 100 would catch it 0.42-0.72 of the time, 75
# only 0.22-0.48 (scipy.stats.ncx2). Completions cost 70-240 ms each on 2 cores (the prompt read
# dominates), so these tests are ~8 minutes of the suite's time by what they must show.
N = 150  # completions per method and seeding
ALPHA = 1e-4
CFG = dict(temp=1.0, top_k=3, top_p=1.0, min_p=0.0)
# Repetitive enough for the trie and the n-gram index to draft, open enough to sample.
PROMPT = "red, green, blue. red, green, yellow. red, green,"


def exact_distribution(eng, prompt: list[int], cfg: SamplingConfig) -> dict[tuple, float]:
    """P(first L tokens) under the target, by scoring every continuation within the cut; a
    completion that meets end-of-generation stops there (the token is not part of it)."""
    out: dict[tuple, float] = {}

    def walk(prefix: tuple, prob: float) -> None:
        eng.kv.reset()
        row = eng.kv.extend(prompt + list(prefix))
        p = warp(eng.ctx.logits(row), cfg)
        for y in np.flatnonzero(p):
            y = int(y)
            q = prob * float(p[y])
            if eng.target.is_eog(y):
                out[prefix] = out.get(prefix, 0.0) + q
            elif len(prefix) + 1 == L:
                out[prefix + (y,)] = q
            else:
                walk(prefix + (y,), q)

    walk((), 1.0)
    eng.kv.reset()
    return out


def gof(samples: list[tuple], expected: dict[tuple, float]) -> float:
    """Chi-square goodness-of-fit p-value; outcomes of expected count < 5 are pooled."""
    counts = Counter(samples)
    impossible = [s for s in counts if s not in expected]
    assert not impossible, f"completions the target cannot produce: {impossible[:3]}"
    n = len(samples)
    obs, exp, pool_o, pool_e = [], [], 0, 0.0
    for k, p in sorted(expected.items(), key=lambda kv: -kv[1]):
        if n * p >= 5:
            obs.append(counts.get(k, 0))
            exp.append(n * p)
        else:
            pool_o += counts.get(k, 0)
            pool_e += n * p
    if pool_e > 0:
        obs.append(pool_o)
        exp.append(pool_e)
    return float(chisquare(obs, exp).pvalue)


def completions(make, seeded: bool) -> list[tuple]:
    """N completions; `make(cfg)` starts one generation."""
    out = []
    for i in range(N):
        cfg = SamplingConfig(**CFG, seed=1000 + i if seeded else None)
        out.append(tuple(make(cfg).run().tokens))
    return out


def forced(eng, make_drafter, prompt: list[int] | None = None):
    """Generations under a cost curve on which drafting pays (a GPU-like machine)."""
    toks = eng.prompt_tokens(PROMPT, raw=True) if prompt is None else prompt

    def make(cfg):
        return eng.generate(toks, L, cfg, make_drafter(cfg))
    return make


@pytest.fixture(scope="module")
def gpu_like(smol_pair):
    """The pair engine with a flat cost curve, so that every drafter drafts."""
    saved = smol_pair.cost
    smol_pair.cost = flat(0.05, saved.max_exact_rows)
    yield smol_pair
    smol_pair.cost = saved


@pytest.fixture(scope="module")
def twin():
    """The target as its own draft model (q = p): where a biased draft length shows the most."""
    eng = Engine(EngineConfig(model="smollm2-135m-instruct:q8_0", draft="smollm2-135m-instruct:q8_0", n_ctx=512,
                              threads=2))
    eng.cost = flat(0.05, eng.cost.max_exact_rows)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def expected(gpu_like):
    return exact_distribution(gpu_like, gpu_like.prompt_tokens(PROMPT, raw=True), SamplingConfig(**CFG))


def p_min_drafter(eng):
    """The draft model with a --spec-draft-p-min cut: at the second token the likeliest of the
    top three (p = 0.65) passes it and the others (0.32, 0.03) do not."""
    return lambda cfg: DraftModelDrafter(eng.draft_model, eng.draft_kv, 8, 0, 0.5, cfg.seed,
                                         t_token=eng.draft_cost.t(1))


METHODS = {
    "none": lambda eng: forced(eng, lambda cfg: eng.make_drafter("none")),
    "draft-p-min": lambda eng: forced(eng, p_min_drafter(eng)),
    "draft": lambda eng: forced(eng, lambda cfg: eng.make_drafter("draft", cfg.seed)),
    "auto": lambda eng: forced(eng, lambda cfg: eng.make_drafter("auto", cfg.seed)),
    "lookahead": lambda eng: forced(eng, lambda cfg: eng.make_drafter("lookahead")),
    "ngram": lambda eng: forced(eng, lambda cfg: eng.make_drafter("ngram")),
    "pearl": lambda eng: lambda cfg: eng.start(eng.prompt_tokens(PROMPT, raw=True), L, cfg, "pearl"),
    # the heads shipped for SmolLM2 (trees drafted from the target's hidden states)
    "medusa": lambda eng: forced(eng, lambda cfg: eng.make_drafter("medusa")),
    "eagle": lambda eng: forced(eng, lambda cfg: eng.make_drafter("eagle")),
    "mtp": lambda eng: forced(eng, lambda cfg: eng.make_drafter("mtp")),
    "eagle3": lambda eng: forced(eng, lambda cfg: eng.make_drafter("eagle3")),  # llama.cpp's graph
}


@pytest.mark.slow
@pytest.mark.parametrize("seeded", [True, False], ids=["seeded", "unseeded"])
@pytest.mark.parametrize("method", list(METHODS))
def test_sampled_output_is_the_target_distribution(gpu_like, twin, expected, method, seeded):
    assert 0.999 < sum(expected.values()) < 1.001
    assert len(expected) >= 6 and max(expected.values()) < 0.8, "the test needs a distribution to compare"
    samples = completions(METHODS[method](twin if method == "draft-p-min" else gpu_like), seeded)
    p = gof(samples, expected)
    assert p > ALPHA, f"{method} ({'seeded' if seeded else 'unseeded'}): chi-square p = {p:.3g} over {N} completions"


def test_gof_detects_a_biased_sampler():
    """The statistic itself: a sampler that favours the likeliest outcome is caught."""
    expected = {("a",): 0.5, ("b",): 0.3, ("c",): 0.2}
    rng = np.random.default_rng(0)
    fair = [("a", "b", "c")[i] for i in rng.choice(3, 300, p=[0.5, 0.3, 0.2])]
    biased = [("a", "b", "c")[i] for i in rng.choice(3, 300, p=[0.65, 0.2, 0.15])]
    assert gof([(x,) for x in fair], expected) > ALPHA
    assert gof([(x,) for x in biased], expected) < 0.01


# An answer that often ends within L tokens ("Yes" then end of generation): drafts reach the end
# token (a sampled draft model's and PEARL's stop after drafting it, lookahead's before it),
# which must leave the sampled output the target's.
EOG_PROMPT = "Reply with the single word: yes"
EOG_METHODS = {
    "draft": lambda eng, toks: forced(eng, lambda cfg: eng.make_drafter("draft", cfg.seed), toks),
    "lookahead": lambda eng, toks: forced(eng, lambda cfg: eng.make_drafter("lookahead"), toks),
    "pearl": lambda eng, toks: lambda cfg: eng.start(toks, L, cfg, "pearl"),
}


@pytest.mark.slow
@pytest.mark.parametrize("seeded", [True, False], ids=["seeded", "unseeded"])
@pytest.mark.parametrize("method", list(EOG_METHODS))
def test_sampled_output_with_drafts_ending_at_the_end_token(gpu_like, method, seeded):
    toks = gpu_like.prompt_tokens(EOG_PROMPT)
    expected = exact_distribution(gpu_like, toks, SamplingConfig(**CFG))
    assert sum(p for k, p in expected.items() if len(k) < L) > 0.1, "the test needs answers that end early"
    samples = completions(EOG_METHODS[method](gpu_like, toks), seeded)
    assert any(len(s) < L for s in samples)
    p = gof(samples, expected)
    assert p > ALPHA, f"{method} ({'seeded' if seeded else 'unseeded'}): chi-square p = {p:.3g} over {N} completions"
