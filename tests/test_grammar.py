"""Structured output under speculation, exact: a grammar (GBNF, a JSON schema, any JSON object)
masks the target's rows through llama.cpp's grammar sampler, along each draft path, so that
greedy output equals plain constrained decoding token for token for every drafter, and sampled
output follows the constrained distribution (chi-square against the distribution computed
from the target, the mask and the warp directly). Penalties, logit bias and logprobs ride the
same shaped rows."""

import json
from collections import Counter

import numpy as np
import pytest

from conftest import generate
from edgespec.costmodel import flat
from edgespec.drafters.draft_model import DraftModelDrafter
from edgespec.rows import Grammar, GrammarError, Shaper, json_object_grammar, json_schema_grammar
from edgespec.sampling import SamplingConfig, make_sampling, warp
from test_distribution import ALPHA, gof

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}}}
ITEMS = {"type": "object", "required": ["items"],
         "properties": {"items": {"type": "array", "items": {"type": "string"}, "maxItems": 6}}}
COLOURS = 'root ::= item (", " item){0,5} "."\nitem ::= "red" | "green" | "blue"\n'

CASES = {  # name: (prompt, grammar, check of the text)
    "person": ("Extract the person as JSON with name, age and city: Alice Smith is 34 years old and lives in Paris.",
               json_schema_grammar(PERSON), lambda t: _valid_person(json.loads(t))),
    "items": ("List the fruits in this sentence as JSON {\"items\": [...]}: I bought apples, pears, plums and "
              "apples again.", json_schema_grammar(ITEMS),
              lambda t: isinstance(json.loads(t)["items"], list)),
    "object": ("Describe a cat as a JSON object with a few fields.", json_object_grammar(),
               lambda t: isinstance(json.loads(t), dict)),
    "colours": ("Repeat exactly: red, green, blue, red, green, blue, red, green, blue.", COLOURS,
                lambda t: t.endswith(".") and set(t[:-1].split(", ")) <= {"red", "green", "blue"}),
}


def _valid_person(d) -> bool:
    return (set(d) == {"name", "age", "city"} and isinstance(d["name"], str) and isinstance(d["age"], int)
            and isinstance(d["city"], str))


def forced_draft_model(eng, seed=None):
    """The draft model drafting 4 tokens every step (--spec-draft-n-min 4), drafts unconstrained."""
    return DraftModelDrafter(eng.draft_model, eng.draft_kv, 4, 4, 0.0, seed, t_token=eng.draft_cost.t(1),
                             is_stop=eng.target.is_eog)


def _greedy(grammar, **kw) -> SamplingConfig:
    return make_sampling(0.0, grammar=grammar, **kw)


@pytest.fixture(scope="module")
def plain_refs(smol):
    out = {}
    for name, (prompt, grammar, check) in CASES.items():
        g = generate(smol, smol.prompt_tokens(prompt), 64, "none", _greedy(grammar))
        text = smol.target.detokenize(g.tokens)
        if g.stats.finish_reason == "stop":
            assert check(text), (name, text)
        out[name] = g
    return out


@pytest.mark.parametrize("method", ["lookahead", "ngram"])
@pytest.mark.parametrize("case", list(CASES))
def test_greedy_constrained_equals_plain_constrained(smol, plain_refs, method, case):
    prompt, grammar, _ = CASES[case]
    g = generate(smol, smol.prompt_tokens(prompt), 64, method, _greedy(grammar), gpu_like=True)
    ref = plain_refs[case]
    assert g.tokens == ref.tokens, (smol.target.detokenize(g.tokens), smol.target.detokenize(ref.tokens))
    assert g.stats.finish_reason == ref.stats.finish_reason


def test_greedy_constrained_drafts_are_accepted(smol, plain_refs):
    """The structure repeats: drafts are accepted under the grammar (and the plain run ended by
    the grammar's end without spending a step on the end token)."""
    prompt, grammar, check = CASES["colours"]
    g = generate(smol, smol.prompt_tokens(prompt), 64, "lookahead", _greedy(grammar), gpu_like=True)
    assert g.stats.n_accept > 0
    assert g.stats.finish_reason == "stop" and check(smol.target.detokenize(g.tokens))


