"""The request bodies edgespec serves, declared once (pydantic) for `edgespec batch` lines and
`edgespec serve` requests: the two accept and refuse exactly the same bodies (except `stream`,
which only a server can answer). Ranges of the sampling fields are checked by `make_sampling`,
the same check the command line's flags get.

`parse_body(url, body, defaults, allow_stream)` returns a `Body` or raises `RequestError` with
one clear message, an error code and an HTTP status (OpenAI's error shape)."""

from __future__ import annotations

import json
import re
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError
from pydantic import model_validator
from pydantic_core import PydanticCustomError

from ..rows import GrammarError, json_object_grammar, json_schema_grammar
from ..sampling import MAX_TOP_LOGPROBS, SamplingConfig, SamplingError, make_sampling

CHAT_URL, TEXT_URL = "/v1/chat/completions", "/v1/completions"
ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOPS = 16
MAX_N = 16  # choices per request (each its own sequence)
# Fields clients send that change nothing here: accepted and ignored (docs/openai-compat.md).
IGNORED = ("store", "metadata", "service_tier", "reasoning_effort", "user")
# Tools: bounded (a tool's schema becomes a grammar, all of them a part of the prompt).
MAX_TOOLS = 64
MAX_TOOL_SCHEMA_BYTES = 16 * 1024  # a tool's JSON
MAX_TOOLS_BYTES = 64 * 1024  # all of them
MAX_SCHEMA_DEPTH = 16  # nesting of a tool's parameters schema
MAX_TOOL_CALLS = 64  # calls in one assistant message of the history
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")

Number = Union[StrictInt, StrictFloat]


class RequestError(Exception):
    """A request that cannot be served: a batch line's error record, a server's 4xx/5xx."""

    def __init__(self, message: str, code: str = "invalid_request", status: int = 400):
        super().__init__(message)
        self.code, self.status = code, status


class _Strict(BaseModel):
    """Every part of a body: unknown fields refused, no coercion (a "1" is not a 1)."""

    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(_Strict):
    type: Literal["text"]
    text: StrictStr


class FunctionCall(_Strict):
    name: StrictStr
    arguments: StrictStr  # a JSON text, as OpenAI sends it


