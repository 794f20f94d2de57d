"""MTP drafting on tiny synthetic mimo2 models (tests/synthetic_mtp.py): the MTP context loads,
greedy output equals plain decoding, the target's and the MTP's KV caches stay in step across
rejections, the MTP's logits equal a from-scratch computation, and a model built to agree is
accepted every time. Everything runs on one thread in well under a minute."""

from __future__ import annotations

import re
import subprocess
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from rpc_tools import require
from synthetic_mtp import agree_next, write_mimo2_mtp

from edgespec import llama_ext, methods
from edgespec.costmodel import flat
from edgespec.drafters import mtp
from edgespec.engine import Engine, EngineConfig
from edgespec.errors import EdgespecError
from edgespec.llama import Context, ContextConfig
from edgespec.sampling import SamplingConfig
from edgespec.schedulers.sequential import Generation

GREEDY = SamplingConfig(temp=0.0)

@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("mtp")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EDGESPEC_CACHE", str(d / "cache"))  # cost curves of throwaway files stay here
        yield {"random": write_mimo2_mtp(d / "random.gguf", seed=0),
               "agree": write_mimo2_mtp(d / "agree.gguf", agree=True),
               "plain": write_mimo2_mtp(d / "no-nextn.gguf", n_nextn=0)}


def _close(eng: Engine) -> None:
    eng.close()  # the MTP context (a side context) first, then the model it runs on


def _engine(path: Path, **kw) -> Engine:
    cfg = dict(model=str(path), n_ctx=512, threads=1, draft_n_min=1, max_branches=1)
    cfg.update(kw)
    eng = Engine(EngineConfig(**cfg))
    # f32 weights: llama.cpp's batched rows differ from single rows in the last bits, so the
    # measured curve allows one row; a flat curve lets every step verify its draft.
    eng.cost = flat(0.05)
    return eng


@pytest.fixture(scope="module")
def rand(models):
    eng = _engine(models["random"])
    yield eng
    _close(eng)


@pytest.fixture(scope="module")
def agree(models):
    eng = _engine(models["agree"])
    yield eng
    _close(eng)


class _Driver:
    """The drafter as the scheduler sees it, recording the MTP's seed-row logits of every
    proposal (with n_max=1 the seed row is the MTP context's last output)."""

    def __init__(self, d: mtp.MtpDrafter):
        self.d = d
        self.name = d.name
        self.reads, self.taps = d.reads, d.taps
        self.seed_logits: list[tuple[list[int], np.ndarray]] = []
        self.observe = d.observe

    def begin(self, prompt):
        self.d.begin(prompt)

    def propose(self, context, budget):
        draft = self.d.propose(context, budget)
        if self.d.n_max == 1 and draft.tokens:
            self.seed_logits.append((list(context), self.d.m.ctx.logits(-1).copy()))
        return draft

    def accept(self, draft, accepted, committed):
        self.d.accept(draft, accepted, committed)

    def end(self):
        self.d.end()


def _generation(eng: Engine, prompt: list[int], n: int, n_max: int = 1) -> tuple[Generation, _Driver]:
    drv = _Driver(mtp.build(eng, n_max=n_max))
    return Generation(eng, prompt, n, GREEDY, drafter=drv), drv


def _prompt(n: int, seed: int = 1) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(0, 256, n)]


def _run_checked(eng: Engine, gen: Generation, drv: _Driver) -> Generation:
    """Run `gen`, checking after every step that the MTP cache holds exactly the committed
    tokens up to the last proposal's context (draft rows dropped), in step with the target's."""
    m, kv = drv.d.m, eng.kv
    for ev in gen:
        assert kv.ctx.mem_seq_pos_max(0) == kv.n - 1
        assert m.ctx.mem_seq_pos_max(0) == len(m.tokens) - 1  # no chained draft rows left behind
        assert m.tokens == kv.tokens[: len(m.tokens)]
        if gen.stats.finish_reason == "interrupted":  # not the last, clipped, step
            # the target also holds this step's accepted tokens, whose MTP rows wait for the
            # next proposal (their h came with this verification)
            assert kv.n - len(m.tokens) == ev.n_accept
    assert drv.d.n_missing == 0
    return gen


