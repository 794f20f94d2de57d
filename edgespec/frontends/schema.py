"""The request bodies edgespec serves, declared once (pydantic) for `edgespec batch` lines and
`edgespec serve` requests: the two accept and refuse exactly the same bodies (except `stream`,
which only a server can answer). Ranges of the sampling fields are checked by `make_sampling`,
the same check the command line's flags get.

`parse_body(url, body, defaults, allow_stream)` returns a `Body` or raises `RequestError` with
one clear message, an error code and an HTTP status (OpenAI's error shape)."""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError
from pydantic import model_validator
from pydantic_core import PydanticCustomError

from ..rows import GrammarError, json_object_grammar, json_schema_grammar
from ..sampling import MAX_TOP_LOGPROBS, SamplingConfig, SamplingError, make_sampling

CHAT_URL, TEXT_URL = "/v1/chat/completions", "/v1/completions"
ROLES = ("system", "developer", "user", "assistant")
MAX_STOPS = 16
MAX_N = 16  # choices per request (each its own sequence)
# Fields clients send that change nothing here: accepted and ignored (docs/serving.md, serve section).
IGNORED = ("store", "metadata", "service_tier", "parallel_tool_calls", "reasoning_effort", "user")

Number = Union[StrictInt, StrictFloat]


class RequestError(Exception):
    """A request that cannot be served: a batch line's error record, a server's 4xx/5xx."""

    def __init__(self, message: str, code: str = "invalid_request", status: int = 400):
        super().__init__(message)
        self.code, self.status = code, status


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: StrictStr


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[StrictStr, list[TextPart]]
    name: StrictStr | None = None

    def as_dict(self) -> dict:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: StrictBool = False


