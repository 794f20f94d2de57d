"""Sampled output is the target's distribution, end to end, for every method.

The exact distribution of the first few tokens is computed from the target itself (every
continuation inside the top-k cut is scored), then each method samples the same prompt many
times through the real loop, with a seed per run and without seeds (as users run it), and a
chi-square goodness-of-fit test compares the completions with it. Drafting is forced where a
CPU would decline it (a cost curve under which drafting pays), and the draft model runs with a
`--spec-draft-p-min` cut: the paths where a drafter could bias the output.

The methods whose drafts come from an algorithm (plain decoding, the draft model and its p-min
cut, PEARL, the trie, n-grams, auto) sample tiny synthetic models (tests/synthetic_tiny.py: a
designed bigram core under random layers, run by llama.cpp, a few milliseconds a completion);
the heads shipped for SmolLM2 (Medusa, EAGLE, MTP, EAGLE-3) sample SmolLM2 itself. Every
completion keeps the prompt's KV cache (reuse, as a conversation does): it reads the prompt's
last token and its own few tokens, not the whole prompt again.

Seeded runs use fixed seeds, so their verdicts do not vary between runs; unseeded runs are
judged at alpha = 1e-4. Every method's test also checks that it drafted, and that the target
kept some drafted tokens and rejected others (a drafter that declines turns its test into plain
sampling, which passes). Where a sample test is weak, the exact check is not: real verification
steps (the draft, the target's rows, the draft's distributions) captured from each method's runs,
and the verifier's output law on each computed by enumerating its random draws
(tests/verifier_law.py), against the target's rows.
"""

from collections import Counter
from dataclasses import replace

import numpy as np
import pytest
from scipy.stats import chisquare

import verifier_law
from verifier_law import PLAIN, Step, kept_by_own_probability, logits_of
from edgespec.costmodel import flat
from edgespec.draft import Draft
from edgespec.drafters.draft_model import DraftModelDrafter
from edgespec.engine import Engine, EngineConfig
from edgespec.sampling import SamplingConfig, warp
from edgespec.schedulers import pearl as pearl_scheduler
from edgespec.schedulers import sequential

L = 3  # tokens per completion: the first comes from the prefill, the others from drafted steps
# Sized by the power the test needs, and no smaller: the textbook bug (a drafted token kept with
# its own probability p, the rejected case sampled from p again instead of the residual) moves a
# 0.65/0.32/0.03 position to 0.88/0.11/0.01 (w^2 = 0.23) under a drafter of the likeliest token.
# On the tiny models (first token 0.69/0.25/0.06, second 0.61/0.36/0.03), 8 pooled outcomes at
# ALPHA, 150 completions catch the planted bug with probability 0.997 (draft model), 0.997
# (PEARL), 0.978 (lookahead), 0.999 (n-gram), 0.967 (auto); 100 would catch it 0.75-0.91 of the
# time, 75 only 0.49-0.70. The end-token prompt (7 pooled outcomes) caught it 0.46 (draft) and
# 0.63 (PEARL) of the time by itself (as a first turn), and the p-min twin (q = p, where this bug
# moves least: 0.05) is there for a cut on the drawn token's own probability, which it catches
# with probability 0.996.
# SmolLM2's heads draft trees that often hold the target's other likely tokens as well, where the
# bug moves little: with trees of up to 8 rows, any number of leaves, and 150 completions it was
# caught with probability about 0.6-0.8 (medusa), 0.94-0.99 (eagle), 0.56-0.6 (eagle3), 0.01
# (mtp). So the heads draft trees of at most HEAD_LEAVES leaves, and each samples N_OF[method]
# completions, the fewest that catch the bug with probability >= 0.98: medusa 0.990 at 225
# (0.84 at 150), eagle3 0.986 at 225 (0.81 at 150), mtp 0.992 at 200 (0.93 at 150), eagle 0.991
# at 150. Every figure here measured by tests/power_check.py (the bug planted in edgespec.verify,
# 400 buggy completions per method, the chi-square noncentrality over the test's pooled cells less
# its sampling bias, scipy.stats.ncx2; `python -m pytest tests/power_check.py -s`). The exact
# check below does not depend on power: with the bug planted it fails for every method.
# A completion costs 2-20 ms on the tiny models (the prompt's KV cache kept), 45-70 ms with
# SmolLM2's heads.
N = 150  # completions per method and seeding
N_OF = {"medusa": 225, "eagle3": 225, "mtp": 200, "eagle": 150}  # the heads' (trees of at most HEAD_LEAVES leaves)
HEAD_LEAVES = 2
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


