"""`edgespec serve` through the real `openai` client and raw HTTP, on the real embedded model:
chat and completions, streamed and not, stop strings, seeds, greedy output equal to plain
decoding, keys, bad input, and a bounded load test with clients killed mid-stream."""

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import serve_in_thread

from edgespec.engine import Engine, EngineConfig
from edgespec.serving import Defaults
from edgespec.frontends.server.app import Server
from edgespec.frontends.server.worker import Worker
from edgespec.sampling import SamplingConfig
from edgespec.text import TextStream

KEY = "test-key-123"
MODEL = "smollm2-135m-instruct:q4_0"
CHATS = [
    "List the numbers from 1 to 12, one per line.",
    "What is the capital of France? Answer in one sentence.",
    "Copy this sentence three times: The quick brown fox jumps over the lazy dog.",
    "Write a Python function that adds two numbers.",
    "Name three colours of the rainbow.",
    "Repeat exactly: red green blue, red green blue, red green blue.",
]
N_TOKENS = 48


class _Resp:
    def __init__(self, status: int, data: bytes):
        self.status_code, self.text = status, data.decode("utf-8", "replace")

    def json(self):
        return json.loads(self.text)


def _http(method: str, url: str, content: bytes | None = None, json_body=None, headers=None) -> _Resp:
    """One plain HTTP request (no client library between the test and the server)."""
    host, rest = url.split("//")[1].split("/", 1)
    h, port = host.split(":")
    conn = http.client.HTTPConnection(h, int(port), timeout=120)
    if json_body is not None:
        content = json.dumps(json_body).encode()
    try:
        conn.request(method, "/" + rest, content, {"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        return _Resp(r.status, r.read())
    finally:
        conn.close()


class httpx:  # noqa: N801 - the few calls these tests make
    @staticmethod
    def get(url, headers=None):
        return _http("GET", url, headers=headers)

    @staticmethod
    def post(url, json=None, content=None, headers=None):
        return _http("POST", url, content=content, json_body=json, headers=headers)


def _plain(engine, messages=None, prompt=None, n=N_TOKENS) -> str:
    """What `edgespec run --spec none` prints for this prompt (greedy)."""
    toks = engine.prompt_tokens(messages=messages) if messages else engine.prompt_tokens(prompt, raw=True)
    gen = engine.start(toks, n, SamplingConfig(), "none")
    for _ in gen:
        pass
    ts = TextStream(engine.target)
    ts.feed(gen.tokens)
    return ts.final()


class Running:
    """A server on a free loopback port, in this process."""

    def __init__(self, n_parallel: int, method: str = "lookahead", api_key: str | None = KEY):
        self.engine = Engine(EngineConfig(model=MODEL, n_ctx=1024, threads=2, max_branches=8 if n_parallel == 1 else 1))
        self.ref = {c: _plain(self.engine, messages=[{"role": "user", "content": c}]) for c in CHATS}
        self.ref_text = _plain(self.engine, prompt="Once upon a time, in a small village,")
        self.worker = Worker(self.engine, method, n_parallel, max_queue=64)
        self.server = Server(self.engine, self.worker, MODEL, Defaults(N_TOKENS, SamplingConfig()), api_key)
        serve_in_thread(self)

    def client(self, key=KEY, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=120, **kw)

    def close(self) -> None:
        self.uv.should_exit = True
        self.thread.join(30)
        self.worker.close()
        self.sock.close()
        self.engine.close()


@pytest.fixture(scope="module", params=[2, 1], ids=["np2", "np1"])
def srv(request):
    s = Running(request.param)
    yield s
    s.close()


def test_openai_client_chat_and_completions_equal_plain_decoding(srv):
    c = srv.client()
    models = c.models.list()
    assert [m.id for m in models.data] == [MODEL]
    msg = CHATS[0]
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": msg}], max_tokens=N_TOKENS)
    assert r.choices[0].message.content == srv.ref[msg]
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == N_TOKENS
    spec = r.speculative
    assert spec["method"] == "lookahead" and spec["steps"] >= 1 and 0 <= spec["acceptance_rate"] <= 1
    # streamed: the pieces put together are the same text; a final chunk carries finish and speculative
    chunks = list(c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": msg}],
                                            max_tokens=N_TOKENS, stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == srv.ref[msg]
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == N_TOKENS and chunks[-1].speculative["drafter"]
    # completions, not streamed and streamed
    p = "Once upon a time, in a small village,"
    r = c.completions.create(model=MODEL, prompt=p, max_tokens=N_TOKENS)
    assert r.choices[0].text == srv.ref_text and r.speculative["method"] == "lookahead"
    text = "".join(ch.choices[0].text for ch in c.completions.create(model=MODEL, prompt=p, max_tokens=N_TOKENS,
                                                                      stream=True) if ch.choices)
    assert text == srv.ref_text


def test_stop_strings_and_seeds(srv):
    c = srv.client()
    msg = CHATS[0]
    ref = srv.ref[msg]
    stop = ref[10:16]
    assert stop.strip(), ref
    cut = ref[: ref.index(stop)]
    for stream in (False, True):
        r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": msg}], max_tokens=N_TOKENS,
                                      stop=[stop, "never-seen"], stream=stream)
        if stream:
            chunks = [ch for ch in r if ch.choices]
            text = "".join(ch.choices[0].delta.content or "" for ch in chunks)
            finish = chunks[-1].choices[0].finish_reason
        else:
            text, finish = r.choices[0].message.content, r.choices[0].finish_reason
        assert (text, finish) == (cut, "stop")
    outs = [c.completions.create(model=MODEL, prompt="My favourite animal is", max_tokens=24, temperature=0.9,
                                 seed=seed, extra_body={"top_k": 0, "top_p": 1.0, "min_p": 0.0}).choices[0].text
            for seed in (7, 7, 8)]
    assert outs[0] == outs[1], "the same seed gives the same sample"


def test_api_key_is_required_but_not_for_health(srv):
    with pytest.raises(openai.AuthenticationError):
        srv.client(key="wrong").models.list()
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(srv.url + "/health").json()["status"] == "ok"
    assert httpx.get(srv.url + "/metrics").status_code == 401


@pytest.mark.parametrize("body,status,code,needle", [
    (b"{not json", 400, "invalid_json", "not valid JSON"),
    (b"", 400, "invalid_json", "empty"),
    (b"[1, 2]", 400, "invalid_request", "JSON object"),
    (b'{"prompt": "hi", "bogus": 1}', 400, "unknown_field", "'bogus'"),
    (b'{"prompt": "hi", "max_tokens": "ten"}', 400, "invalid_request", "max_tokens"),
    (b'{"prompt": "hi", "temperature": 9}', 400, "invalid_request", "temperature"),
    (b'{"prompt": "hi", "n": 17}', 400, "invalid_request", "n must be"),
    (b'{"prompt": ["a", "b"]}', 400, "invalid_request", "prompt"),
    (b'{"prompt": "hi", "stream": "yes"}', 400, "invalid_request", "stream"),
    (b'{"prompt": "\\ud800"}', 400, "invalid_request", "surrogate"),
])
def test_bad_bodies_get_a_clear_4xx(srv, body, status, code, needle):
    r = httpx.post(srv.url + "/v1/completions", content=body, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and needle in err["message"], err


def test_huge_long_and_misrouted_requests_and_the_server_keeps_serving(srv):
    h = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(srv.url + "/v1/completions", content=b'{"prompt": "' + b"a" * (5 << 20) + b'"}', headers=h)
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "word " * 3000}, headers=h)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": [{"role": "tool", "content": "x"}]}, headers=h)
    assert r.status_code == 400 and "role" in r.json()["error"]["message"]
    assert httpx.get(srv.url + "/v1/completions", headers=h).status_code == 405
    assert httpx.get(srv.url + "/v2/whatever", headers=h).json()["error"]["code"] == "not_found"
    r = srv.client().completions.create(model=MODEL, prompt="Once upon a time, in a small village,", max_tokens=N_TOKENS)
    assert r.choices[0].text == srv.ref_text


def _stream_raw(url: str, path: str, body: dict, kill_after: int | None = None, timeout: float = 120.0):
    """POST a streaming request over a raw socket; the data events, or None when killed after
    `kill_after` events (the connection is cut as a crashed client would)."""
    host, port = url.split("//")[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    events = []
    while True:
        line = resp.readline()
        if not line:
            break
        if line.startswith(b"data: "):
            events.append(line[6:].strip())
            if kill_after is not None and len(events) >= kill_after:
                conn.sock.shutdown(socket.SHUT_RDWR)
                conn.close()
                return None
    conn.close()
    return events


def test_load_concurrent_streams_kills_and_slots(srv):
    """More streaming clients than -np at once, two of them killed mid-stream: every other
    request answered exactly once with its own text (greedy: equal to plain decoding), the
    killed ones' slots freed, the server serving afterwards; bounded in count and time."""
    results: dict[int, object] = {}
    jobs = [(i, CHATS[i % len(CHATS)], None) for i in range(6)] + [(6, CHATS[0], 3), (7, CHATS[2], 2)]

    def client(i, msg, kill):
        body = {"messages": [{"role": "user", "content": msg}], "max_tokens": N_TOKENS, "stream": True}
        try:
            results[i] = _stream_raw(srv.url, "/v1/chat/completions", body, kill_after=kill)
        except Exception as e:  # noqa: BLE001 - the assertion below shows it
            results[i] = e

    t0 = time.monotonic()
    threads = [threading.Thread(target=client, args=j) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    assert time.monotonic() - t0 < 240 and not any(t.is_alive() for t in threads)
    for i, msg, kill in jobs:
        if kill is not None:
            assert results[i] is None, results[i]
            continue
        ev = results[i]
        assert isinstance(ev, list), ev
        assert ev.count(b"[DONE]") == 1 and ev[-1] == b"[DONE]"
        chunks = [json.loads(e) for e in ev[:-1]]
        assert len({c["id"] for c in chunks}) == 1, "one request, one id"
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        assert text == srv.ref[msg], f"request {i}: its own text, as plain decoding gives it"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        h = httpx.get(srv.url + "/health").json()
        if h["active"] == 0 and h["queued"] == 0:
            break
        time.sleep(0.1)
    assert h["active"] == 0 and h["queued"] == 0, h
    metrics = httpx.get(srv.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    assert re.search(r"^edgespec_active_sequences 0\.0$", metrics, re.M)
    m = re.search(r"^edgespec_cancelled_requests_total (\S+)$", metrics, re.M)
    assert m and float(m.group(1)) >= 1, "a killed client's sequence is cancelled"
    assert re.search(r'^edgespec_acceptance_rate\{method="lookahead"\} ', metrics, re.M)
    r = srv.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": CHATS[1]}],
                                             max_tokens=N_TOKENS)
    assert r.choices[0].message.content == srv.ref[CHATS[1]]


def test_serve_command_starts_stops_and_refuses_a_taken_port():
    env = {**os.environ, "EDGESPEC_API_KEY": ""}
    p = subprocess.Popen([sys.executable, "-m", "edgespec", "serve", "-m", MODEL, "-t", "2", "-c", "512", "--port", "0",
                          "-q"], stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = p.stderr.readline()
        m = re.search(r"http://127\.0\.0\.1:(\d+)/v1", line)
        assert m, line
        port = int(m.group(1))
        assert httpx.get(f"http://127.0.0.1:{port}/health").json()["status"] == "ok"
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "Hello", "max_tokens": 4})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        taken = subprocess.run([sys.executable, "-m", "edgespec", "serve", "-m", MODEL, "--port", str(port)],
                               capture_output=True, text=True, timeout=60)
        assert taken.returncode != 0 and taken.stderr.count("\n") == 1 and "--port" in taken.stderr, taken.stderr
        p.send_signal(signal.SIGINT)
        assert p.wait(30) == 0
        assert "server stopped" in p.stderr.read()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_a_client_gone_before_its_answer_frees_the_slot_at_once(srv):
    """A non-streamed request whose client disconnects: its sequence stops after the current step."""
    s = socket.create_connection(("127.0.0.1", srv.port))
    body = json.dumps({"messages": [{"role": "user", "content": "Write a very long story about a dragon."}],
                       "max_tokens": 900}).encode()
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    deadline = time.monotonic() + 30
    while httpx.get(srv.url + "/health").json()["active"] == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    s.close()
    t0 = time.monotonic()
    while httpx.get(srv.url + "/health").json()["active"] != 0 and time.monotonic() - t0 < 10:
        time.sleep(0.02)
    freed = time.monotonic() - t0
    assert freed < 2.0, f"slot freed {freed:.2f} s after the client left"


BODY_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-2, 3), st.floats(-1, 3), st.just("x"),
                        st.lists(st.just("END"), max_size=5), st.just({"include_usage": True}))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fields=st.dictionaries(st.sampled_from(["max_tokens", "temperature", "top_k", "top_p", "min_p", "seed",
                                               "stop", "n", "user", "presence_penalty", "logprobs", "stream_options",
                                               "bogus", "model"]), BODY_VALUES, max_size=4),
       chat=st.booleans())
