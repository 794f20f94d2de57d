"""A conversation is read once: the KV cache keeps its longest common prefix with the next prompt.

Real models: the embedded SmolLM2 (and the smol_pair fixture for the draft model and PEARL);
random heads for Medusa and EAGLE, made as test_heads makes them.
"""

import numpy as np
import pytest

from conftest import GREEDY
from edgespec import methods
from edgespec.frontends.session import ChatSession
from edgespec.kv import common_prefix

TURNS = [
    "Write a Python function that adds two numbers.",
    "Now make it add three numbers, and repeat the first version too.",
    "Thanks. Name the function differently and show both again.",
]
N = 40  # tokens per reply: enough for drafts to be verified, short enough to keep the module quick


def chat(engine, method, turns=TURNS, reuse=True, n=N):
    """Each turn's reply and stats, and each turn's prompt tokens."""
    s = ChatSession(engine, method, GREEDY, n, reuse=reuse)
    out = []
    for text in turns:
        s.messages.append({"role": "user", "content": text})
        prompt = s.prompt_tokens()
        s.messages.pop()
        r = s.send(text)
        out.append((r, prompt))
    return out


def test_kv_keep_prefix_and_settle(smol):
    kv, ctx = smol.kv, smol.ctx
    a = smol.prompt_tokens("Count from one to twenty in words, separated by commas.")
    b = a[:-3] + [a[-1], a[-2]]
    kv.reset()
    kv.extend(a)
    assert kv.common_prefix(b) == len(a) - 3 == common_prefix(a, b)
    assert kv.keep_prefix(b) == len(a) - 3
    assert kv.tokens == a[:-3] and ctx.mem_seq_pos_max(0) == len(a) - 4
    assert kv.keep_prefix(b, limit=5) == 5 and kv.n == 5 and ctx.mem_seq_pos_max(0) == 4
    assert kv.keep_prefix([]) == 0 and kv.n == 0 and ctx.mem_seq_pos_max(0) == -1
    # settle: drop what is past the text, decode what is missing (a few rows per decode)
    kv.extend(a[:10])
    assert kv.settle(a[:7], max_rows=4) == 0 and kv.tokens == a[:7]
    assert kv.settle(a[:16], max_rows=4) == 9 and kv.tokens == a[:16] and ctx.mem_seq_pos_max(0) == 15
    # a prefix kept and the rest read gives the logits of reading it all (up to batch kernels)
    row = kv.extend(a[16:])
    kept = ctx.logits(row).copy()
    kv.reset()
    cold = ctx.logits(kv.extend(a))
    assert int(np.argmax(kept)) == int(np.argmax(cold))
    assert np.max(np.abs(kept - cold)) < 0.05
    kv.reset()


def test_turns_read_only_what_is_new(smol):
    turns = chat(smol, "none")
    (r1, p1), rest = turns[0], turns[1:]
    assert r1.stats.n_prompt_cached == 0 and r1.stats.n_prompt_eval == len(p1)
    prev_prompt, prev = p1, r1
    for r, p in rest:
        st = r.stats
        # the cache holds the last prompt and the reply but its last token; the reply text,
        # tokenized again, matches the tokens generated
        held = prev_prompt + prev.tokens[:-1]
        assert common_prefix(held, p) == len(held)
        assert st.n_prompt_cached == len(held)
        assert st.n_prompt_eval == len(p) - len(held)
        new = len(p) - len(prev_prompt) - len(prev.tokens)  # the new message and the template's markers
        assert st.n_prompt_eval == new + 1
        assert st.to_dict()["n_prompt_eval"] == st.n_prompt_eval
        prev_prompt, prev = p, r


def _same_text(engine, method, base):
    got = chat(engine, method)
    for t, ((r, _), (b, _)) in enumerate(zip(got, base)):
        assert r.tokens == b.tokens, f"{method}: turn {t + 1} differs from none"
    assert all(r.stats.n_prompt_cached > 0 for r, _ in got[1:])
    return got


@pytest.fixture(scope="module")
def plain_turns(smol):
    return chat(smol, "none")


@pytest.mark.parametrize("method", ["lookahead", "ngram", "auto"])
def test_every_turn_equals_plain_with_reuse(smol, plain_turns, method):
    _same_text(smol, method, plain_turns)


