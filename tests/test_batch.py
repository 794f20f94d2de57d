"""`edgespec batch`: request parsing, one output line per input line, resume after SIGKILL, and
greedy outputs with several sequences per decode equal to one sequence at a time."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import PROMPTS
from edgespec.frontends.batch import DUPLICATE, Done, parse_line, pending_requests, read_requests, scan_output
from edgespec.serving import CHAT_URL, TEXT_URL, Defaults, Request, run_requests
from edgespec.frontends.cli import main
from edgespec.text import TextStream
from edgespec.sampling import SamplingConfig

D = Defaults(64, SamplingConfig())
BENCH = Path(__file__).resolve().parents[2] / "shared" / "bench" / "prompts.jsonl"


def line(obj) -> str:
    return json.dumps(obj)


# -- parsing (no model) ------------------------------------------------------------------


def test_parse_openai_lines_and_bare_lines():
    r = parse_line(line({"custom_id": "x", "method": "POST", "url": CHAT_URL,
                         "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9,
                                  "temperature": 0.5, "top_p": 0.9, "seed": 3, "stop": "END"}}), 1, D)
    assert r.error is None and r.url == CHAT_URL and r.max_tokens == 9 and r.stop == ["END"]
    assert r.sampling.temp == 0.5 and r.sampling.top_p == 0.9 and r.sampling.seed == 3
    r = parse_line(line({"custom_id": "y", "url": TEXT_URL, "body": {"prompt": "abc"}}), 2, D)
    assert r.error is None and r.prompt == "abc" and r.max_tokens == 64 and r.sampling.greedy
    r = parse_line(line({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                   {"type": "text", "text": "b"}]}]}), 7, D)
    assert r.error is None and r.custom_id == "line-7" and r.messages[0]["content"] == "ab"
    r = parse_line(line({"prompt": "p", "custom_id": "z", "max_completion_tokens": 5}), 3, D)
    assert r.error is None and r.url == TEXT_URL and r.max_tokens == 5


@pytest.mark.parametrize("obj,code,needle", [
    ("{not json", "invalid_json", "not valid JSON"),
    ([1, 2], "invalid_json", "not a JSON object"),
    ({"custom_id": 5, "body": {"prompt": "p"}}, "invalid_request", "custom_id"),
    ({"custom_id": "a", "body": {"prompt": "p"}, "extra": 1}, "unknown_field", "'extra'"),
    ({"custom_id": "a", "body": {"prompt": "p", "bogus": 1}}, "unknown_field", "'bogus'"),
    ({"custom_id": "a", "url": "/v1/embeddings", "body": {"input": "p"}}, "unsupported_url", "/v1/embeddings"),
    ({"custom_id": "a", "method": "GET", "body": {"prompt": "p"}}, "invalid_request", "POST"),
    ({"custom_id": "a", "url": CHAT_URL, "body": {"prompt": "p"}}, "invalid_request", "messages"),
    ({"custom_id": "a", "body": {"messages": []}}, "invalid_request", "non-empty"),
    ({"custom_id": "a", "body": {"messages": [{"role": "tool", "content": "x"}]}}, "invalid_request", "role tool"),
    ({"custom_id": "a", "body": {"messages": [{"role": "robot", "content": "x"}]}}, "invalid_request", "role"),
    ({"custom_id": "a", "body": {"prompt": "p", "max_tokens": 0}}, "invalid_request", "max_tokens"),
    ({"custom_id": "a", "body": {"prompt": "p", "temperature": -1}}, "invalid_request", "temperature"),
    ({"custom_id": "a", "body": {"prompt": "p", "temperature": "hot"}}, "invalid_request", "temperature"),
    ({"custom_id": "a", "body": {"prompt": "p", "n": 0}}, "invalid_request", "n must be"),
    ({"custom_id": "a", "body": {"prompt": "p", "stream": True}}, "unsupported", "stream"),
    ({"custom_id": "a", "body": {"prompt": "p", "stop": [1]}}, "invalid_request", "stop"),
    ({"custom_id": "a", "body": {"prompt": "p", "presence_penalty": 2.5}}, "invalid_request", "presence_penalty"),
    ({"custom_id": "a", "body": {"prompt": "p", "stop": [str(i) for i in range(17)]}}, "invalid_request", "up to 16"),
    ({"custom_id": "a", "body": {"prompt": "p", "logprobs": 21}}, "invalid_request", "logprobs"),
    ({"custom_id": "a", "body": {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}},
     "invalid_request", "needs logprobs"),
    ({"custom_id": "a", "body": {"prompt": "p", "response_format": {"type": "json_schema"}}}, "invalid_request",
     "json_schema.schema"),
    ({"custom_id": "a", "body": {"prompt": "p", "response_format": {"type": "json_schema", "json_schema": {
        "schema": {"$ref": "https://example.com/s"}}}}}, "invalid_schema", "response_format"),
    ({"custom_id": "a", "body": {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}},
     "invalid_request", "tools must be"),
    ({"custom_id": "a", "body": {"prompt": "p", "tools": [{"type": "function", "function": {"name": "f"}}]}},
     "unsupported", "chat"),
    ({"custom_id": "a", "body": {"prompt": "p", "logit_bias": {"x": 1}}}, "invalid_request", "logit_bias"),
    ({"custom_id": "a"}, "invalid_request", "needs a body"),
])
def test_parse_errors_name_the_problem(obj, code, needle):
    r = parse_line(obj if isinstance(obj, str) else line(obj), 4, D)
    assert r.error is not None and r.error.code == code and needle in str(r.error), str(r.error)


def test_duplicates_are_marked_and_resume_counts_them():
    lines = [line({"custom_id": "a", "body": {"prompt": "1"}}), "", line({"custom_id": "b", "body": {"prompt": "2"}}),
             line({"custom_id": "a", "body": {"prompt": "3"}}), line({"custom_id": "a", "body": {"prompt": "4"}})]
    reqs = read_requests(lines, D)
    assert [r.line_no for r in reqs] == [1, 3, 4, 5]  # blank lines are not requests
    assert [r.duplicate_of for r in reqs] == [None, None, 1, 1]
    assert reqs[2].error.code == DUPLICATE and "line 1" in str(reqs[2].error)
    # an earlier run wrote the first duplicate's error, but 'a' itself was still running when killed
    done = Done(ids={"b"})
    done.duplicates["a"] = 1
    todo = pending_requests(reqs, done)
    assert [r.line_no for r in todo] == [1, 5]


def test_scan_output_cuts_a_torn_last_line(tmp_path):
    out = tmp_path / "out.jsonl"
    good = line({"custom_id": "a", "response": {}, "error": None}) + "\n"
    dup = line({"custom_id": "a", "response": None, "error": {"code": DUPLICATE, "message": "m"}}) + "\n"
    out.write_text(good + dup + '{"custom_id": "b", "resp')
    done = scan_output(str(out))
    assert done.ids == {"a"} and done.duplicates["a"] == 1 and done.lines == 2 and done.repaired > 0
    assert out.read_text() == good + dup
    out.write_text("hello\n")
    with pytest.raises(Exception, match="not a batch result"):
        scan_output(str(out))


def test_one_output_file_has_one_writer(tmp_path):
    from edgespec.frontends.batch import Writer
    from edgespec.errors import EdgespecError

    first = Writer(str(tmp_path / "out.jsonl"))
    try:
        with pytest.raises(EdgespecError, match="another edgespec batch is writing"):
            Writer(str(tmp_path / "out.jsonl"))
    finally:
        first.close()
    Writer(str(tmp_path / "out.jsonl")).close()  # free again once the first is done


class _Vocab:
    def __init__(self, pieces):
        self.pieces = pieces

    def piece(self, t):
        return self.pieces[t]


def test_stop_string_across_tokens_cuts_the_text():
    tr = TextStream(_Vocab({0: b"count 1", 1: b"4, 1", 2: b"5, 16", 3: "é".encode()[:1], 4: "é".encode()[1:]}), ["15"])
    shown = tr.feed([0, 1])
    assert not tr.hit
    shown += tr.feed([2])
    assert tr.hit
    assert tr.final() == "count 14, " and shown == "count 14, "  # a streamed piece never shows the stop
    tr = TextStream(_Vocab({3: "é".encode()[:1], 4: "é".encode()[1:]}), [])
    tr.feed([3])
    tr.feed([4])
    assert tr.final() == "é"  # a character split over two tokens is not mangled


# -- on the real model -------------------------------------------------------------------


def _reqs(n_tokens: int = 48) -> list[Request]:
    items = [{"custom_id": f"p{i}", "body": {"messages": [{"role": "user", "content": p}], "max_tokens": n_tokens}}
             for i, p in enumerate(PROMPTS)]
    if BENCH.exists():
        for j, raw in enumerate(BENCH.read_text().splitlines()[:6]):
            it = json.loads(raw)
            body = {"messages": it["messages"]} if "messages" in it else {"prompt": it["prompt"]}
            items.append({"custom_id": f"b{j}", "body": {**body, "max_tokens": n_tokens}})
    return read_requests([line(x) for x in items], D)


def _collect(engine, reqs, method, n_par):
    recs = {}
    totals = run_requests(engine, reqs, method, n_par, lambda r, rec: recs.__setitem__(r.custom_id, rec), quiet=True)
    return totals, recs


@pytest.fixture(scope="module")
def one_at_a_time(smol):
    """-np 1 without speculation: plain greedy decoding, one request after another."""
    reqs = _reqs()
    return reqs, _collect(smol, reqs, "none", 1)


@pytest.mark.parametrize("method,n_par", [("none", 4), ("lookahead", 4), ("ngram", 3)])
def test_parallel_greedy_equals_one_at_a_time(smol, one_at_a_time, method, n_par):
    reqs, (one, recs1) = one_at_a_time
    many, recs = _collect(smol, reqs, method, n_par)
    assert one.failed == many.failed == 0 and one.ok == many.ok == len(reqs)
    for r in reqs:
        assert many.outputs[r.custom_id] == one.outputs[r.custom_id], f"-np {n_par} differs from -np 1 on {r.custom_id}"
        t1 = recs1[r.custom_id]["response"]["body"]["choices"][0]["message"]["content"]
        assert recs[r.custom_id]["response"]["body"]["choices"][0]["message"]["content"] == t1
    if method != "none":
        assert many.drafted > 0 and many.accepted > 0, f"no drafts were verified with -np {n_par}"


def test_parallel_seeded_sampling_equals_one_at_a_time(smol):
    """Draft-free drafts have no distribution: the verifier draws every token from the target,
    one draw per token, so a seeded request gives the same text however it was batched."""
    reqs = read_requests([line({"custom_id": f"s{i}", "body": {"messages": [{"role": "user", "content": p}],
                                                                "temperature": 0.9, "seed": 11 + i, "max_tokens": 40}})
                          for i, p in enumerate(PROMPTS[:4])], D)
    one, _ = _collect(smol, reqs, "lookahead", 1)
    three, _ = _collect(smol, reqs, "lookahead", 3)
    assert one.outputs == three.outputs


def test_stop_strings_and_context_errors(smol):
    lines = [
        line({"custom_id": "stop", "body": {"prompt": "Count from 1 to 30: 1, 2, 3, 4,", "max_tokens": 60,
                                            "stop": [" 9,"]}}),
        line({"custom_id": "long", "body": {"prompt": "word " * 3000, "max_tokens": 4}}),
        line({"custom_id": "ok", "body": {"prompt": "The capital of France is", "max_tokens": 4}}),
    ]
    for n_par in (1, 2):
        recs = {}
        totals = run_requests(smol, read_requests(lines, D), "lookahead", n_par,
                              lambda r, rec: recs.__setitem__(r.custom_id, rec), quiet=True)
        assert totals.ok == 2 and totals.failed == 1
        choice = recs["stop"]["response"]["body"]["choices"][0]
        assert choice["finish_reason"] == "stop" and " 9," not in choice["text"] and choice["text"].endswith("8,")
        assert recs["long"]["error"]["code"] == "context_length_exceeded"
        assert recs["ok"]["response"]["body"]["choices"][0]["finish_reason"] == "length"
        assert recs["ok"]["response"]["body"]["usage"]["completion_tokens"] == 4


def test_cli_every_line_gets_one_output_line(tmp_path, capsys):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    rows = [
        line({"custom_id": "a", "method": "POST", "url": CHAT_URL,
              "body": {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}}),
        "{broken",
        line({"custom_id": "b", "method": "POST", "url": TEXT_URL, "body": {"prompt": "1, 2, 3,", "max_tokens": 8}}),
        line({"custom_id": "c", "body": {"prompt": "x", "frobnicate": True}}),
        line({"custom_id": "a", "body": {"prompt": "again"}}),
        line({"prompt": "Once upon a time", "max_tokens": 8}),
    ]
    inp.write_text("\n".join(rows) + "\n")
    args = ["batch", "-i", str(inp), "-o", str(out), "-m", "smollm2-135m-instruct:q4_0", "-t", "2", "-np", "2", "-q"]
    assert main(args) == 4  # some requests failed
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(recs) == len(rows)
    by = {}
    for r in recs:
        by.setdefault(r["custom_id"], []).append(r)
    assert sorted(by) == ["a", "b", "c", "line-2", "line-6"]
    assert by["line-2"][0]["error"]["code"] == "invalid_json"
    assert by["c"][0]["error"]["code"] == "unknown_field"
    assert sorted(str(r["error"] and r["error"]["code"]) for r in by["a"]) == ["None", DUPLICATE]
    ok = [r for r in recs if r["error"] is None]
    assert len(ok) == 3
    for r in ok:
        body = r["response"]["body"]
        assert r["response"]["status_code"] == 200 and body["usage"]["completion_tokens"] > 0
        assert body["object"] in ("chat.completion", "text_completion") and "speculative" in body
    err = capsys.readouterr().err
    assert "duplicate custom_id" in err and "3 ok, 3 failed" in err
    # a second run finds everything done and writes nothing
    assert main(args) == 0
    assert len(out.read_text().splitlines()) == len(rows)
    assert main(["batch", "-i", str(tmp_path / "missing.jsonl"), "-o", str(out)]) == 2
    assert "input file not found" in capsys.readouterr().err


@pytest.mark.slow
def test_resume_after_sigkill_completes_without_duplicates(tmp_path):
    inp, out, ref = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "ref.jsonl"
    topics = ["rivers", "mountains", "bread", "clocks", "owls", "bridges", "salt", "trains", "maps", "bees",
              "glass", "tides"]
    rows = [{"custom_id": f"r{i}", "body": {"max_tokens": 40, "messages": [
        {"role": "user", "content": f"Write three sentences about {t}."}]}} for i, t in enumerate(topics)]
    inp.write_text("".join(line(r) + "\n" for r in rows))
    base = [sys.executable, "-m", "edgespec", "batch", "-i", str(inp), "-m", "smollm2-135m-instruct:q4_0", "-t", "2",
            "-np", "2", "-q"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(base + ["-o", str(out)], env=env, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if out.exists() and len(out.read_bytes().splitlines()) >= 3:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the batch finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    n_before = len(out.read_bytes().splitlines())
    assert 3 <= n_before < len(topics)
    resumed = subprocess.run(base + ["-o", str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert "already done" in resumed.stderr
    ids = [json.loads(x)["custom_id"] for x in out.read_text().splitlines()]
    assert sorted(ids) == sorted(f"r{i}" for i in range(len(topics))), "missing or duplicated results"
    # and what the resumed file holds equals one uninterrupted run
    straight = subprocess.run(base + ["-o", str(ref)], env=env, capture_output=True, text=True, timeout=300)
    assert straight.returncode == 0, straight.stderr

    def texts(p):
        return {r["custom_id"]: r["response"]["body"]["choices"][0]["message"]["content"]
                for r in map(json.loads, p.read_text().splitlines())}

    assert texts(out) == texts(ref)


def test_split_passes_follows_llama_cpp():
    from edgespec.schedulers.multi import split_passes

    assert split_passes([1, 1, 1, 1]) == [[(0, 1), (1, 1), (2, 1), (3, 1)]]
    assert split_passes([9, 1, 1, 1]) == [[(0, 1), (1, 1), (2, 1), (3, 1)], [(0, 8)]]
    assert split_passes([5, 5, 1, 1]) == [[(0, 1), (1, 1), (2, 1), (3, 1)], [(0, 4), (1, 4)]]
    assert split_passes([5, 1, 5, 1]) == [[(0, 1), (1, 1), (2, 1), (3, 1)], [(0, 4)], [(2, 4)]]
    assert split_passes([1, 0, 2, 2]) == [[(0, 1)], [(2, 2), (3, 2)]]


def test_sigterm_stops_keeping_finished_results(tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(line({"custom_id": f"t{i}", "body": {"prompt": f"List {i + 3} colors:", "max_tokens": 48}})
                           + "\n" for i in range(8)))
    cmd = [sys.executable, "-m", "edgespec", "batch", "-i", str(inp), "-o", str(out), "-m",
           "smollm2-135m-instruct:q4_0", "-t", "2", "-np", "2", "-q"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if out.exists() and out.read_bytes().count(b"\n") >= 1:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    err = proc.communicate(timeout=60)[1]
    assert proc.returncode == 130, err
    assert "interrupted" in err and "resumes" in err
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert 1 <= len(recs) < 8 and all(r["error"] is None for r in recs)


@pytest.mark.slow
def test_parallel_equals_one_at_a_time_with_sliding_window_attention():
    """Gemma 3 (sliding-window layers) in per-sequence KV streams; its Q4_K_M file (K-quant
    weights: the probe's rows cap every decode), whose cost curve test_lossless uses too."""
    from edgespec.engine import Engine, EngineConfig

    eng = Engine(EngineConfig(model="gemma3-270m", n_ctx=1024, threads=2, max_branches=1))
    try:
        reqs = read_requests([line({"custom_id": f"g{i}", "body": {"prompt": p, "max_tokens": 40}}) for i, p in
                              enumerate(["def fibonacci(n):", "List of prime numbers: 2, 3, 5, 7,",
                                         "The three laws of thermodynamics are", PROMPTS[4]])], D)
        one, _ = _collect(eng, reqs, "none", 1)
        many, _ = _collect(eng, reqs, "lookahead", 3)
        assert one.ok == many.ok == 4 and many.outputs == one.outputs
    finally:
        eng.close()


def test_layout_choice_follows_the_cost_curve():
    """One confident sequence among four: where a pass costs mostly its fixed part (weights) it
    drafts alone in an extra pass; where rows cost little (a GPU) everyone drafts in one pass;
    where rows cost nearly as much as a plain step, nobody does."""
    from types import SimpleNamespace

    from edgespec.costmodel import KS, CostModel, flat
    from edgespec.schedulers.multi import MultiDecoder

    dec = object.__new__(MultiDecoder)
    dec.n_parallel, dec._zero_steps, dec.policy = 4, 0, "strict"
    active = [SimpleNamespace(kv=SimpleNamespace(seq=i, n=100)) for i in range(4)]
    paths = [[0.95, 0.9, 0.85, 0.8, 0.75, 0.7], [0.2], [], [0.3, 0.1]]
    sure = [[0.99] * 8] + paths[1:]
    dec.cost = CostModel(KS, tuple(0.010 + 0.002 * k for k in KS), 0.0, 32, 32)
    assert dec._choose_layout(active, sure, 8) == [8, 0, 0, 0]
    dec.cost = CostModel(KS, tuple(0.004 + 0.003 * k for k in KS), 0.0, 32, 32)  # about this 2-core CPU
    assert dec._choose_layout(active, paths, 8) == [0, 0, 0, 0]
    dec.cost = flat(0.01, 32)
    lens = dec._choose_layout(active, paths, 7)
    assert lens[0] == 6 and len(set(lens)) == 1  # one pass: every sequence padded to the same length
    assert dec._choose_layout(active, [[], [], [], []], 8) == [0, 0, 0, 0]


# -- hostile input and failures: one request never ends the batch -----------------------


def test_seed_minus_one_is_random_and_other_negative_seeds_are_refused():
    r = parse_line(line({"prompt": "p", "temperature": 0.7, "seed": -1}), 1, D)
    assert r.error is None and r.sampling.seed is None
    r = parse_line(line({"prompt": "p", "seed": -7}), 1, D)
    assert r.error is not None and r.error.code == "invalid_request" and "seed" in str(r.error)
    r = parse_line(line({"prompt": "p", "top_k": 2.5}), 1, D)
    assert r.error is not None and "top_k" in str(r.error)


def test_writer_locks_before_it_truncates(tmp_path):
    from edgespec.frontends.batch import Writer
    from edgespec.errors import EdgespecError

    path = tmp_path / "out.jsonl"
    path.write_text('{"custom_id": "kept"}\n')
    live = Writer(str(path))
    try:
        with pytest.raises(EdgespecError, match="another edgespec batch"):
            Writer(str(path), overwrite=True)
        assert path.read_text() == '{"custom_id": "kept"}\n'  # the live batch's file is untouched
    finally:
        live.close()
    Writer(str(path), overwrite=True).close()
    assert path.read_text() == ""


def _rec(cid, status, code=None):
    return line({"custom_id": cid, "response": {"status_code": status},
                 "error": None if code is None else {"code": code, "message": "m"}}) + "\n"


def test_failed_lines_are_kept_by_default_and_removed_for_a_retry(tmp_path):
    out = tmp_path / "out.jsonl"
    text = _rec("ok", 200) + _rec("bad-input", 400, "invalid_request") + _rec("crashed", 500, "failed")
    out.write_text(text)
    done = scan_output(str(out))
    assert done.ids == {"ok", "bad-input", "crashed"} and done.failed == 1
    assert out.read_text() == text
    done = scan_output(str(out), retry_failed=True)
    assert done.ids == {"ok", "bad-input"} and done.failed == 1
    assert out.read_text() == _rec("ok", 200) + _rec("bad-input", 400, "invalid_request")
    assert not (tmp_path / "out.jsonl.retry-backup").exists()
    # a rewrite interrupted before it finished is undone from its backup
    (tmp_path / "out.jsonl.retry-backup").write_text(text)
    out.write_text(_rec("ok", 200)[:10])
    done = scan_output(str(out))
    assert done.restored and out.read_text() == text and done.ids == {"ok", "bad-input", "crashed"}


@pytest.mark.parametrize("n_par", [1, 2])
def test_hostile_lines_and_crashes_become_error_lines(smol, monkeypatch, n_par):
    real = smol.prompt_tokens

    def flaky(text=None, messages=None, raw=False):
        if text == "boom":
            raise RuntimeError("kaboom")
        return real(text, messages, raw)

    monkeypatch.setattr(smol, "prompt_tokens", flaky)
    lines = [
        line({"custom_id": "a", "body": {"prompt": "Hello", "max_tokens": 3, "temperature": 0.7, "seed": -1}}),
        '{"custom_id": "b", "body": {"prompt": "\\ud800 lone surrogate", "max_tokens": 3}}',
        line({"custom_id": "c", "body": {"prompt": "boom", "max_tokens": 3}}),
        line({"custom_id": "d", "body": {"prompt": "Count: 1, 2,", "max_tokens": 3}}),
    ]
    reqs = read_requests(lines, D)
    out = {}
    tot = run_requests(smol, reqs, "lookahead", n_par, lambda req, rec: out.__setitem__(req.custom_id, rec))
    assert set(out) == {"a", "b", "c", "d"}
    assert out["a"]["error"] is None and out["d"]["error"] is None
    assert out["b"]["error"]["code"] == "invalid_request" and "surrogate" in out["b"]["error"]["message"]
    assert out["c"]["error"]["code"] == "failed" and "kaboom" in out["c"]["error"]["message"]
    assert out["c"]["response"]["status_code"] == 500
    assert tot.ok == 2 and tot.failed == 2


def test_a_crash_inside_a_generation_fails_only_that_request(smol, monkeypatch):
    from edgespec.drafters.lookahead import LookaheadDrafter

    real = LookaheadDrafter.propose

    def propose(self, context, budget):
        if smol.target.detokenize(context).count("explode") >= 1 and len(context) > 0:
            raise ValueError("drafter fell over")
        return real(self, context, budget)

    monkeypatch.setattr(LookaheadDrafter, "propose", propose)
    reqs = read_requests([line({"custom_id": "x", "body": {"prompt": "explode now", "max_tokens": 4}}),
                          line({"custom_id": "y", "body": {"prompt": "A calm", "max_tokens": 4}})], D)
    out = {}
    run_requests(smol, reqs, "lookahead", 1, lambda req, rec: out.__setitem__(req.custom_id, rec))
    assert out["x"]["error"]["code"] == "failed" and "drafter fell over" in out["x"]["error"]["message"]
    assert out["y"]["error"] is None and out["y"]["response"]["body"]["usage"]["completion_tokens"] >= 1
