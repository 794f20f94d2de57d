"""Requests of `edgespec batch` (OpenAI batch format): one input line -> a Request, or the error
that line gets. The same schema and validation serve the server's request bodies."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ...sampling import SamplingConfig, SamplingError, make_sampling

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