def completions(make, seeded: bool, n: int = N) -> list[tuple]:
    """n completions; `make(cfg)` starts one generation."""
    out = []
    for i in range(n):
        cfg = SamplingConfig(**CFG, seed=1000 + i if seeded else None)
        out.append(tuple(make(cfg).run().tokens))
    return out


class Verdicts:
    """Every verification step of the generations run while installed (the sequential loop's
    `verify_step`, PEARL's rejection rule), as the scheduler ran it: drafted nodes, kept nodes, and
    whether drafted tokens were rejected (the walk stopped where the draft had children). With
    `capture`, each step with a draft is kept for the exact check (`Step`), up to `capture` of them."""

    def __init__(self, monkeypatch, capture: int = 0):
        self.steps = self.drafted = self.kept = self.rejected = 0
        self.captured: list[Step] = []
        self.capture = capture
        step_fn, chain_fn = sequential.verify_step, pearl_scheduler.verify_rejection_chain

        def verify_step(draft, logits_at, cfg, rng, shaper=None):
            out = step_fn(draft, logits_at, cfg, rng, shaper)
            self._saw(draft, out, True)
            if draft.tokens and shaper is None and len(self.captured) < self.capture:
                self.captured.append(Step.of(draft, lambda n: warp(logits_at(n), cfg),
                                             lambda d, probs, rng: step_fn(d, logits_of(probs), PLAIN, rng)))
            return out

        def verify_rejection_chain(draft, target_probs, rng, bonus=True):
            out = chain_fn(draft, target_probs, rng, bonus)
            self._saw(draft, out, bonus)
            if draft.tokens and len(self.captured) < self.capture:
                self.captured.append(Step.of(draft, target_probs, lambda d, probs, rng: chain_fn(d, probs, rng, bonus)))
            return out

        monkeypatch.setattr(sequential, "verify_step", verify_step)
        monkeypatch.setattr(pearl_scheduler, "verify_rejection_chain", verify_rejection_chain)

    def _saw(self, draft: Draft, out, bonus: bool) -> None:
        accepted, nxt = out
        self.steps += 1
        if not draft.tokens:
            return
        self.drafted += len(draft.tokens)
        self.kept += len(accepted)
        at = accepted[-1] if accepted else -1
        self.rejected += nxt is not None and at in draft.children()

    def assert_drafted(self, what: str, rejects: bool = True) -> None:
        """Drafts were verified, some of their tokens kept and (`rejects`) some rejected."""
        assert self.drafted > 0, f"{what}: nothing drafted in {self.steps} steps (the test would be plain sampling)"
        assert self.kept > 0 and (self.rejected > 0 or not rejects), (
            f"{what}: {self.drafted} drafted, {self.kept} kept, {self.rejected} steps with drafted tokens rejected")


class Leaves:
    """A drafter whose trees have at most `n` leaves (the step's branches capped)."""

    def __init__(self, inner, n: int):
        self.inner, self.n = inner, n

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, context, budget):
        return self.inner.propose(context, replace(budget, max_branches=min(budget.max_branches, self.n)))


def forced(eng, make_drafter, prompt: list[int] | None = None):
    """Generations under a cost curve on which drafting pays (a GPU-like machine), each keeping
    the prompt's KV cache from the one before."""
    toks = eng.prompt_tokens(PROMPT, raw=True) if prompt is None else prompt

    def make(cfg):
        return eng.generate(toks, L, cfg, make_drafter(cfg), reuse=True)
    return make


def pearl(eng, prompt: list[int] | None = None):
    toks = eng.prompt_tokens(PROMPT, raw=True) if prompt is None else prompt
    return lambda cfg: eng.start(toks, L, cfg, "pearl", reuse=True)


# What a verification costs under the tests' cost curve: far more than any drafting time, so that
# every drafter drafts whatever this machine's speed (the tests must not depend on it).
VERIFY_S = 1.0


