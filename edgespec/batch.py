"""`edgespec batch`: a JSONL file of requests (OpenAI batch format) through the local model.

Every input line gets exactly one output line, written and flushed (and fsynced) the moment its
request is complete, in completion order; match lines by `custom_id`. A line that cannot be
served (bad JSON, an unknown field, a prompt too long) gets an output line with `error` filled
and the batch goes on. Started again on the same output file, a batch skips what is already
there, so an interrupted run (Ctrl+C, kill, power loss) resumes without duplicates.
"""

from __future__ import annotations

import codecs
import json
import os
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterator

from .errors import ContextFullError, EdgespecError
from .events import Stats
from .sampling import SamplingConfig, SamplingError, make_sampling

CHAT_URL, TEXT_URL = "/v1/chat/completions", "/v1/completions"
LINE_KEYS = {"custom_id", "method", "url", "body"}
# Request body fields we serve; the value check for each is in `_sampling` and `parse_line`.
BODY_KEYS = {
    "model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
    "seed", "stop", "n", "stream", "user", "frequency_penalty", "presence_penalty", "logprobs",
}
DUPLICATE = "duplicate_custom_id"
EXIT_SOME_FAILED = 4


class RequestError(Exception):
    """A request that cannot be served: becomes that request's error line."""

    def __init__(self, message: str, code: str = "invalid_request", status: int = 400):
        super().__init__(message)
        self.code, self.status = code, status


@dataclass
class Request:
    line_no: int
    custom_id: str
    url: str = CHAT_URL
    messages: list[dict] | None = None
    prompt: str | None = None
    max_tokens: int = 256
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop: list[str] = field(default_factory=list)
    model: str | None = None  # what the line asked for (the loaded model answers)
    error: RequestError | None = None  # set when the line cannot be served
    duplicate_of: int | None = None  # line number of the first line with this custom_id


@dataclass(frozen=True)
class Defaults:
    max_tokens: int = 256
    sampling: SamplingConfig = field(default_factory=SamplingConfig)


# -- input --------------------------------------------------------------------------------


def parse_line(text: str, line_no: int, defaults: Defaults) -> Request:
    """One input line -> a Request (with `error` set when it cannot be served)."""
    fallback_id = f"line-{line_no}"
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return Request(line_no, fallback_id, error=RequestError(f"line {line_no} is not valid JSON: {e.msg}",
                                                                "invalid_json"))
    if not isinstance(obj, dict):
        return Request(line_no, fallback_id, error=RequestError(f"line {line_no} is not a JSON object", "invalid_json"))
    cid = obj.get("custom_id", fallback_id)
    if not isinstance(cid, str) or not cid:
        return Request(line_no, fallback_id, error=RequestError("custom_id must be a non-empty string"))
    req = Request(line_no, cid, max_tokens=defaults.max_tokens, sampling=defaults.sampling)
    try:
        _fill(req, obj, defaults)
    except RequestError as e:
        req.error = e
    return req