@pytest.mark.slow
def test_draft_model_and_pearl_turns_equal_plain(smol_pair):
    from edgespec.costmodel import flat

    base = chat(smol_pair, "none")
    for method in ("draft", "pearl"):
        got = _same_text(smol_pair, method, base)
    saved = smol_pair.cost
    # drafts even where this CPU's curve would not; batches of up to 8 rows (what is reused between
    # turns does not depend on the batch size, and 32-row batches only cost time)
    smol_pair.cost = flat(0.05, 8)
    try:
        got = _same_text(smol_pair, "draft", base)
    finally:
        smol_pair.cost = saved
    assert sum(r.stats.n_drafted for r, _ in got) > 0


@pytest.fixture(scope="module")
def heads_files(smol, tmp_path_factory):
    from test_heads import random_eagle, random_medusa

    tmp = tmp_path_factory.mktemp("heads_reuse")
    return {"medusa": random_medusa(tmp, smol.target), "eagle": random_eagle(tmp, smol.target)}


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_heads_turns_equal_plain(smol, plain_turns, heads_files, kind):
    """Forced drafting (a flat cost curve, at least 4 nodes a step) with random heads: the
    EAGLE head keeps its own cache of the earlier turns and reads the target's features of what
    each turn adds."""
    from dataclasses import replace

    from edgespec.costmodel import flat

    saved = smol.cost, smol.cfg, smol.side.pop("heads", None), smol._kinds
    smol.cost = flat(0.05, 8)  # trees of up to 8 rows: random heads' 32-row trees only cost time
    smol.cfg = replace(saved[1], heads=str(heads_files[kind]), draft_n_min=4)
    smol._kinds = None
    try:
        got = _same_text(smol, kind, plain_turns)
        assert sum(r.stats.n_drafted for r, _ in got) > 0
        if kind == "eagle":
            head = methods.heads_runtime(smol, "eagle")
            assert head.committed is not None and head.n > len(got[-1][1]) // 2
    finally:
        smol.cost, smol.cfg, smol._kinds = saved[0], saved[1], saved[3]
        smol.side.pop("heads", None)
        if saved[2] is not None:
            smol.side["heads"] = saved[2]


def test_stop_and_regenerate_reuse_what_holds(smol):
    s = ChatSession(smol, "lookahead", GREEDY, N)
    seen = []

    def stop_early(ev, piece):
        seen.append(ev)
        if len(seen) == 3:
            s.stop()

    r1 = s.send(TURNS[0], stop_early)
    assert r1.stopped and r1.stats.finish_reason == "interrupted"
    r2 = s.send(TURNS[1])
    # the stopped reply's tokens were kept: the next turn read only its own message (and the
    # reply's last token, whatever the tokenizer makes of a text cut mid-word)
    assert r2.stats.n_prompt_cached >= r1.stats.n_prompt + len(r1.tokens) - 3
    regen = s.regenerate()
    assert regen.stats.n_prompt_eval == 1  # the same prompt: only its last token again
    assert regen.tokens == r2.tokens
    off = ChatSession(smol, "none", GREEDY, N, reuse=False)
    assert off.send(TURNS[0]).stats.n_prompt_cached == 0


def test_batch_one_at_a_time_reuses_a_shared_prefix(smol):
    """`batch --reuse -np 1`: requests with one system prompt read it once; lookahead's greedy
    output equals plain decoding's with reuse; the records say what was cached."""
    import json

    from edgespec.frontends.batch import read_requests
    from edgespec.serving import Defaults, run_requests
    from edgespec.sampling import SamplingConfig

    system = {"role": "system", "content": "You are a careful assistant. Answer in one short paragraph, plainly."}
    lines = [json.dumps({"custom_id": f"r{i}", "body": {"messages": [system, {"role": "user", "content": t}],
                                                         "max_tokens": 24, "temperature": 0}})
             for i, t in enumerate(TURNS)]
    reqs = read_requests(lines, Defaults(24, SamplingConfig()))
    out = {}
    for method in ("none", "lookahead"):
        recs = {}
        run_requests(smol, reqs, method, 1, lambda r, rec: recs.__setitem__(r.custom_id, rec), quiet=True, reuse=True)
        out[method] = recs
    usage = [out["none"][f"r{i}"]["response"]["body"]["usage"] for i in range(len(TURNS))]
    assert usage[0]["prompt_tokens_details"]["cached_tokens"] == 0
    assert all(u["prompt_tokens_details"]["cached_tokens"] > 10 for u in usage[1:])
    text = lambda recs, i: recs[f"r{i}"]["response"]["body"]["choices"][0]["message"]["content"]  # noqa: E731
    assert all(text(out["none"], i) == text(out["lookahead"], i) for i in range(len(TURNS)))