def _flat(eng, rows: int | None = None):
    """`eng` with a flat cost curve, so that every drafter drafts (restored after): batches of
    up to `rows` rows (default: as many as the kernels keep exact)."""
    saved = eng.cost
    eng.cost = flat(VERIFY_S, rows or saved.max_exact_rows)
    yield eng
    eng.cost = saved


@pytest.fixture(scope="module")
def tiny(tiny_pair):
    """The tiny pair (a target and its draft model), drafting forced."""
    yield from _flat(tiny_pair)


@pytest.fixture(scope="module")
def gpu_like(smol):
    """SmolLM2 (Q4_0), drafting forced: for the heads shipped for it. Trees of up to 8 rows: a
    completion of L = 3 tokens keeps at most 2 drafted ones, and a 32-row tree costs 1.6x the
    time per completion (medusa on the Q8_0 file: 134 against 81 ms) for nodes no completion
    reaches."""
    yield from _flat(smol, 8)


@pytest.fixture(scope="module")
def twin(tiny_models):
    """The tiny target as its own draft model (q = p): where a biased draft length shows the most."""
    target, _ = tiny_models
    eng = Engine(EngineConfig(model=str(target), draft=str(target), n_ctx=512, threads=2))
    eng.cost = flat(VERIFY_S, eng.cost.max_exact_rows)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def expected_of():
    """The exact distribution of PROMPT's completions on an engine's target (computed once)."""
    done = {}

    def get(eng):
        if id(eng) not in done:
            done[id(eng)] = exact_distribution(eng, eng.prompt_tokens(PROMPT, raw=True), SamplingConfig(**CFG))
        return done[id(eng)]
    return get


def p_min_drafter(eng):
    """The draft model with a --spec-draft-p-min cut of 0.5 (the target as its draft): at the
    second token (after " blue" or " yellow") the likeliest of the top three (".", p 0.77-0.80)
    passes it and the others ("," 0.15-0.19, " and" 0.03-0.04) do not, so a cut on the drawn
    token's probability instead of the top one's would keep only "."."""
    return lambda cfg: DraftModelDrafter(eng.draft_model, eng.draft_kv, 8, 0, 0.5, cfg.seed,
                                         t_token=eng.draft_cost.t(1))


# method: (the engine fixture it samples, the generations it starts)
METHODS = {
    "none": ("tiny", lambda eng: forced(eng, lambda cfg: eng.make_drafter("none"))),
    "draft-p-min": ("twin", lambda eng: forced(eng, p_min_drafter(eng))),
    "draft": ("tiny", lambda eng: forced(eng, lambda cfg: eng.make_drafter("draft", cfg.seed))),
    "auto": ("tiny", lambda eng: forced(eng, lambda cfg: eng.make_drafter("auto", cfg.seed))),
    "lookahead": ("tiny", lambda eng: forced(eng, lambda cfg: eng.make_drafter("lookahead"))),
    "ngram": ("tiny", lambda eng: forced(eng, lambda cfg: eng.make_drafter("ngram"))),
    "pearl": ("tiny", pearl),
    # the heads shipped for SmolLM2 (trees drafted from the target's hidden states), trees of at
    # most HEAD_LEAVES leaves
    "medusa": ("gpu_like", lambda eng: forced(eng, lambda cfg: Leaves(eng.make_drafter("medusa"), HEAD_LEAVES))),
    "eagle": ("gpu_like", lambda eng: forced(eng, lambda cfg: Leaves(eng.make_drafter("eagle"), HEAD_LEAVES))),
    "mtp": ("gpu_like", lambda eng: forced(eng, lambda cfg: Leaves(eng.make_drafter("mtp"), HEAD_LEAVES))),
    "eagle3": ("gpu_like",  # llama.cpp's graph
               lambda eng: forced(eng, lambda cfg: Leaves(eng.make_drafter("eagle3"), HEAD_LEAVES))),
}