def _fill(req: Request, obj: dict, defaults: Defaults) -> None:
    if "body" in obj:
        unknown = sorted(set(obj) - LINE_KEYS)
        if unknown:
            raise RequestError(f"unknown field {unknown[0]!r} (a line has custom_id, method, url, body)",
                               "unknown_field")
        method = obj.get("method", "POST")
        if method != "POST":
            raise RequestError(f"method must be POST, not {method!r}")
        body = obj["body"]
        if not isinstance(body, dict):
            raise RequestError("body must be a JSON object")
        url = obj.get("url")
        if url is None:
            url = CHAT_URL if "messages" in body else TEXT_URL
        if url not in (CHAT_URL, TEXT_URL):
            raise RequestError(f"unsupported url {url!r}: use {CHAT_URL} or {TEXT_URL}", "unsupported_url", 404)
    else:  # a bare request: {"prompt": ...} or {"messages": ...}, custom_id optional
        body = {k: v for k, v in obj.items() if k != "custom_id"}
        if "messages" in body:
            url = CHAT_URL
        elif "prompt" in body:
            url = TEXT_URL
        else:
            raise RequestError("a line needs a body, or messages or prompt")
    unknown = sorted(set(body) - BODY_KEYS)
    if unknown:
        raise RequestError(f"unknown field {unknown[0]!r} in body", "unknown_field")
    req.url = url
    if url == CHAT_URL:
        if "prompt" in body:
            raise RequestError(f"{CHAT_URL} takes messages, not prompt")
        req.messages = _messages(body.get("messages"))
    else:
        if "messages" in body:
            raise RequestError(f"{TEXT_URL} takes prompt, not messages")
        req.prompt = _prompt(body.get("prompt"))
    mt = body.get("max_completion_tokens", body.get("max_tokens", defaults.max_tokens))
    if mt is None:
        mt = defaults.max_tokens
    if not _is_int(mt) or mt < 1:
        raise RequestError("max_tokens must be a positive integer")
    req.max_tokens = mt
    req.sampling = _sampling(body, defaults.sampling)
    req.stop = _stop(body.get("stop"))
    if body.get("n", 1) != 1:
        raise RequestError("only n=1 is supported", "unsupported")
    if body.get("stream", False):
        raise RequestError("stream is not supported in a batch", "unsupported")
    if body.get("logprobs"):
        raise RequestError("logprobs are not supported", "unsupported")
    for k in ("frequency_penalty", "presence_penalty"):
        if body.get(k, 0) not in (0, 0.0, None):
            raise RequestError(f"{k} is not supported (it would change the model's distribution)", "unsupported")
    if "model" in body and not isinstance(body["model"], str):
        raise RequestError("model must be a string")
    req.model = body.get("model")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _messages(msgs: Any) -> list[dict]:
    if not isinstance(msgs, list) or not msgs:
        raise RequestError("messages must be a non-empty list")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise RequestError(f"messages[{i}] needs role and content")
        role, content = m["role"], m["content"]
        if role not in ("system", "developer", "user", "assistant"):
            raise RequestError(f"messages[{i}].role {role!r} is not supported")
        if isinstance(content, list):  # content parts: text only
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise RequestError(f"messages[{i}].content: only text parts are supported")
                texts.append(part["text"])
            content = "".join(texts)
        if not isinstance(content, str):
            raise RequestError(f"messages[{i}].content must be a string")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


def _prompt(p: Any) -> str:
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
        p = p[0]
    if not isinstance(p, str):
        raise RequestError("prompt must be a string")
    if not p:
        raise RequestError("prompt is empty")
    return p


def _sampling(body: dict, d: SamplingConfig) -> SamplingConfig:
    """The request's sampling settings over the command line's; `seed` -1 is a random seed."""

    def get(key: str, default):
        v = body.get(key, default)
        return default if v is None else v

    try:
        return make_sampling(get("temperature", d.temp), get("top_k", d.top_k), get("top_p", d.top_p),
                             get("min_p", d.min_p), body.get("seed", d.seed))
    except SamplingError as e:
        raise RequestError(str(e)) from None


def _stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise RequestError("stop must be a non-empty string or a list of up to 4 of them")
    return stop


def read_requests(lines: list[str], defaults: Defaults) -> list[Request]:
    """Parse every non-blank line; later lines that repeat a custom_id are marked duplicates."""
    out: list[Request] = []
    first: dict[str, int] = {}
    for i, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        req = parse_line(text, i, defaults)
        if req.custom_id in first:
            req.duplicate_of = first[req.custom_id]
            req.error = RequestError(
                f"custom_id {req.custom_id!r} was already used on line {req.duplicate_of}; not run twice", DUPLICATE
            )
        else:
            first[req.custom_id] = i
        out.append(req)
    return out


# -- output -------------------------------------------------------------------------------


def ok_record(req: Request, text: str, finish: str, st: Stats, model: str, method: str, drafter: str) -> dict:
    created = int(time.time())
    n_out = st.n_generated
    if req.url == CHAT_URL:
        body = {
            "id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                         "finish_reason": finish}],
        }
    else:
        body = {
            "id": f"cmpl-{uuid.uuid4().hex[:24]}", "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
        }
    body["usage"] = {"prompt_tokens": st.n_prompt, "completion_tokens": n_out, "total_tokens": st.n_prompt + n_out}
    body["speculative"] = {
        "method": method, "drafter": drafter, "steps": st.n_steps, "drafted_tokens": st.n_drafted,
        "accepted_tokens": st.n_accept, "acceptance_rate": round(st.acceptance_rate, 4),
        "mean_accepted_length": round(st.mean_accepted_length, 4), "tokens_per_s": round(st.tokens_per_s, 2),
        "prompt_s": round(st.t_prompt, 4), "generation_s": round(st.t_gen, 4),
    }
    return {"id": f"batch_req_{uuid.uuid4().hex[:24]}", "custom_id": req.custom_id,
            "response": {"status_code": 200, "request_id": body["id"], "body": body}, "error": None}