def reference_seed_logits(eng: Engine, tokens: list[int]) -> np.ndarray:
    """The MTP's logits after `tokens`, from scratch: the target decodes tokens[:-1] in one batch
    for its nextn rows h, then a fresh MTP context decodes (tokens[k], h[k-1]) for every k."""
    model = eng.target
    t = Context(model, ContextConfig(eng.ctx.n_ctx, 512, 1, 1, eng.cfg.kv_type))
    m = mtp.MtpContext(model, eng.ctx, eng.cfg.threads, eng.cfg.kv_type)
    try:
        llama_ext.fn("set_embeddings_nextn")(t.ptr, True, False)
        n = len(tokens) - 1
        t.decode(tokens[:n], list(range(n)), None, [False] * (n - 1) + [True])
        h = np.ctypeslib.as_array(llama_ext.fn("get_embeddings_nextn")(t.ptr), shape=(n, m.n_embd)).copy()
        zero = np.zeros(m.n_embd, np.float32)
        rows = [(tokens[k], k, h[k - 1] if k else zero) for k in range(len(tokens))]
        step = m.ctx.n_batch
        for s in range(0, len(rows), step):
            m.decode(rows[s : s + step], out_last=s + step >= len(rows))
        return m.ctx.logits(-1).copy()
    finally:
        m.close()
        t.close()


def test_mtp_context_loads(rand):
    assert rand.target.arch == "mimo2" and rand.target.n_layer == 2 and rand.target.n_layer_nextn == 1
    d = mtp.build(rand)
    try:
        assert d.m.ctx.ptr and d.m.n_embd == rand.target.n_embd
        assert mtp.build(rand).m is d.m  # one MTP context per target context
    finally:
        d.end()


def test_no_nextn_layers_is_one_clear_line(models):
    eng = _engine(models["plain"])
    try:
        with pytest.raises(EdgespecError, match=r"has no MTP \(nextn\) layers.*--heads"):
            mtp.build(eng)
    finally:
        _close(eng)


@pytest.mark.parametrize("n_max", [1, 3])
def test_greedy_equals_plain_across_rejections(rand, n_max):
    prompt = _prompt(20)
    plain = rand.start(prompt, 48, GREEDY, "none").run()
    saved = rand.cfg
    rand.cfg = replace(saved, draft_n_min=n_max)  # --spec-draft-n-min: full chains even when rejected
    try:
        gen, drv = _generation(rand, prompt, 48, n_max)
        _run_checked(rand, gen, drv)
    finally:
        rand.cfg = saved
    assert gen.tokens == plain.tokens
    st = gen.stats
    assert st.n_drafted >= n_max * (st.n_steps - 1) // 2 and st.n_drafted > st.n_accept  # rejections happened
    if n_max > 1:
        assert len(st.drafted_at) >= n_max  # chains of n_max were verified