def test_batch_and_serve_accept_and_refuse_the_same_bodies(srv, fields, chat):
    """One schema: a body the server answers with a 4xx is an error line in a batch, and one
    the server serves is served by a batch, with the same code."""
    from edgespec.serving import Defaults as BD
    from edgespec.frontends.batch import parse_line

    body = {**fields, ("messages" if chat else "prompt"): [{"role": "user", "content": "Hi"}] if chat else "Hi"}
    if isinstance(body.get("max_tokens"), int) and not isinstance(body["max_tokens"], bool):
        body["max_tokens"] = min(body["max_tokens"], 2)
    else:
        body.pop("max_tokens", None)
    req = parse_line(json.dumps({"custom_id": "a", "body": body}), 1, BD(2, SamplingConfig()))
    r = httpx.post(srv.url + ("/v1/chat/completions" if chat else "/v1/completions"), json=body,
                   headers={"Authorization": f"Bearer {KEY}"})
    if req.error is None:
        assert r.status_code == 200, (body, r.text)
    else:
        assert r.status_code == req.error.status and r.json()["error"]["code"] == req.error.code, (body, r.text)


# -- what real clients send (issue 38): structured output, logprobs, many stops, ignored fields --

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}}}
EXTRACT = "Extract the person as JSON with name, age and city: Alice Smith is 34 years old and lives in Paris."