def error_record(req: Request, err: RequestError) -> dict:
    return {
        "id": f"batch_req_{uuid.uuid4().hex[:24]}", "custom_id": req.custom_id,
        "response": {"status_code": err.status, "request_id": None,
                     "body": {"error": {"message": str(err), "type": "invalid_request_error" if err.status < 500
                                        else "server_error", "param": None, "code": err.code}}},
        "error": {"code": err.code, "message": str(err), "line": req.line_no},
    }


class Writer:
    """Appends one JSON line per result with a single write, then flushes it to disk. The file is
    locked before anything in it changes: `--overwrite` never truncates a file that another live
    batch is writing."""

    def __init__(self, path: str, overwrite: bool = False):
        self.path = path
        if path == "-":
            self.fd = sys.stdout.fileno()
            self.sync = False
            return
        try:
            self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError as e:
            raise EdgespecError(f"cannot open output {path}: {e.strerror}") from None
        self.sync = True
        try:  # two runs appending to one file would run requests twice
            import fcntl

            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except ImportError:  # pragma: no cover - no flock on this platform
            pass
        except OSError:
            os.close(self.fd)
            raise EdgespecError(
                f"another edgespec batch is writing {path}; wait for it or choose another -o") from None
        if overwrite:
            os.ftruncate(self.fd, 0)

    def write(self, rec: dict) -> None:
        try:
            data = (json.dumps(rec, ensure_ascii=False) + "\n").encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate from the input (a custom_id): keep it escaped
            data = (json.dumps(rec) + "\n").encode("ascii")
        view = memoryview(data)
        while view:
            n = os.write(self.fd, view)
            view = view[n:]
        if self.sync:
            os.fsync(self.fd)

    def close(self) -> None:
        if self.path != "-":
            os.close(self.fd)


@dataclass
class Done:
    """What an existing output file already holds."""

    ids: set = field(default_factory=set)  # custom_ids with a result (ok or failed)
    duplicates: Counter = field(default_factory=Counter)  # duplicate-id error lines per custom_id
    lines: int = 0
    repaired: int = 0  # bytes of a torn last line removed
    failed: int = 0  # lines of requests that failed in serving (5xx), kept or removed for a retry
    restored: bool = False  # an interrupted --retry-failed rewrite was undone from its backup


def scan_output(path: str, retry_failed: bool = False) -> Done:
    """Read what an earlier run wrote; cut a last line torn by a kill so appends stay valid.

    Requests that failed in serving (status 5xx: `failed`) count as done, as every other line,
    unless `retry_failed`: then their lines are removed from the file, so that their new results
    take their place and every request keeps exactly one line. The rewrite keeps a backup until
    it is on disk; a run that finds a backup (the rewrite was interrupted) restores it first.
    Call it with the output locked (`Writer`)."""
    done = Done()
    backup = f"{path}.retry-backup"
    try:
        if os.path.exists(backup):
            _copy_over(backup, path)
            os.unlink(backup)
            done.restored = True
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return done
    except OSError as e:
        raise EdgespecError(f"cannot read output {path}: {e.strerror}") from None
    end = data.rfind(b"\n") + 1
    if end < len(data):
        done.repaired = len(data) - end
        with open(path, "r+b") as f:
            f.truncate(end)
    kept: list[bytes] = []
    for n, raw in enumerate(data[:end].splitlines(keepends=True), start=1):
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw)
            cid = rec["custom_id"]
            err = rec.get("error") or {}
            status = (rec.get("response") or {}).get("status_code")
        except (ValueError, KeyError, TypeError, AttributeError):
            raise EdgespecError(f"{path} line {n} is not a batch result; give another -o or --overwrite") from None
        if isinstance(err, dict) and err.get("code") == DUPLICATE:
            done.duplicates[cid] += 1
        elif isinstance(status, int) and status >= 500:
            done.failed += 1
            if retry_failed:
                continue
            done.ids.add(cid)
        else:
            done.ids.add(cid)
        kept.append(raw)
        done.lines += 1
    if retry_failed and done.failed:
        _rewrite(path, backup, b"".join(kept))
    return done