class JsonSchema(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: StrictStr | None = None
    description: StrictStr | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None

    @model_validator(mode="after")
    def _schema(self):
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise PydanticCustomError("invalid_request", "response_format json_schema needs json_schema.schema")
        return self


class _Body(BaseModel):
    """Fields both endpoints take. Unknown fields are refused: a field we would silently ignore
    could change what the caller expects (tools, ...); those in IGNORED change nothing here."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: StrictStr | None = None
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None
    min_p: Number | None = None
    seed: StrictInt | None = None
    stop: Union[StrictStr, list[StrictStr], None] = None
    n: StrictInt | None = None
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    frequency_penalty: Number | None = None
    presence_penalty: Number | None = None
    logit_bias: dict[str, Number] | None = None
    logprobs: Union[StrictBool, StrictInt, None] = None
    response_format: ResponseFormat | None = None
    # accepted and ignored (IGNORED)
    store: StrictBool | None = None
    metadata: dict[str, StrictStr] | None = None
    service_tier: StrictStr | None = None
    parallel_tool_calls: StrictBool | None = None
    reasoning_effort: StrictStr | None = None
    tools: list[dict] | None = None
    tool_choice: Union[StrictStr, dict, None] = None

    @model_validator(mode="after")
    def _supported(self):
        if self.n is not None and not 1 <= self.n <= MAX_N:
            raise PydanticCustomError("invalid_request", f"n must be an integer from 1 to {MAX_N}")
        if (self.n or 1) > 1 and self.stream:
            raise PydanticCustomError("unsupported", "n > 1 is not streamed yet: send stream false")
        if self.tools:
            raise PydanticCustomError("unsupported", "tools are not supported yet (an empty list or null is accepted)")
        if self.tool_choice not in (None, "none", "auto"):
            raise PydanticCustomError("unsupported", "tool_choice needs tools, which are not supported yet "
                                                     "(null, \"none\" and \"auto\" are accepted)")
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        if stops is not None and (len(stops) > MAX_STOPS or not all(stops)):
            raise PydanticCustomError("invalid_request",
                                      f"stop must be a non-empty string or a list of up to {MAX_STOPS} of them")
        return self

    @property
    def top_logprobs_n(self) -> int | None:
        """How many alternatives to report per token (0: the chosen token's only), None: none."""
        return None

    @property
    def stops(self) -> list[str]:
        return [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatBody(_Body):
    messages: list[Message] = Field(min_length=1)
    top_logprobs: StrictInt | None = None

    @model_validator(mode="after")
    def _logprobs(self):
        if self.logprobs is not None and not isinstance(self.logprobs, bool):
            raise PydanticCustomError("invalid_request", "logprobs must be true or false (top_logprobs: how many)")
        if self.top_logprobs is not None:
            if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
                raise PydanticCustomError("invalid_request", f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}]")
            if not self.logprobs:
                raise PydanticCustomError("invalid_request", "top_logprobs needs logprobs: true")
        return self

    @property
    def top_logprobs_n(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionBody(_Body):
    prompt: Union[StrictStr, list[StrictStr]]

    @model_validator(mode="after")
    def _one_prompt(self):
        p = self.prompt
        if isinstance(p, list):
            if len(p) != 1:
                raise PydanticCustomError("invalid_request", "prompt must be a string (or a list of one string)")
            self.prompt = p[0]
        if not self.prompt:
            raise PydanticCustomError("invalid_request", "prompt is empty")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            raise PydanticCustomError("invalid_request", f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}]")
        return self

    @property
    def top_logprobs_n(self) -> int | None:
        return self.logprobs


# What each field must be, for the one-line message a wrong value gets.
_RULES = {
    "model": "must be a string",
    "max_tokens": "must be a positive integer",
    "max_completion_tokens": "must be a positive integer",
    "temperature": "must be a number in [0, 2]",
    "top_p": "must be a number in (0, 1] (1: off)",
    "top_k": "must be a non-negative integer (0: off)",
    "min_p": "must be a number in [0, 1] (0: off)",
    "seed": "must be an integer, non-negative, or -1 for a random seed",
    "stop": f"must be a non-empty string or a list of up to {MAX_STOPS} of them",
    "n": "must be an integer from 1 to 16",
    "stream": "must be true or false",
    "stream_options": "must be an object {\"include_usage\": true|false}",
    "user": "must be a string",
    "frequency_penalty": "must be a number in [-2, 2]",
    "presence_penalty": "must be a number in [-2, 2]",
    "logit_bias": "must be an object of token ids to numbers in [-100, 100]",
    "logprobs": "must be true or false (chat) or an integer (completions)",
    "top_logprobs": f"must be an integer in [0, {MAX_TOP_LOGPROBS}]",
    "response_format": "must be {\"type\": \"text\"|\"json_object\"|\"json_schema\"} (json_schema: "
                       "{\"json_schema\": {\"name\": ..., \"schema\": {...}}})",
    "store": "must be true or false",
    "metadata": "must be an object of strings",
    "service_tier": "must be a string",
    "parallel_tool_calls": "must be true or false",
    "reasoning_effort": "must be a string",
    "tools": "must be a list of tools (none are supported yet: send null or [])",
    "tool_choice": "must be null, \"none\" or \"auto\" (tools are not supported yet)",
    "messages": "must be a non-empty list of {role, content}",
    "prompt": "must be a string",
}


def _message(e: dict) -> RequestError:
    """One pydantic error -> the request's one-line error."""
    kind, loc = e["type"], e["loc"]
    if kind in ("unsupported", "invalid_request"):
        return RequestError(e["msg"], kind)
    if kind == "extra_forbidden":
        where = "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in loc[:-1]).lstrip(".")
        return RequestError(f"unknown field {loc[-1]!r} in {where or 'body'}", "unknown_field")
    if not loc:
        return RequestError("the body must be a JSON object")
    field = loc[0]
    if field == "messages" and len(loc) >= 2 and isinstance(loc[1], int):
        i, rest = loc[1], loc[2:]
        if kind == "missing" or not rest:
            return RequestError(f"messages[{i}] needs role and content (a JSON object)")
        if rest[0] == "role":
            return RequestError(f"messages[{i}].role {e.get('input')!r} is not supported (one of {', '.join(ROLES)})")
        if rest[0] == "content":
            return RequestError(f"messages[{i}].content must be a string or a list of text parts "
                                "({\"type\": \"text\", \"text\": ...}); only text parts are supported")
        return RequestError(f"messages[{i}].{rest[0]} must be a string")
    if kind == "missing":
        return RequestError(f"{field} is required")
    return RequestError(f"{field} {_RULES.get(field, 'has the wrong type')}")


def parse_body(url: str, body: Any, allow_stream: bool = False) -> ChatBody | CompletionBody:
    """Validate a request body for `url` (CHAT_URL or TEXT_URL)."""
    if not isinstance(body, dict):
        raise RequestError("body must be a JSON object")
    if url == CHAT_URL and "prompt" in body:
        raise RequestError(f"{CHAT_URL} takes messages, not prompt")
    if url == TEXT_URL and "messages" in body:
        raise RequestError(f"{TEXT_URL} takes prompt, not messages")
    try:
        b = (ChatBody if url == CHAT_URL else CompletionBody).model_validate(body)
    except ValidationError as e:
        raise _message(e.errors(include_url=False)[0]) from None
    if b.stream and not allow_stream:
        raise RequestError("stream is not supported in a batch", "unsupported")
    return b


def body_sampling(b: _Body, defaults: SamplingConfig) -> SamplingConfig:
    """The body's sampling settings over the defaults (the command line's); `seed` -1 is random."""

    def get(v, d):
        return d if v is None else v

    try:
        return make_sampling(get(b.temperature, defaults.temp), get(b.top_k, defaults.top_k),
                             get(b.top_p, defaults.top_p), get(b.min_p, defaults.min_p),
                             b.seed if "seed" in b.model_fields_set else defaults.seed,
                             grammar=body_grammar(b, defaults.grammar),
                             presence_penalty=get(b.presence_penalty, defaults.presence_penalty),
                             frequency_penalty=get(b.frequency_penalty, defaults.frequency_penalty),
                             logit_bias=b.logit_bias if b.logit_bias is not None else dict(defaults.logit_bias),
                             logprobs=b.top_logprobs_n)
    except SamplingError as e:
        raise RequestError(str(e)) from None


def body_grammar(b: _Body, default: str | None) -> str | None:
    """The GBNF the body's response_format asks for (default: the command line's)."""
    rf = b.response_format
    if rf is None:
        return default
    if rf.type == "text":
        return None
    if rf.type == "json_object":
        return json_object_grammar()
    try:
        return json_schema_grammar(rf.json_schema.schema_)
    except GrammarError as e:
        raise RequestError(f"response_format: {e}", "invalid_schema") from None


def body_max_tokens(b: _Body, default: int) -> int:
    mt = b.max_completion_tokens if b.max_completion_tokens is not None else b.max_tokens
    return default if mt is None else mt