def test_mtp_logits_equal_a_from_scratch_computation(rand):
    gen, drv = _generation(rand, _prompt(24, seed=2), 24)
    _run_checked(rand, gen, drv)
    assert len(drv.seed_logits) >= 5
    for ctx_tokens, got in drv.seed_logits[:: max(1, len(drv.seed_logits) // 5)]:
        want = reference_seed_logits(rand, ctx_tokens)
        np.testing.assert_allclose(got, want, atol=2e-3, rtol=0)


def test_prompt_in_several_chunks(models):
    eng = _engine(models["random"], n_batch=16)
    try:
        prompt = _prompt(40, seed=3)  # three chunks of the target's (and the MTP's) batch
        plain = eng.start(prompt, 16, GREEDY, "none").run()
        gen, drv = _generation(eng, prompt, 16)
        _run_checked(eng, gen, drv)
        assert gen.tokens == plain.tokens
        ctx_tokens, got = drv.seed_logits[0]
        np.testing.assert_allclose(got, reference_seed_logits(eng, ctx_tokens), atol=2e-3, rtol=0)
    finally:
        _close(eng)


@pytest.mark.parametrize("n_max", [1, 3])
def test_agreeing_model_is_always_accepted(agree, n_max):
    prompt = _prompt(12, seed=4)
    plain = agree.start(prompt, 40, GREEDY, "none").run()
    gen, drv = _generation(agree, prompt, 40, n_max)
    _run_checked(agree, gen, drv)
    assert gen.tokens == plain.tokens
    want = [agree_next(prompt[-1])]
    while len(want) < 40:
        want.append(agree_next(want[-1]))
    assert gen.tokens == want
    st = gen.stats
    assert st.n_drafted > 0 and st.n_accept == st.n_drafted  # every drafted token was used
    # a step commits its accepted drafts plus the target's token: n_max + 1 per step
    assert st.n_steps <= 1 + -(-40 // (n_max + 1)) + 1


def test_sampled_run_uses_agreeing_drafts(agree):
    """Under sampling the verifier samples the target and follows the chain: the counting
    model's target is all but certain, so its drafts are still all used."""
    prompt = _prompt(8, seed=5)
    drv = _Driver(mtp.build(agree, n_max=2))
    gen = _run_checked(agree, Generation(agree, prompt, 30, SamplingConfig(temp=0.7, seed=3), drafter=drv), drv)
    want = [agree_next(prompt[-1])]
    while len(want) < 30:
        want.append(agree_next(want[-1]))
    assert gen.tokens == want
    assert gen.stats.n_drafted > 0 and gen.stats.n_accept == gen.stats.n_drafted


def test_spec_mtp_through_the_registry(agree):
    """`--spec mtp` on a model with nextn layers: the same drafter, built by the method registry."""
    prompt = _prompt(10, seed=6)
    gen = agree.start(prompt, 30, GREEDY, "mtp").run()
    assert gen.drafter_name == "mtp"
    assert gen.tokens == agree.start(prompt, 30, GREEDY, "none").run().tokens
    assert gen.stats.n_drafted > 0 and gen.stats.n_accept == gen.stats.n_drafted


@pytest.mark.parametrize("which", ["random", "agree"])
def test_spec_auto_chains_the_trie_and_the_mtp(models, rand, agree, which):
    """`--spec auto` on a model with nextn layers: the trie drafts where the text repeats, the
    MTP elsewhere, and the MTP's cache follows the steps the trie drafted (the target's rows are
    reported whoever drafted). The counting model, from this prompt, writes 8, 9, ...: at 50 the
    trie finds 51 52 53 in the prompt (then 9, rejected), the MTP takes over again, and the
    output repeats itself after 64 tokens (the trie's again). Greedy output equals plain
    decoding, through the random model's rejections too."""
    eng = {"random": rand, "agree": agree}[which]
    prompt = [50, 51, 52, 53, 9, 2, 40, 7]
    gen = eng.start(prompt, 160, GREEDY, "auto")
    events = list(gen)
    assert gen.drafter_name == "lookahead+mtp" and methods.auto_members(eng) == ["lookahead", "mtp"]
    assert gen.tokens == eng.start(prompt, 160, GREEDY, "none").run().tokens
    by = {src: sum(ev.n_drafted for ev in events if ev.drafter == src) for src in ("lookahead", "mtp")}
    assert by["mtp"] > 0 and by["lookahead"] > 0
    if which == "agree":
        first = next(i for i, ev in enumerate(events) if ev.drafter == "lookahead" and ev.n_drafted)
        after = [ev for ev in events[first:] if ev.drafter == "mtp" and ev.n_drafted]
        assert after, "the MTP never drafted after the trie"
        assert all(ev.n_accept == ev.n_drafted for ev in after), "the MTP lost its place after the trie's steps"
    # without nextn layers auto is the trie alone
    plain_eng = _engine(models["plain"])
    try:
        assert plain_eng.start(prompt, 8, GREEDY, "auto").run().drafter_name == "lookahead"
    finally:
        _close(plain_eng)


@pytest.mark.parametrize("seeded", [True, False], ids=["seeded", "unseeded"])
def test_spec_auto_with_mtp_samples_the_target_distribution(rand, seeded):
    """Sampled `--spec auto` (trie and MTP chained) on the random model: the first three tokens
    follow the target's exact distribution (chi-square over 150 completions, with a seed each, and
    without seeds as users run it, judged at alpha = 1e-4), with both
    drafters drafting: the prompt holds half the vocabulary, so the trie has a continuation
    for about half the tokens drawn, and the MTP drafts after the others."""
    from test_distribution import ALPHA, CFG, L, N, exact_distribution, gof

    prompt = [int(t) for t in np.random.default_rng(3).permutation(256)[:128]]
    expected = exact_distribution(rand, prompt, SamplingConfig(**CFG))
    samples, by = [], {"lookahead": 0, "mtp": 0}
    for i in range(N):
        gen = rand.start(prompt, L, SamplingConfig(**CFG, seed=2000 + i if seeded else None), "auto")
        for ev in gen:
            by[ev.drafter] = by.get(ev.drafter, 0) + ev.n_drafted
        samples.append(tuple(gen.tokens))
    assert by["lookahead"] > 0 and by["mtp"] > 0, by
    assert gof(samples, expected) > (1e-3 if seeded else ALPHA)


# Run for the first time here (it was skipped wherever the tool was not built): llama.cpp's
# draft-mtp wrote nothing past the prompt on some sessions' agreeing model, and no stats lines on
# either model (issue 59's report); shown as xfail until that is understood, not skipped.
@pytest.mark.parametrize("which", ["random", pytest.param("agree", marks=pytest.mark.xfail(
    reason="llama.cpp's draft-mtp wrote nothing past the prompt on this session's agreeing model (issue 59)"))])
def test_same_text_as_llama_speculative_simple(models, which):
    """llama.cpp's own draft-mtp on the same file: the same greedy text. On the agreeing model it
    rejects only its first draft (it drafts from the prompt's last pair, which is not the
    target's own continuation), every later draft is accepted, as here."""
    path, n = models[which], 24
    spec_bin = require("llama-speculative-simple")  # tests/rpc_tools.py builds it; under CI a missing one fails
    # Its stats lines come last on stderr, and its log thread may drop them at exit: with this
    # llama.cpp (0.3.36's vendored copy) the draft-mtp path printed none in any of a dozen runs
    # here, while its text always came. The text is compared every time; its counts where printed.
    for _ in range(3):
        r = subprocess.run([str(spec_bin), "-m", str(path), "--spec-type", "draft-mtp", "-p", "hello world", "-n",
                            str(n), "-c", "512", "--spec-draft-n-max", "1", "--temp", "0", "-t", "1"],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        ref = {k: int(v) for k, v in re.findall(r"(n_drafted|n_accept)\s*=\s*(\d+)", r.stderr)}
        if len(ref) == 2:
            break
    eng = _engine(path)
    try:
        prompt = eng.target.tokenize("hello world")
        gen, drv = _generation(eng, prompt, n)
        _run_checked(eng, gen, drv)
        text = eng.target.detokenize(prompt) + eng.target.detokenize(gen.tokens)
        theirs, ours = r.stdout.strip(), text.strip()
        assert len(theirs) > len(eng.target.detokenize(prompt)) + 10  # the prompt and some output
        assert theirs.startswith(ours) or ours.startswith(theirs)  # it may run a few tokens past -n
        if which == "agree":
            assert gen.stats.n_accept == gen.stats.n_drafted > 0
            assert not ref or ref["n_drafted"] - ref["n_accept"] == 1
        else:
            assert gen.stats.n_accept <= 1
            assert not ref or ref["n_accept"] <= 1
    finally:
        _close(eng)