def _copy_over(src: str, dst: str) -> None:
    with open(src, "rb") as f:
        _write_in_place(dst, f.read())


def _write_in_place(path: str, data: bytes) -> None:
    """Replace the file's content through the same inode (the lock is on it, not on the name)."""
    with open(path, "r+b") as f:
        f.write(data)
        f.truncate(len(data))
        f.flush()
        os.fsync(f.fileno())


def _rewrite(path: str, backup: str, data: bytes) -> None:
    with open(path, "rb") as f, open(backup, "wb") as b:
        b.write(f.read())
        b.flush()
        os.fsync(b.fileno())
    _write_in_place(path, data)
    os.unlink(backup)


def pending_requests(reqs: list[Request], done: Done) -> list[Request]:
    """The requests an earlier run did not finish (each custom_id at most once, duplicates by count)."""
    dup_seen: Counter = Counter()
    todo = []
    for r in reqs:
        if r.duplicate_of is not None:
            dup_seen[r.custom_id] += 1
            if dup_seen[r.custom_id] <= done.duplicates[r.custom_id]:
                continue
        elif r.custom_id in done.ids:
            continue
        todo.append(r)
    return todo


# -- stop strings -------------------------------------------------------------------------


class TextTracker:
    """Generated text so far, cut at the first stop string."""

    def __init__(self, model, stops: list[str]):
        self.model = model
        self.stops = stops
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""
        self.hit = False
        self._longest = max((len(s) for s in stops), default=0)

    def feed(self, tokens) -> bool:
        """Add tokens; True when a stop string has appeared (the text is cut before it)."""
        if self.hit:
            return True
        start = max(0, len(self.text) - self._longest)
        self.text += self._dec.decode(b"".join(self.model.piece(t) for t in tokens))
        for s in self.stops:
            i = self.text.find(s, start)
            if i >= 0:
                self.text = self.text[:i]
                self.hit = True
        return self.hit

    def final(self) -> str:
        if not self.hit:
            self.text += self._dec.decode(b"", final=True)
        return self.text


# -- the run ------------------------------------------------------------------------------


@dataclass
class Totals:
    ok: int = 0
    failed: int = 0
    tokens_in: int = 0
    tokens_out: int = 0
    drafted: int = 0
    accepted: int = 0
    steps: int = 0
    t_prompt: float = 0.0  # prompt processing, summed (it runs one request at a time)
    wall: float = 0.0
    outputs: dict = field(default_factory=dict)  # custom_id -> generated token ids

    def add(self, st: Stats) -> None:
        self.ok += 1
        self.tokens_in += st.n_prompt
        self.tokens_out += st.n_generated
        self.drafted += st.n_drafted
        self.accepted += st.n_accept
        self.steps += st.n_steps
        self.t_prompt += st.t_prompt

    @property
    def throughput(self) -> float:
        return self.tokens_out / self.wall if self.wall > 0 else 0.0

    @property
    def decode_throughput(self) -> float:
        """Generated tokens per second of wall time outside prompt processing."""
        t = self.wall - self.t_prompt
        return self.tokens_out / t if t > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "requests": self.ok + self.failed, "ok": self.ok, "failed": self.failed, "tokens_in": self.tokens_in,
            "tokens_out": self.tokens_out, "wall_s": round(self.wall, 3), "tokens_per_s": round(self.throughput, 2),
            "prompt_s": round(self.t_prompt, 3), "decode_tokens_per_s": round(self.decode_throughput, 2),
            "drafted": self.drafted, "accepted": self.accepted,
            "acceptance_rate": round(self.accepted / self.drafted, 4) if self.drafted else 0.0,
            "mean_accepted_length": round(self.tokens_out / self.steps, 4) if self.steps else 0.0,
        }