@pytest.mark.parametrize("case", ["person", "colours"])
def test_greedy_constrained_draft_model_equals_plain(smol_pair, case):
    prompt, grammar, check = CASES[case]
    toks = smol_pair.prompt_tokens(prompt)
    ref = generate(smol_pair, toks, 64, "none", _greedy(grammar))
    g = generate(smol_pair, toks, 64, sampling=_greedy(grammar), drafter=forced_draft_model(smol_pair))
    assert g.tokens == ref.tokens
    assert 0 < g.stats.n_accept < g.stats.n_drafted
    if ref.stats.finish_reason == "stop":
        assert check(smol_pair.target.detokenize(g.tokens))


def test_grammar_end_stops_without_an_end_step(smol):
    g = generate(smol, smol.prompt_tokens("Say yes."), 16, "none", _greedy('root ::= "Yes, sure."'))
    assert smol.target.detokenize(g.tokens) == "Yes, sure."
    assert g.stats.finish_reason == "stop" and g.stats.n_steps == len(g.tokens)


def test_penalties_bias_and_logprobs_equal_plain(smol):
    """Penalties count the draft path's tokens at each row; logprobs come from the verified rows,
    after every mask, equal to plain decoding's."""
    prompt = smol.prompt_tokens(CASES["colours"][0])
    ban = smol.target.tokenize(" red", add_special=False, parse_special=False)[0]
    for kw in (dict(presence_penalty=0.4, frequency_penalty=0.3), dict(logit_bias={str(ban): -100}),
               dict(logprobs=3), dict(grammar=COLOURS, logprobs=5)):
        cfg = make_sampling(0.0, **kw)
        ref = generate(smol, prompt, 40, "none", cfg)
        g = generate(smol, prompt, 40, "lookahead", cfg, gpu_like=True)
        assert g.tokens == ref.tokens, kw
        if "logit_bias" in kw:
            assert ban not in g.tokens
        if "logprobs" in kw:
            assert len(g.logprobs) == len(g.tokens)
            assert [t for t, _, _ in g.logprobs] == g.tokens
            assert g.logprobs == ref.logprobs
            for tok, lp, top in g.logprobs:
                assert len(top) == kw["logprobs"] or "grammar" in kw
                assert top[0][0] == tok and top[0][1] == lp  # greedy: the chosen token is the top one
                assert lp <= 0.0


def test_a_forbidden_draft_is_rejected(smol):
    """A drafter proposing what the grammar forbids: nothing of it is kept, the output is plain's."""
    from edgespec.draft import Draft
    from edgespec.drafters.base import NullDrafter

    bad = smol.target.tokenize(" purple and orange", add_special=False, parse_special=False)

    class Hostile(NullDrafter):
        name = "hostile"

        def propose(self, context, budget):
            return Draft.chain(bad[: budget.max_nodes])

    prompt, grammar, _ = CASES["colours"]
    toks = smol.prompt_tokens(prompt)
    ref = generate(smol, toks, 24, "none", _greedy(grammar))
    g = generate(smol, toks, 24, sampling=_greedy(grammar), drafter=Hostile(), gpu_like=True)
    assert g.tokens == ref.tokens and g.stats.n_accept == 0 and g.stats.n_drafted > 0


def test_bad_grammars_and_schemas_are_clear_errors(smol):
    with pytest.raises(GrammarError, match="does not parse"):
        Grammar(smol.target, "root ::= (")
    with pytest.raises(GrammarError, match="JSON schema"):
        json_schema_grammar({"$ref": "http://example.com/x"})


def test_masking_cost_is_bounded(smol):
    """The greedy fast path (is the argmax allowed?) costs far less than a full mask."""
    import time

    g = Grammar(smol.target, json_object_grammar())
    t0 = time.perf_counter()
    for _ in range(5):
        g.allowed()
    full = (time.perf_counter() - t0) / 5
    t0 = time.perf_counter()
    for t in range(200):
        g.allows(t)
    one = (time.perf_counter() - t0) / 200
    assert g.allows(smol.target.tokenize("{", add_special=False, parse_special=False)[0])
    assert one < full / 20, (one, full)