@pytest.mark.slow
@pytest.mark.parametrize("seeded", [True, False], ids=["seeded", "unseeded"])
@pytest.mark.parametrize("method", list(METHODS))
def test_sampled_output_is_the_target_distribution(request, monkeypatch, expected_of, method, seeded):
    where, make = METHODS[method]
    eng = request.getfixturevalue(where)
    # the p-min cut's twin has the tiny target for its target: the same distribution
    expected = expected_of(request.getfixturevalue("tiny") if where == "twin" else eng)
    assert 0.999 < sum(expected.values()) < 1.001
    assert len(expected) >= 6 and max(expected.values()) < 0.8, "the test needs a distribution to compare"
    n = N_OF.get(method, N)
    seen = Verdicts(monkeypatch)
    samples = completions(make(eng), seeded, n)
    if method == "none":
        assert seen.drafted == 0
    else:  # the twin (q = p) never rejects
        seen.assert_drafted(method, rejects=where != "twin")
    p = gof(samples, expected)
    assert p > ALPHA, f"{method} ({'seeded' if seeded else 'unseeded'}): chi-square p = {p:.3g} over {n} completions"


EXACT_STEPS = 12  # captured steps per method


@pytest.mark.parametrize("method", [m for m in METHODS if m != "none"])
def test_the_verifiers_law_on_captured_steps_is_the_targets(request, monkeypatch, method):
    """The exact check: the first EXACT_STEPS verifications with a draft in seeded runs of the
    method, each step's output law computed by enumerating the verifier's draws: given what it
    emitted so far, its next token follows the target's row there, to rounding."""
    where, make = METHODS[method]
    eng = request.getfixturevalue(where)
    seen = Verdicts(monkeypatch, capture=EXACT_STEPS)
    start = make(eng)
    for i in range(200):
        start(SamplingConfig(**CFG, seed=5000 + i)).run()
        if len(seen.captured) >= EXACT_STEPS:
            break
    assert len(seen.captured) >= EXACT_STEPS, f"{method}: {len(seen.captured)} steps with a draft in 200 runs"
    assert any(s.informative() for s in seen.captured), f"{method}: no captured step the textbook bug would change"
    for k, st in enumerate(seen.captured):
        for law, rows in st.laws():
            err = verifier_law.conditional_error(law, rows)
            assert err < 1e-9, (f"{method}: captured step {k} ({len(st.draft.tokens)} drafted): off the target's "
                                f"law by {err:.3g}")


def _toy_step(chain: bool) -> Step:
    """A 2-level tree (or a chain with draft distributions) over 4 tokens, rows chosen by hand."""
    rows = {-1: np.array([0.5, 0.3, 0.2, 0.0]), 0: np.array([0.1, 0.6, 0.3, 0.0]),
            1: np.array([0.0, 0.25, 0.25, 0.5]), 2: np.array([0.4, 0.4, 0.1, 0.1])}
    from edgespec import verify

    if chain:
        q = [np.array([0.7, 0.1, 0.2, 0.0]), np.array([0.1, 0.1, 0.8, 0.0]), np.array([0.3, 0.3, 0.2, 0.2])]
        d = Draft.chain([0, 2, 3], q)
        rows = {-1: rows[-1], 0: rows[0], 1: rows[1], 2: rows[2]}
        return Step(d, rows, lambda d, probs, rng: verify.verify_rejection_chain(d, probs, rng))
    d = Draft([0, 1, 1], [-1, 0, -1])
    return Step(d, rows, lambda d, probs, rng: verify.verify_step(d, logits_of(probs), PLAIN, rng))


@pytest.mark.parametrize("chain", [False, True], ids=["tree", "chain"])
def test_the_exact_check_finds_the_textbook_bug(monkeypatch, chain):
    """The enumeration itself, on a toy step: edgespec's verifier is exact, and the textbook bug
    (a drafted token kept with its own probability, else a draw from p) is off by far more."""
    from edgespec import verify

    st = _toy_step(chain)

    def worst() -> float:
        return max(verifier_law.conditional_error(law, rows) for law, rows in st.laws())

    assert worst() < 1e-12

    monkeypatch.setattr(verify, "verify_sampled_tree", kept_by_own_probability)
    monkeypatch.setattr(verify, "verify_rejection_chain", kept_by_own_probability)
    assert worst() > 0.01


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
# which must leave the sampled output the target's. The question was asked and answered ("Yes!")
# once before in the conversation, so the trie holds an answer up to its end: after "Yes" it
# drafts "!" (the target ends there 0.55 of the time, goes on with "!" 0.4). A first turn gives
# lookahead nothing to draft (0 drafts in 220 steps, measured).
EOG_PROMPT = "Reply with the single word: yes"
EOG_MESSAGES = [{"role": "user", "content": EOG_PROMPT}, {"role": "assistant", "content": "Yes!"},
                {"role": "user", "content": EOG_PROMPT}]