def failure(e: BaseException) -> RequestError:
    """The error line of a request whose serving raised `e`."""
    if isinstance(e, ContextFullError):
        return RequestError(str(e), "context_length_exceeded", 400)
    if isinstance(e, EdgespecError):
        return RequestError(str(e), "failed", 500)
    return RequestError(f"internal error while serving this request: {type(e).__name__}: {e}", "failed", 500)


def _finish_reason(st: Stats, tracker: TextTracker) -> str:
    if tracker.hit or st.finish_reason == "stop":
        return "stop"
    return "length"


def run_requests(engine, reqs: list[Request], method: str, n_parallel: int, emit, on_step=None,
                 quiet: bool = False, totals: Totals | None = None) -> Totals:
    """Serve `reqs`; `emit(req, record)` receives every result as soon as it is complete.
    `totals` (filled as results come) keeps the count when the run is interrupted."""
    totals = totals if totals is not None else Totals()
    model_name = engine.cfg.model
    t0 = time.perf_counter()

    def fail(req: Request, err: RequestError) -> None:
        totals.failed += 1
        emit(req, error_record(req, err))

    def tokens_of(req: Request) -> list[int] | None:
        """The request's prompt tokens, or None after writing its error line."""
        if req.error:
            fail(req, req.error)
            return None
        try:
            if req.url == CHAT_URL:
                return engine.prompt_tokens(messages=req.messages)
            return engine.prompt_tokens(req.prompt, raw=True)
        except EdgespecError as e:
            fail(req, RequestError(str(e)))
        except UnicodeEncodeError:
            fail(req, RequestError("the prompt is not valid Unicode text (a lone surrogate such as \\ud800)"))
        except Exception as e:  # one request never ends the batch
            fail(req, failure(e))
        return None

    def finished(req: Request, tokens: list[int], st: Stats, tracker: TextTracker, drafter: str) -> None:
        totals.add(st)
        totals.outputs[req.custom_id] = list(tokens)
        emit(req, ok_record(req, tracker.final(), _finish_reason(st, tracker), st, model_name, method, drafter))

    try:
        if n_parallel <= 1:
            share = _OneByOne(engine, method)
            try:
                _serve_one_by_one(engine, reqs, method, share, fail, tokens_of, finished, on_step)
            finally:
                share.close()
            return totals
        from .multi import Job, MultiDecoder

        dec = MultiDecoder(engine, n_parallel, method, quiet=quiet)
        trackers: dict[int, TextTracker] = {}

        def jobs() -> Iterator[Job]:
            for req in reqs:
                prompt = tokens_of(req)
                if prompt is not None:
                    yield Job(prompt, req.max_tokens, req.sampling, tag=req)

        events = dec.run(jobs())
        try:
            for kind, g, x in events:
                if kind == "step":
                    tr = trackers.get(id(g))
                    if tr is None:
                        tr = trackers[id(g)] = TextTracker(engine.target, g.job.tag.stop)
                    if on_step:
                        on_step(x)
                    if tr.feed(x.tokens):
                        g.stop()
                elif kind == "done":
                    tr = trackers.pop(id(g))
                    finished(g.job.tag, g.tokens, g.stats, tr, g.drafter.name)
                else:
                    fail(g.tag, failure(x))
        finally:
            events.close()  # frees the slots (their KV cells) before the context goes
            dec.close()
        return totals
    finally:
        totals.wall = time.perf_counter() - t0