@pytest.fixture(scope="module")
def plain_engine():
    """A second engine for `--spec none` references while the server's engine serves."""
    eng = Engine(EngineConfig(model=MODEL, n_ctx=1024, threads=2))
    yield eng
    eng.close()


def _plain_gen(eng, sampling: SamplingConfig, messages=None, prompt=None, n=N_TOKENS):
    toks = eng.prompt_tokens(messages=messages) if messages else eng.prompt_tokens(prompt, raw=True)
    return eng.start(toks, n, sampling, "none").run()


def test_response_format_json_schema_equals_plain_constrained(srv, plain_engine):
    from edgespec.rows import json_schema_grammar
    from edgespec.sampling import make_sampling

    c = srv.client()
    msgs = [{"role": "user", "content": EXTRACT}]
    ref = _plain_gen(plain_engine, make_sampling(0.0, grammar=json_schema_grammar(PERSON)), messages=msgs, n=80)
    ref_text = plain_engine.target.detokenize(ref.tokens)
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for stream in (False, True):
        r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=80, response_format=rf, stream=stream)
        text = ("".join(ch.choices[0].delta.content or "" for ch in r if ch.choices) if stream
                else r.choices[0].message.content)
        assert text == ref_text
        d = json.loads(text)
        assert set(d) == {"name", "age", "city"} and isinstance(d["age"], int)
    r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=80, response_format={"type": "json_object"})
    assert r.choices[0].message.content.startswith("{")  # any object (this one runs past 80 tokens)
    bad = httpx.post(srv.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                     json={"messages": msgs, "response_format": {"type": "json_schema", "json_schema": {
                         "name": "x", "schema": {"$ref": "https://example.com/s.json"}}}})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_schema"