EOG_METHODS = {
    "draft": lambda eng, toks: forced(eng, lambda cfg: eng.make_drafter("draft", cfg.seed), toks),
    "lookahead": lambda eng, toks: forced(eng, lambda cfg: eng.make_drafter("lookahead"), toks),
    "pearl": pearl,
}


@pytest.mark.slow
@pytest.mark.parametrize("seeded", [True, False], ids=["seeded", "unseeded"])
@pytest.mark.parametrize("method", list(EOG_METHODS))
def test_sampled_output_with_drafts_ending_at_the_end_token(tiny, monkeypatch, method, seeded):
    toks = tiny.prompt_tokens(messages=EOG_MESSAGES)
    expected = exact_distribution(tiny, toks, SamplingConfig(**CFG))
    assert sum(p for k, p in expected.items() if len(k) < L) > 0.1, "the test needs answers that end early"
    seen = Verdicts(monkeypatch)
    samples = completions(EOG_METHODS[method](tiny, toks), seeded)
    seen.assert_drafted(method)
    assert any(len(s) < L for s in samples)
    p = gof(samples, expected)
    assert p > ALPHA, f"{method} ({'seeded' if seeded else 'unseeded'}): chi-square p = {p:.3g} over {len(samples)} completions"


@pytest.mark.slow
@pytest.mark.parametrize("seeded", [True, False], ids=["seeded", "unseeded"])
def test_sampled_output_with_the_loss_bound_deciding(tiny, monkeypatch, expected_of, seeded):
    """On a CPU's curve (a second row costs 1.12 steps) the sequential loop's per-reply ledger
    (CostModel.best_size's `slack`) decides steps: a one-token prompt lookup priced at 0.22 pays on
    average, goes at a completion's first drafted step, and at the next only if that one was kept
    (after a miss the reply is behind and 0.22 no longer covers the risk). Which steps draft thus
    depends on what was sampled before; the completions are still the target's distribution, and the
    bound is seen to change sizes (else this would test nothing new)."""
    import math

    from edgespec.costmodel import KS, CostModel
    from edgespec.drafters.base import Candidates, NullDrafter

    class Lookup(NullDrafter):
        name = "lookup"

        def propose(self, context, budget):
            for i in range(len(context) - 2, -1, -1):  # what followed the last token before
                if context[i] == context[-1]:
                    tok = context[i + 1]
                    return Candidates([0.22], lambda k: Draft.chain([tok]) if k else Draft())
            return Draft()

    expected = expected_of(tiny)
    orig = CostModel.best_size
    decided = [0]

    def counting(self, probs, *a, slack=math.inf, **k):
        n = orig(self, probs, *a, slack=slack, **k)
        decided[0] += n != orig(self, probs, *a, **k)
        return n

    monkeypatch.setattr(CostModel, "best_size", counting)
    saved = tiny.cost
    tiny.cost = CostModel(KS, tuple(VERIFY_S * (1 + 0.12 * (k - 1)) for k in KS), online=False,
                          max_exact_rows=saved.max_exact_rows)
    try:
        seen = Verdicts(monkeypatch)
        # 300: the textbook bug (only its rejected case differs for a one-token draft: a draw from
        # p, not the residual) gave p = 4e-5 and 1e-5 at 150, 1e-13 and 9e-15 at 300
        samples = completions(forced(tiny, lambda cfg: Lookup()), seeded, 2 * N)
    finally:
        tiny.cost = saved
    seen.assert_drafted("a lookup under the loss bound")
    assert decided[0] > 0, "the loss bound changed no draft's size"
    p = gof(samples, expected)
    assert p > ALPHA, f"a lookup under the loss bound ({'seeded' if seeded else 'unseeded'}): chi-square p = {p:.3g}"