def _read_input(path: str) -> list[str]:
    if path == "-":
        if sys.stdin is None:
            raise EdgespecError("no input: standard input is closed")
        return sys.stdin.read().splitlines()
    try:
        with open(path, encoding="utf-8-sig") as f:
            return f.read().splitlines()
    except FileNotFoundError:
        raise EdgespecError(f"input file not found: {path}") from None
    except IsADirectoryError:
        raise EdgespecError(f"input is a directory, not a JSONL file: {path}") from None
    except UnicodeDecodeError as e:
        raise EdgespecError(f"input {path} is not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise EdgespecError(f"cannot read input {path}: {e.strerror}") from None


def run_batch(a, engine_cfg) -> int:
    """The `edgespec batch` command (arguments already validated by the CLI)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from .bench import _stderr_console
    from .runner import Engine

    if a.output != "-" and a.input != "-" and os.path.abspath(a.input) == os.path.abspath(a.output):
        raise EdgespecError("the output file must not be the input file")
    defaults = Defaults(a.n_predict, make_sampling(a.temp, a.top_k, a.top_p, a.min_p, a.seed))
    reqs = read_requests(_read_input(a.input), defaults)
    if not reqs:
        raise EdgespecError(f"no requests in {a.input}")
    dups = [r for r in reqs if r.duplicate_of is not None]
    if dups:
        shown = ", ".join(f"{r.custom_id!r} (line {r.line_no}, first on line {r.duplicate_of})" for r in dups[:5])
        print(f"edgespec: {len(dups)} duplicate custom_id(s), reported as errors and not run: {shown}"
              + (" ..." if len(dups) > 5 else ""), file=sys.stderr)
    asked = sorted({r.model for r in reqs if r.model and r.error is None and r.model != engine_cfg.model})
    if asked:
        print(f"edgespec: requests name model {', '.join(map(repr, asked[:3]))}{' ...' if len(asked) > 3 else ''}; "
              f"{engine_cfg.model} answers them all (choose the model with -m)", file=sys.stderr)
    writer = Writer(a.output, overwrite=a.overwrite)  # locked before reading what it holds
    done = Done()
    if a.output != "-" and not a.overwrite:
        try:
            done = scan_output(a.output, retry_failed=a.retry_failed)
        except EdgespecError:
            writer.close()
            raise
        if done.restored:
            print(f"edgespec: {a.output}: restored from {a.output}.retry-backup (an earlier --retry-failed was "
                  "interrupted while rewriting it)", file=sys.stderr)
        if done.repaired:
            print(f"edgespec: {a.output}: removed a torn last line ({done.repaired} bytes) left by an interrupted run",
                  file=sys.stderr)
        if done.failed:
            print(f"edgespec: {a.output}: {done.failed} request(s) failed in an earlier run; "
                  + ("running them again" if a.retry_failed else "kept as they are (--retry-failed runs them again)"),
                  file=sys.stderr)
    todo = pending_requests(reqs, done)
    skipped = len(reqs) - len(todo)
    if skipped:
        print(f"edgespec: resuming {a.output}: {skipped} of {len(reqs)} requests already done", file=sys.stderr)
    if not todo:
        writer.close()
        print(f"edgespec: nothing to do: every request in {a.input} has a result in {a.output}", file=sys.stderr)
        return 0
    try:
        engine = Engine(engine_cfg, quiet=a.quiet)
    except BaseException:
        writer.close()
        raise
    show = not a.quiet and sys.stderr.isatty()
    live = {"tokens": 0, "drafted": 0, "accepted": 0, "t0": time.perf_counter(), "shown": 0.0}
    interrupted = False
    totals = Totals()
    try:
        with Progress(TextColumn("batch"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      TextColumn("{task.fields[info]}"), console=_stderr_console(), disable=not show,
                      transient=False) as prog:
            task = prog.add_task("batch", total=len(todo), info="")

            def info() -> str:
                dt = time.perf_counter() - live["t0"]
                acc = f", accepted {100 * live['accepted'] / live['drafted']:.0f}%" if live["drafted"] else ""
                return f"{live['tokens'] / dt if dt > 0 else 0:.1f} tok/s{acc}"

            def on_step(ev) -> None:
                live["tokens"] += len(ev.tokens)
                live["drafted"] += ev.n_drafted
                live["accepted"] += ev.n_accept
                now = time.perf_counter()
                if show and now - live["shown"] > 0.5:
                    live["shown"] = now
                    prog.update(task, info=info())

            def emit(req: Request, rec: dict) -> None:
                writer.write(rec)
                prog.update(task, advance=1, info=info())

            try:
                run_requests(engine, todo, a.spec, a.parallel, emit, on_step, totals=totals)
            except KeyboardInterrupt:
                interrupted = True
    finally:
        writer.close()
    summary = {"input": a.input, "output": a.output, "skipped_as_done": skipped, "parallel": a.parallel,
               "method": a.spec, **totals.to_dict()}
    lines = [
        f"batch: {summary['requests']} requests ({totals.ok} ok, {totals.failed} failed"
        + (f", {skipped} already done" if skipped else "")
        + (f", {len(todo) - totals.ok - totals.failed} not run: interrupted" if interrupted else "")
        + f"), -np {a.parallel}, --spec {a.spec}",
        f"tokens: {totals.tokens_in} in, {totals.tokens_out} out; wall {totals.wall:.1f} s "
        f"({totals.t_prompt:.1f} s reading prompts); {totals.throughput:.1f} tokens/s out, "
        f"{totals.decode_throughput:.1f} while generating",
    ]
    if totals.drafted:
        lines.append(f"speculation: drafted {totals.drafted}, accepted {totals.accepted} "
                     f"({100 * totals.accepted / totals.drafted:.1f}%), mean accepted length "
                     f"{summary['mean_accepted_length']:.2f} tokens per step")
    if interrupted:
        engine.close()
        for line in lines:
            print(line, file=sys.stderr)
        print(f"edgespec: interrupted; finished results are in {a.output}; the same command resumes", file=sys.stderr)
        return 130
    if a.compare:
        base = _compare(engine, todo, a, totals)
        summary["compare"] = base
        lines.append(f"compare: --spec none -np {a.parallel} on the same requests: {base['tokens_per_s']:.1f} tokens/s "
                     f"out in {base['wall_s']:.1f} s; speedup {base['speedup']:.2f}x"
                     + (f"; greedy outputs identical {base['identical']}/{base['greedy']}" if base["greedy"] else ""))
    engine.close()
    for line in lines:
        print(line, file=sys.stderr)
    if a.stats:
        try:
            with open(a.stats, "w") as f:
                json.dump(summary, f, indent=1)
        except OSError as e:
            raise EdgespecError(f"cannot write {a.stats}: {e.strerror}") from None
    if a.compare and summary["compare"]["identical"] < summary["compare"]["greedy"]:
        print("edgespec: error: speculative greedy outputs differ from plain decoding", file=sys.stderr)
        return 3
    return EXIT_SOME_FAILED if totals.failed else 0


def _compare(engine, todo: list[Request], a, spec: Totals) -> dict:
    """The same requests again without speculation (results not written)."""
    print(f"edgespec: --compare: running the {len(todo)} requests again with --spec none", file=sys.stderr)
    base = run_requests(engine, todo, "none", a.parallel, lambda req, rec: None, quiet=True)
    greedy = [r.custom_id for r in todo if r.error is None and r.sampling.greedy and r.custom_id in base.outputs]
    same = sum(1 for c in greedy if spec.outputs.get(c) == base.outputs[c])
    d = base.to_dict()
    d["speedup"] = round(spec.throughput / base.throughput, 3) if base.throughput > 0 else 0.0
    d["greedy"], d["identical"] = len(greedy), same
    return d


class _OneByOne:
    """Starts each request's generation (`-np 1`); lookahead requests share one trie."""

    def __init__(self, engine, method: str):
        from .drafters.lookahead import SharedLookahead

        self.engine, self.method = engine, method
        self.shared = SharedLookahead(engine.cfg.lookahead_cache) if method in ("lookahead", "auto") else None

    def start(self, prompt: list[int], req: Request):
        from .drafters import ChainDrafter

        eng = self.engine
        if self.shared is None:
            return eng.start(prompt, req.max_tokens, req.sampling, self.method)
        drafter = self.shared.drafter(eng.cfg.max_branches)
        if self.method == "auto" and eng.draft_model is not None:
            drafter = ChainDrafter([drafter, eng.make_drafter("draft", req.sampling.seed)])
        return eng.generate(prompt, req.max_tokens, req.sampling, drafter)

    def close(self) -> None:
        if self.shared is not None:
            self.shared.close()


def _serve_one_by_one(engine, reqs, method, share, fail, tokens_of, finished, on_step) -> None:
    for req in reqs:
        prompt = tokens_of(req)
        if prompt is None:
            continue
        try:
            gen = share.start(prompt, req)
            tracker = TextTracker(engine.target, req.stop)
            steps = iter(gen)
            try:
                for ev in steps:
                    if on_step:
                        on_step(ev)
                    if tracker.feed(ev.tokens):
                        break
            finally:
                steps.close()
        except Exception as e:  # one request never ends the batch: it gets its error line
            fail(req, failure(e))
            continue
        drafter = getattr(getattr(gen, "drafter", None), "name", method)
        finished(req, gen.tokens, gen.stats, tracker, drafter)