def test_logprobs_equal_plain_decoding(srv, plain_engine):
    from edgespec.sampling import make_sampling

    c = srv.client()
    msgs = [{"role": "user", "content": CHATS[2]}]
    ref = _plain_gen(plain_engine, make_sampling(0.0, logprobs=3), messages=msgs)
    want = [(plain_engine.target.piece(t).decode("utf-8", "replace"), lp, [v for _, v in top])
            for t, lp, top in ref.logprobs]
    r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=N_TOKENS, logprobs=True, top_logprobs=3)
    got = [(e.token, e.logprob, [x.logprob for x in e.top_logprobs]) for e in r.choices[0].logprobs.content]
    assert got == want
    chunks = [ch for ch in c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=N_TOKENS, logprobs=True,
                                                     top_logprobs=3, stream=True) if ch.choices]
    streamed = [(e.token, e.logprob, [x.logprob for x in e.top_logprobs])
                for ch in chunks if ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert streamed == want
    p = "Once upon a time, in a small village,"
    ref = _plain_gen(plain_engine, make_sampling(0.0, logprobs=2), prompt=p)
    r = c.completions.create(model=MODEL, prompt=p, max_tokens=N_TOKENS, logprobs=2)
    assert r.choices[0].logprobs.token_logprobs == [lp for _, lp, _ in ref.logprobs]


def test_sixteen_stop_strings_and_ignored_fields(srv):
    c = srv.client()
    msg = CHATS[0]
    ref = srv.ref[msg]
    stop = ref[10:16]
    stops = [f"never-{i}" for i in range(15)] + [stop]
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": msg}], max_tokens=N_TOKENS,
                                  stop=stops, store=False, metadata={"k": "v"}, service_tier="auto", user="u",
                                  parallel_tool_calls=False, response_format={"type": "text"},
                                  extra_body={"reasoning_effort": "low", "tools": [], "tool_choice": "none"})
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (ref[: ref.index(stop)], "stop")
    bad = httpx.post(srv.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                     json={"prompt": "hi", "stop": stops + ["one more"]})
    assert bad.status_code == 400 and "up to 16" in bad.json()["error"]["message"]


