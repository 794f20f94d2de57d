"""Requests of `edgespec batch` (OpenAI batch format): one input line -> a Request, or the error
that line gets. A line's body is checked by the one schema of batch and serve (edgespec.serving)."""

from __future__ import annotations

import json

from ...serving.requests import Defaults, Request, fill_from_body
from ...serving.schema import CHAT_URL, TEXT_URL, RequestError

LINE_KEYS = {"custom_id", "method", "url", "body"}
DUPLICATE = "duplicate_custom_id"
EXIT_SOME_FAILED = 4


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
    fill_from_body(req, url, body, defaults)


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
