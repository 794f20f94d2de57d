"""KV reuse between serve requests on the real embedded model: a returning client reads only its
new text (from its slot, or restored from the host-RAM prompt cache after its slot was taken),
no prefix crosses API keys, the RAM cache stays under its bound, and reused greedy replies equal
the same requests read cold."""

import re

import pytest

from conftest import serve_in_thread

from edgespec.engine import Engine, EngineConfig
from edgespec.serving.requests import Defaults, Request
from edgespec.serving.loop import run_requests
from edgespec.frontends.server.app import Server
from edgespec.frontends.server.worker import Worker
from edgespec.promptcache import PromptCache, SlotTable
from edgespec.sampling import SamplingConfig

from test_serve import KEY, MODEL, Running, _plain, httpx

N = 24  # tokens per reply
FIRST = ["Name three colours of the rainbow.", "What is the capital of France?",
         "Write a Python function that adds two numbers.", "List four animals that live in the sea.",
         "Say hello in French.", "Count from 1 to 5."]
FOLLOW = "Now say it again, shorter."


def _turn2(engine, first: str) -> tuple[list[dict], str]:
    """The second turn's messages (the first turn's greedy reply read cold) and its greedy reply
    read cold, on a single-sequence context: what a fresh server answers."""
    m1 = [{"role": "user", "content": first}]
    r1 = _plain(engine, messages=m1, n=N)
    m2 = m1 + [{"role": "assistant", "content": r1}, {"role": "user", "content": FOLLOW}]
    return m2, _plain(engine, messages=m2, n=N)


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    m = re.search(rf"^{name}(?:_total)? ([0-9.e+]+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def _server(n_parallel: int, ram: int, convs: int):
    # Running builds its worker in __init__: build it again with reuse and the RAM cache
    s = Running.__new__(Running)
    s.engine = Engine(EngineConfig(model=MODEL, n_ctx=1024, threads=2, max_branches=1))
    s.turns = {c: _turn2(s.engine, c) for c in FIRST[:convs]}
    s.worker = Worker(s.engine, "lookahead", n_parallel, max_queue=64, reuse=True, cache_ram=ram)
    s.server = Server(s.engine, s.worker, MODEL, Defaults(N, SamplingConfig()), KEY)
    _serve(s)
    return s


def _serve(s) -> None:
    serve_in_thread(s)


def _chat(s, messages):
    c = s.client()
    r = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=N, temperature=0)
    return r.choices[0].message.content, r.usage


@pytest.mark.parametrize("n_parallel", [2, 1], ids=["np2", "np1"])
def test_returning_client_reads_its_new_suffix_from_slot_and_from_ram(n_parallel):
    s = _server(n_parallel, 64 << 20, 3)
    try:
        a, b, c = FIRST[:3]
        # the returning client, its slot untouched: only the new message is read
        r1, u1 = _chat(s, [{"role": "user", "content": a}])
        m2, ref2 = s.turns[a]
        assert m2[1]["content"] == r1
        cached0 = _metric(s.url, "edgespec_prompt_tokens_cached")
        r2, u2 = _chat(s, m2)
        assert r2 == ref2  # reused reply == the same request read cold on a fresh server
        cached = u2.prompt_tokens_details.cached_tokens
        assert cached >= u1.prompt_tokens, (cached, u1.prompt_tokens)
        assert u2.prompt_tokens - cached <= 40  # the follow-up and the template's markers
        assert _metric(s.url, "edgespec_prompt_tokens_cached") - cached0 == cached
        assert _metric(s.url, "edgespec_prompt_tokens_evaluated") >= u2.prompt_tokens - cached
        # other conversations take every slot (the first client's cache is copied to RAM) ...
        for other in (b, c):
            _chat(s, [{"role": "user", "content": other}])
        assert _metric(s.url, "edgespec_cache_ram_entries") >= 1
        assert _metric(s.url, "edgespec_cache_ram_bytes") > 0
        hits = _metric(s.url, "edgespec_cache_ram_hits")
        # ... and it comes back: its whole second turn and reply are restored from RAM
        m3 = m2 + [{"role": "assistant", "content": r2}, {"role": "user", "content": "Thanks."}]
        r3, u3 = _chat(s, m3)
        assert _metric(s.url, "edgespec_cache_ram_hits") == hits + 1
        assert u3.prompt_tokens_details.cached_tokens >= u2.prompt_tokens
        assert u3.prompt_tokens - u3.prompt_tokens_details.cached_tokens <= 40
        s.worker.close()
        assert r3 == _plain(s.engine, messages=m3, n=N)  # the engine is free once the worker stopped
    finally:
        s.close()


def _req(i: int, share, messages) -> Request:
    return Request(i, f"r{i}", messages=messages, max_tokens=8, sampling=SamplingConfig(), share=share)


@pytest.fixture(scope="module")
def engine():
    e = Engine(EngineConfig(model=MODEL, n_ctx=1024, threads=2, max_branches=1))
    yield e
    e.close()