def test_n_choices_are_that_many_sequences(srv):
    c = srv.client()
    msg = CHATS[1]
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": msg}], max_tokens=N_TOKENS, n=2)
    assert [ch.index for ch in r.choices] == [0, 1]
    assert all(ch.message.content == srv.ref[msg] for ch in r.choices)  # greedy: the same answer twice
    one = c.completions.create(model=MODEL, prompt="My favourite animal is", max_tokens=12, temperature=1.0, seed=5)
    two = c.completions.create(model=MODEL, prompt="My favourite animal is", max_tokens=12, temperature=1.0, seed=5,
                               n=3)
    assert len(two.choices) == 3 and two.choices[0].text == one.choices[0].text  # choice i draws with seed + i
    assert two.usage.completion_tokens >= 3
    # streamed, the choices' chunks interleave, each with its index, and reassemble to the choices
    parts: dict[int, str] = {}
    finish = {}
    for ch in c.completions.create(model=MODEL, prompt="My favourite animal is", max_tokens=12, temperature=1.0,
                                   seed=5, n=3, stream=True):
        for x in ch.choices:
            parts[x.index] = parts.get(x.index, "") + x.text
            if x.finish_reason:
                finish[x.index] = x.finish_reason
    assert parts == {i: two.choices[i].text for i in range(3)} and set(finish) == {0, 1, 2}