# -- sampled output follows the constrained distribution -----------------------------------

L = 3
N = 150
CFG = dict(temp=2.0, top_k=5, top_p=1.0, min_p=0.0)  # flat enough for a handful of outcomes
PICK = 'root ::= " " ("red" | "green" | "blue" | "yellow" | "purple") "."\n'
S_PROMPT = "red, green, blue. red, green, yellow. red, green,"


def constrained_distribution(eng, prompt, grammar, cfg):
    """P(completion) from the target's rows, masked by the grammar in full and warped; a
    completion ends at an end token or where the grammar allows nothing else."""
    out = {}
    shaper_eog = Shaper(eng.target, cfg).eog

    def finished(g):
        ok = np.flatnonzero(g.allowed())
        return len(ok) > 0 and all(eng.target.is_eog(int(t)) for t in ok)

    def walk(prefix, prob, g):
        eng.kv.reset()
        row = eng.kv.extend(prompt + list(prefix))
        x = np.where(g.allowed(), eng.ctx.logits(row), -np.inf)
        p = warp(x, cfg)
        for y in np.flatnonzero(p):
            y, q = int(y), prob * float(p[y])
            if eng.target.is_eog(y):
                out[prefix] = out.get(prefix, 0.0) + q
                continue
            h = g.clone()
            h.accept(y)
            if finished(h) or len(prefix) + 1 == L:
                out[prefix + (y,)] = out.get(prefix + (y,), 0.0) + q
            else:
                walk(prefix + (y,), q, h)
            h.close()

    walk((), 1.0, Grammar(eng.target, grammar))
    eng.kv.reset()
    assert shaper_eog >= 0
    return out


@pytest.fixture(scope="module")
def forced_pair(tiny_pair):
    """The tiny pair (tests/synthetic_tiny.py: the colours are its likeliest tokens after a
    comma), drafting forced."""
    saved = tiny_pair.cost
    tiny_pair.cost = flat(0.05, saved.max_exact_rows)
    yield tiny_pair
    tiny_pair.cost = saved


@pytest.mark.slow
@pytest.mark.parametrize("method", ["none", "lookahead", "ngram", "draft"])
def test_sampled_constrained_output_is_the_constrained_distribution(forced_pair, method):
    eng = forced_pair
    toks = eng.prompt_tokens(S_PROMPT, raw=True)
    expected = constrained_distribution(eng, toks, PICK, make_sampling(**CFG, grammar=PICK))
    assert 0.999 < sum(expected.values()) < 1.001
    assert len(expected) >= 3 and max(expected.values()) < 0.9, expected
    samples = []
    for i in range(N):
        cfg = make_sampling(**CFG, seed=2000 + i, grammar=PICK)
        d = forced_draft_model(eng, cfg.seed) if method == "draft" else eng.make_drafter(method, cfg.seed)
        g = eng.generate(toks, L, cfg, d, reuse=True).run()  # the prompt's KV cache kept
        samples.append(tuple(g.tokens))
    p = gof(samples, expected)
    assert p > ALPHA, f"{method}: chi-square p = {p:.3g} over {N} completions ({Counter(samples).most_common(4)})"


def test_cli_grammar_file_and_json_schema(tmp_path, capsys):
    from edgespec.frontends.cli import main

    assert main(["run", "--json-schema", "no-such-file.json", "-p", "x"]) != 0
    assert "--json-schema no-such-file.json" in capsys.readouterr().err
    assert main(["run", "--json-schema", '{"type": "object", "properties": {"a": {"$ref": "https://x/y"}}}',
                 "-p", "x"]) != 0
    assert "JSON schema" in capsys.readouterr().err
    g = tmp_path / "yes.gbnf"
    g.write_text('root ::= "Yes, " ("red" | "blue") "."\n')
    assert main(["run", "-m", "smollm2-135m-instruct:q4_0", "-c", "512", "-t", "2", "--spec", "lookahead",
                 "--grammar-file", str(g), "-p", "Pick a colour.", "-n", "16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["text"] in ("Yes, red.", "Yes, blue.") and out["stats"]["finish_reason"] == "stop"
