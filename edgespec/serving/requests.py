"""A request as the serving loop takes it (from a batch line or an HTTP body): its prompt,
sampling, stop strings, choices and what a server attaches to it (sink, cancellation, share);
the one place a validated body (schema.py) fills it, and its prompt tokens through the model's
template."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..sampling import SamplingConfig
from .schema import CHAT_URL, RequestError, body_max_tokens, body_sampling, parse_body

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
    stream: bool = False  # serve: answer with server-sent events
    include_usage: bool = False  # serve: stream_options.include_usage
    n: int = 1  # choices: that many sequences, one record with n choices
    index: int = 0  # a choice of a request with n > 1 (loop.expand_choices)
    parent: Any = None  # ... and that request
    cancelled: bool = False  # serve: the client went away; the scheduler stops the sequence
    sink: Any = None  # serve: where the request's text and result go
    tokens: list[int] | None = None  # serve: the prompt, tokenized when the request came
    error: RequestError | None = None  # set when the line cannot be served
    duplicate_of: int | None = None  # line number of the first line with this custom_id
    # requests with the same `share` draft from one lookahead trie (they learn from each other's
    # text); None: a trie of this request's own (serve without a key: users are not told apart)
    share: str | None = ""
    echo: bool = False  # completions: the prompt before the completion
    suffix: str | None = None  # completions: fill-in-the-middle, the text after the completion
    tools: list[dict] | None = None  # chat: the tools offered to the model (edgespec.tools)
    tool_names: frozenset | None = None  # ... whose calls are parsed out of the answer


@dataclass(frozen=True)
class Defaults:
    max_tokens: int = 256
    sampling: SamplingConfig = field(default_factory=SamplingConfig)


def fill_from_body(req: Request, url: str, body: dict, defaults: Defaults, allow_stream: bool = False) -> None:
    """Validate `body` (the one schema of batch and serve) and fill the request from it."""
    b = parse_body(url, body, allow_stream)
    req.url = url
    if url == CHAT_URL:
        req.messages = [m.as_dict() for m in b.messages]
        req.tools = b.offered_tools
        req.tool_names = frozenset(t["function"]["name"] for t in req.tools) if req.tools else None
    else:
        req.prompt = b.prompt
        req.echo = bool(b.echo)
        req.suffix = b.suffix or None
    req.max_tokens = body_max_tokens(b, defaults.max_tokens)
    req.sampling = body_sampling(b, defaults.sampling)
    req.stop = b.stops
    req.model = b.model
    req.stream = bool(b.stream)
    req.include_usage = bool(b.stream_options and b.stream_options.include_usage)
    req.n = b.n or 1


def prompt_of(engine, req: Request) -> list[int]:
    """A request's prompt tokens: chat messages (and tools) through the model's template; a
    completion's prompt as is, or with `suffix` in the model's fill-in-the-middle tokens
    (RequestError when its vocabulary has none)."""
    if req.url == CHAT_URL:
        return engine.prompt_tokens(messages=req.messages, tools=req.tools)
    if req.suffix is not None:
        fim = engine.target.fim_tokens
        if fim is None:
            raise RequestError("suffix (fill-in-the-middle) needs a model whose vocabulary has fill-in-the-middle "
                               "tokens (<|fim_prefix|>, <|fim_suffix|>, <|fim_middle|>, as Qwen2.5-Coder's); "
                               "this model's has none", "unsupported")
        return engine.infill_tokens(req.prompt, req.suffix)
    return engine.prompt_tokens(req.prompt, raw=True)