class ToolCall(_Strict):
    id: StrictStr
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[StrictStr, list[TextPart], None] = None
    name: StrictStr | None = None
    tool_calls: list[ToolCall] | None = None  # assistant: the calls it made (content may then be null)
    tool_call_id: StrictStr | None = None  # tool: the call this message answers
    refusal: StrictStr | None = None  # sent back by some clients with an assistant message; ignored

    @model_validator(mode="after")
    def _tool_fields(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise PydanticCustomError("invalid_request", "a message needs content (null only in an assistant "
                                                         "message with tool_calls)")
        if self.tool_calls is not None and self.role != "assistant":
            raise PydanticCustomError("invalid_request", "only an assistant message (role assistant) has tool_calls")
        if self.tool_calls and len(self.tool_calls) > MAX_TOOL_CALLS:
            raise PydanticCustomError("invalid_request", f"an assistant message has at most {MAX_TOOL_CALLS} tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise PydanticCustomError("invalid_request", "a message with role tool needs tool_call_id")
        return self

    def as_dict(self) -> dict:
        c = self.content
        text = c if c is None or isinstance(c, str) else "".join(p.text for p in c)
        d = {"role": "system" if self.role == "developer" else self.role, "content": text}
        if self.tool_calls:
            d["tool_calls"] = [{"id": t.id, "type": "function",
                                "function": {"name": t.function.name, "arguments": t.function.arguments}}
                               for t in self.tool_calls]
        if self.role == "tool":
            d["tool_call_id"] = self.tool_call_id
            if self.name is not None:
                d["name"] = self.name
        return d


class Function(_Strict):
    name: StrictStr
    description: StrictStr | None = None
    parameters: dict | None = None
    strict: StrictBool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: Function


class NamedFunction(_Strict):
    name: StrictStr


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


def _depth(x, limit: int) -> int:
    """Nesting depth of a JSON value, counted up to `limit` + 1 (no deeper walk)."""
    if limit < 0 or not isinstance(x, (dict, list)):
        return 0
    vals = x.values() if isinstance(x, dict) else x
    return 1 + max((_depth(v, limit - 1) for v in vals), default=0)


class StreamOptions(_Strict):
    include_usage: StrictBool = False


class JsonSchema(_Strict):
    name: StrictStr | None = None
    description: StrictStr | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None

    @model_validator(mode="after")
    def _schema(self):
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise PydanticCustomError("invalid_request", "response_format json_schema needs json_schema.schema")
        return self


class _Body(_Strict):
    """Fields both endpoints take. Unknown fields are refused: a field we would silently ignore
    could change what the caller expects (tools, ...); those in IGNORED change nothing here."""
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
    reasoning_effort: StrictStr | None = None
    # tools (chat only; see edgespec.tools)
    parallel_tool_calls: StrictBool | None = None
    tools: list[Tool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None

    @model_validator(mode="after")
    def _supported(self):
        if self.n is not None and not 1 <= self.n <= MAX_N:
            raise PydanticCustomError("invalid_request", f"n must be an integer from 1 to {MAX_N}")
        self._check_tools()
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        if stops is not None and (len(stops) > MAX_STOPS or not all(stops)):
            raise PydanticCustomError("invalid_request",
                                      f"stop must be a non-empty string or a list of up to {MAX_STOPS} of them")
        return self

    def _check_tools(self) -> None:
        tools = self.tools or []
        if tools and not isinstance(self, ChatBody):
            raise PydanticCustomError("unsupported", "tools are for /v1/chat/completions")
        if len(tools) > MAX_TOOLS:
            raise PydanticCustomError("invalid_request", f"at most {MAX_TOOLS} tools are accepted")
        seen, total = set(), 0
        for i, t in enumerate(tools):
            name = t.function.name
            if not TOOL_NAME.fullmatch(name):
                raise PydanticCustomError("invalid_request", f"tools[{i}].function.name must be 1 to 64 letters, "
                                                             "digits, underscores or dashes")
            if name in seen:
                raise PydanticCustomError("invalid_request", f"tools[{i}].function.name {name!r} is used twice")
            seen.add(name)
            size = len(json.dumps(t.model_dump(exclude_none=True), ensure_ascii=False).encode())
            total += size
            if size > MAX_TOOL_SCHEMA_BYTES:
                raise PydanticCustomError("invalid_request", f"tools[{i}] is {size} bytes of JSON; at most "
                                                             f"{MAX_TOOL_SCHEMA_BYTES} are accepted")
            p = t.function.parameters
            if p is not None and _depth(p, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
                raise PydanticCustomError("invalid_request", f"tools[{i}].function.parameters nests deeper than "
                                                             f"{MAX_SCHEMA_DEPTH} levels")
        if total > MAX_TOOLS_BYTES:
            raise PydanticCustomError("invalid_request", f"the tools are {total} bytes of JSON; at most "
                                                         f"{MAX_TOOLS_BYTES} are accepted")
        c = self.tool_choice
        if c in ("required",) or isinstance(c, NamedToolChoice):
            if not tools:
                raise PydanticCustomError("invalid_request", "tool_choice \"required\" or a named function needs tools")
            if isinstance(c, NamedToolChoice) and c.function.name not in seen:
                raise PydanticCustomError("invalid_request", f"tool_choice names {c.function.name!r}, which is not "
                                                             "one of the tools")
            if self.response_format is not None and self.response_format.type != "text":
                raise PydanticCustomError("invalid_request", "tool_choice \"required\" or a named function cannot be "
                                                             "combined with a JSON response_format (each is a grammar)")

    @property
    def offered_tools(self) -> list[dict] | None:
        """The tools offered to the model (none with tool_choice "none"), as plain dicts."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

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
    echo: StrictBool | None = None  # the prompt before the completion (logprobs: the prompt's tokens with null)
    suffix: StrictStr | None = None  # fill-in-the-middle: the text after the completion (a FIM vocabulary)

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
    "tools": "must be a list of {\"type\": \"function\", \"function\": {\"name\": ..., \"description\": ..., "
             "\"parameters\": {...}}}",
    "tool_choice": "must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": "
                   "{\"name\": ...}}",
    "messages": "must be a non-empty list of {role, content}",
    "prompt": "must be a string",
    "echo": "must be true or false",
    "suffix": "must be a string (fill-in-the-middle: the text after the completion)",
}


def _message(e: dict) -> RequestError:
    """One pydantic error -> the request's one-line error."""
    kind, loc = e["type"], e["loc"]
    if kind in ("unsupported", "invalid_request"):
        if len(loc) >= 2 and loc[0] == "messages" and isinstance(loc[1], int):
            return RequestError(f"messages[{loc[1]}]: {e['msg']}", kind)
        return RequestError(e["msg"], kind)
    if kind == "extra_forbidden":
        where = "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in loc[:-1]).lstrip(".")
        return RequestError(f"unknown field {loc[-1]!r} in {where or 'body'}", "unknown_field")
    if not loc:
        return RequestError("the body must be a JSON object")
    field = loc[0]
    if field == "messages" and len(loc) >= 2 and isinstance(loc[1], int):
        i, rest = loc[1], loc[2:]
        if not rest or (kind == "missing" and len(rest) == 1 and rest[0] in ("role", "content")):
            return RequestError(f"messages[{i}] needs role and content (a JSON object)")
        if rest[0] == "role":
            return RequestError(f"messages[{i}].role {e.get('input')!r} is not supported (one of {', '.join(ROLES)})")
        if rest[0] == "content":
            return RequestError(f"messages[{i}].content must be a string or a list of text parts "
                                "({\"type\": \"text\", \"text\": ...}); only text parts are supported")
        if rest[0] == "tool_calls":
            return RequestError(f"messages[{i}].tool_calls must be a list of {{\"id\": ..., \"type\": \"function\", "
                                "\"function\": {\"name\": ..., \"arguments\": \"<JSON text>\"}}")
        return RequestError(f"messages[{i}].{rest[0]} must be a string")
    if kind == "missing" and len(loc) == 1:
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
    c = b.tool_choice
    if b.tools and (c == "required" or isinstance(c, NamedToolChoice)):
        from ..tools import ToolError, call_grammar

        try:
            return call_grammar(b.offered_tools, c.function.name if isinstance(c, NamedToolChoice) else None,
                                parallel=bool(b.parallel_tool_calls))
        except ToolError as e:
            raise RequestError(str(e), "invalid_schema") from None
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