@pytest.mark.parametrize("n_parallel", [2, 1], ids=["np2", "np1"])
def test_no_prefix_crosses_keys(engine, n_parallel):
    """The same prompt under another key (or no key) reads in full: no slot and no RAM entry of
    one key is ever used for another."""
    msgs = [{"role": "user", "content": FIRST[0]}]
    cache = PromptCache(64 << 20)
    out = {}
    reqs = [_req(0, "alice", msgs), _req(1, "bob", msgs), _req(2, None, msgs), _req(3, "alice", msgs),
            _req(4, "carol", [{"role": "user", "content": FIRST[1]}]), _req(5, "bob", msgs)]
    run_requests(engine, reqs, "none", n_parallel, lambda r, rec: out.__setitem__(r.custom_id, rec),
                 reuse=True, cache=cache)
    cached = {k: v["response"]["body"]["usage"]["prompt_tokens_details"]["cached_tokens"] for k, v in out.items()}
    n = out["r0"]["response"]["body"]["usage"]["prompt_tokens"]
    assert cached["r0"] == 0 and cached["r1"] == 0 and cached["r2"] == 0 and cached["r4"] == 0
    assert cached["r3"] == n - 1  # alice again: all but the last token
    assert cached["r5"] == n - 1  # bob again (its slot or its RAM entry)
    texts = {k: v["response"]["body"]["choices"][0]["message"]["content"] for k, v in out.items()}
    assert len({texts[k] for k in ("r0", "r1", "r2", "r3", "r5")}) == 1


def test_ram_cache_stays_under_its_bound(engine):
    """Many conversations through one slot: every one is copied to RAM when the next takes the
    slot; the cache's own byte count never passes the bound, the oldest go first, an entry
    larger than the bound is not kept."""
    convs = [[{"role": "user", "content": f"{q} (conversation {i})"}] for i, q in enumerate(FIRST * 2)]
    probe = PromptCache(1 << 30)
    run_requests(engine, [_req(i, "k", m) for i, m in enumerate(convs[:2])], "none", 1, lambda r, rec: None,
                 reuse=True, cache=probe)
    size = probe.snapshot()["bytes"]  # one conversation's state
    assert probe.snapshot()["entries"] == 1 and size > 0
    limit = int(size * 3.5)
    cache = PromptCache(limit)
    seen = []
    orig = cache.put

    def put(share, tokens, data):
        ok = orig(share, tokens, data)
        seen.append(cache.snapshot())
        assert cache.bytes <= limit
        return ok

    cache.put = put
    run_requests(engine, [_req(i, "k", m) for i, m in enumerate(convs)], "none", 1, lambda r, rec: None,
                 reuse=True, cache=cache)
    snap = cache.snapshot()
    assert len(seen) >= len(convs) // 2  # a slot whose next prompt keeps half of it is not copied
    assert snap["bytes"] <= limit and 1 <= snap["entries"] <= 3
    assert snap["evictions"] >= len(seen) - 3
    tiny = PromptCache(size // 2)
    assert not tiny.put("k", list(range(10)), bytearray(size)) and len(tiny) == 0


def test_slot_table_prefers_the_longest_prefix_of_the_same_key(engine):
    """Placement alone, on a context of three streams: the slot with the longest common prefix
    of the request's key wins; another key's identical content is never taken."""
    ctx = engine.use_streams(3)
    try:
        from edgespec.kv import KVSeq

        kvs = [KVSeq(ctx, i) for i in range(3)]
        t = SlotTable(kvs, True, None)
        base = engine.prompt_tokens(messages=[{"role": "user", "content": FIRST[2]}])
        kvs[0].extend(base[:10], want_logits=False)
        t.release(0, "k", True)
        kvs[1].extend(base[:-3], want_logits=False)
        t.release(1, "k", True)
        kvs[2].extend(base[:-1], want_logits=False)
        t.release(2, "other", True)
        p = t.place([0, 1, 2], "k", base)
        assert (p.slot, p.keep, p.source) == (1, len(base) - 3, "slot")
        t.release(1, "k", True)
        p = t.place([0, 2], "k", base)  # slot 1 busy: slot 0's ten tokens, never slot 2's
        assert (p.slot, p.keep) == (0, 10)
    finally:
        engine.use_streams(None)


def test_cache_ram_flags_say_what_is_wrong():
    import subprocess
    import sys

    for args, needle in ((["serve", "--cache-ram", "-1"], "--cache-ram takes MiB"),
                         (["batch", "-i", "x", "-o", "y", "--cache-ram", "5"], "add --reuse")):
        r = subprocess.run([sys.executable, "-m", "edgespec", *args], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and needle in r.stderr, r.stderr


def test_a_restored_state_continues_bit_for_bit(engine):
    """A state copied from one sequence and restored into another gives the next token's logits
    bit for bit as the sequence that read the prompt (each in its own KV stream)."""
    import numpy as np

    from edgespec.kv import KVSeq

    ctx = engine.use_streams(2)
    try:
        a, b = KVSeq(ctx, 1), KVSeq(ctx, 0)
        p = engine.prompt_tokens(messages=[{"role": "user", "content": FIRST[3]}])
        a.extend(p[:-1], want_logits=False)
        data = a.save_state()
        b.extend(p[:5], want_logits=False)  # something to be replaced
        assert b.restore_state(list(a.tokens), data) and b.tokens == a.tokens
        la = ctx.logits(a.extend(p[-1:])).copy()
        lb = ctx.logits(b.extend(p[-1:])).copy()
        assert np.array_equal(la, lb)
        assert not b.restore_state(list(range(3)), bytearray(b"\0" * 16)) and b.n == 0  # refused: empty
    finally:
        engine.use_streams(None)
