"""The output file of `edgespec batch`: result and error records, the locked writer, and what
a resumed run finds already done."""

from __future__ import annotations

import json
import math
import os
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field

from ...errors import ContextFullError, EdgespecError
from ...events import Stats
from .requests import CHAT_URL, DUPLICATE, Request, RequestError

def _finite(x: float) -> float:
    return x if math.isfinite(x) else -9999.0  # JSON has no -Infinity


def logprobs_body(target, entries: list[tuple], chat: bool, offset: int = 0) -> dict:
    """OpenAI's logprobs object for (token, logprob, ((token, logprob), ...)) entries: chat's
    `content` list, or completions' parallel lists (`offset`: characters of text before them)."""

    def piece(t: int) -> bytes:
        return target.piece(t)

    if chat:
        def one(t, lp):
            b = piece(t)
            return {"token": b.decode("utf-8", "replace"), "logprob": _finite(lp), "bytes": list(b)}

        return {"content": [{**one(t, lp), "top_logprobs": [one(u, v) for u, v in top]} for t, lp, top in entries],
                "refusal": None}
    toks, lps, tops, offsets = [], [], [], []
    for t, lp, top in entries:
        s = piece(t).decode("utf-8", "replace")
        toks.append(s)
        lps.append(_finite(lp))
        tops.append({piece(u).decode("utf-8", "replace"): _finite(v) for u, v in top})
        offsets.append(offset)
        offset += len(s)
    return {"tokens": toks, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def echo_logprobs(target, prompt: str, lp: dict) -> dict:
    """Completions' logprobs with `echo`: the prompt's tokens first, their logprobs null (the
    prompt is read, not sampled: edgespec does not score it), then the completion's."""
    toks = target.tokenize(prompt, add_special=False, parse_special=False)
    pieces = [target.piece(t).decode("utf-8", "replace") for t in toks]
    offsets, pos = [], 0
    for s in pieces:
        offsets.append(pos)
        pos += len(s)
    return {"tokens": pieces + lp["tokens"], "token_logprobs": [None] * len(toks) + lp["token_logprobs"],
            "top_logprobs": [None] * len(toks) + lp["top_logprobs"], "text_offset": offsets + lp["text_offset"]}


def ok_record(req: Request, text: str, finish: str, st: Stats, model: str, method: str, drafter: str,
              logprobs: dict | None = None) -> dict:
    created = int(time.time())
    n_out = st.n_generated
    if req.url == CHAT_URL:
        message = {"role": "assistant", "content": text}
        if req.tool_names:
            from ...tools import parse_calls

            rest, calls = parse_calls(text, req.tool_names)
            if calls:
                message = {"role": "assistant", "content": rest.strip() or None, "tool_calls": calls}
                if finish == "stop":
                    finish = "tool_calls"
        body = {
            "id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish}],
        }
    else:
        if req.echo:
            text = (req.prompt or "") + text
        body = {
            "id": f"cmpl-{uuid.uuid4().hex[:24]}", "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}],
        }
    body["usage"] = {"prompt_tokens": st.n_prompt, "completion_tokens": n_out, "total_tokens": st.n_prompt + n_out,
                     "prompt_tokens_details": {"cached_tokens": st.n_prompt_cached}}
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


def failure(e: BaseException) -> RequestError:
    """The error line of a request whose serving raised `e`."""
    if isinstance(e, ContextFullError):
        return RequestError(str(e), "context_length_exceeded", 400)
    from ...rows import GrammarError

    if isinstance(e, GrammarError):
        return RequestError(str(e), "invalid_grammar", 400)
    if isinstance(e, EdgespecError):
        return RequestError(str(e), "failed", 500)
    return RequestError(f"internal error while serving this request: {type(e).__name__}: {e}", "failed", 500)
