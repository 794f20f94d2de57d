"""What the serving loop hands on for a request: its result record (OpenAI's batch-output shape,
whose `response.body` a server answers with), its error record, the error a failure in serving
gets, and OpenAI's logprobs objects."""

from __future__ import annotations

import math
import time
import uuid

from ..errors import ContextFullError, EdgespecError
from ..events import Stats
from .requests import Request
from .schema import CHAT_URL, RequestError


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
            from ..tools import parse_calls

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


def failure(e: BaseException) -> RequestError:
    """The error line of a request whose serving raised `e`."""
    if isinstance(e, ContextFullError):
        return RequestError(str(e), "context_length_exceeded", 400)
    from ..rows import GrammarError

    if isinstance(e, GrammarError):
        return RequestError(str(e), "invalid_grammar", 400)
    if isinstance(e, EdgespecError):
        return RequestError(str(e), "failed", 500)
    return RequestError(f"internal error while serving this request: {type(e).__name__}: {e}", "failed", 500)
