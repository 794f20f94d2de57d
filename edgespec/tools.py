"""Tool (function) calling: tools offered to the model, calls parsed back out of its text.

Offered through the model's own chat template when the template takes `tools` (Qwen2.5's does),
else through the generic tool prompt below (a system message in the Hermes/Qwen convention), so
that every model can call tools. Either way the model answers a call as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

and `parse_calls` turns such blocks back into OpenAI's `tool_calls`. `call_grammar` is the GBNF
that makes the output exactly one well-formed call (or several, when parallel calls are allowed),
of one named function or any offered one, with arguments per the function's parameters schema:
it goes through the same grammar path as `response_format: json_schema` (edgespec.rows), which
only masks the target's distribution, so speculation stays lossless.

History: an assistant message with `tool_calls` and the `tool` messages answering them are given
to a template that takes tools in the convention Hugging Face templates read (`tool_calls[i]
.function.arguments` an object, `tool` role messages with `tool_call_id`); a template that does
not gets them as text in the generic convention (the calls in `<tool_call>` blocks in the
assistant's content, the results in `<tool_response>` blocks in a user turn)."""

from __future__ import annotations

import json
import re
import uuid

from .errors import EdgespecError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_CALLS = 8  # calls in one answer when parallel calls are allowed (the grammar's bound)

GENERIC_PROMPT = (
    "You can call tools (functions) to help with the user's request. The tools, each as a JSON schema "
    "of its function, are within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "To call a tool, answer with a JSON object holding the function's name and its arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}\n</tool_call>\n"
    "A tool's result comes back within <tool_response></tool_response> XML tags."
)

_TOOLS_RE = re.compile(r"\btools\b")
_CALL_RE = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.S)
FENCE = "```"
_LANG_RE = re.compile(r"```([\w+-]*)[ \t]*\n")


def _fence(text: str, at: int) -> tuple[int, str, str] | None:
    """The fenced block opening at `at`: (its end, its language, its body), or None while it is
    not closed (or not a block: no newline after the language)."""
    m = _LANG_RE.match(text, at)
    if m is None:
        return None
    close = text.find(FENCE, m.end())
    return None if close < 0 else (close + len(FENCE), m.group(1).lower(), text[m.end():close])


def _fenced(text: str):
    """(start, end, language, body) of each closed fenced block, in order."""
    at = text.find(FENCE)
    while at >= 0:
        f = _fence(text, at)
        if f is None:
            at = text.find(FENCE, at + len(FENCE))
            continue
        yield at, f[0], f[1], f[2]
        at = text.find(FENCE, f[0])


class ToolError(EdgespecError):
    """Tools that cannot be offered or forced (a schema that cannot become a grammar)."""


def template_takes_tools(template: str | None) -> bool:
    """Whether a chat template renders `tools` itself (it names the variable)."""
    return bool(template) and _TOOLS_RE.search(template) is not None


def _arguments(text):
    """A call's arguments as an object for a template (OpenAI sends a JSON string)."""
    if isinstance(text, str):
        try:
            return json.loads(text)
        except ValueError:
            return text
    return text


def _call_text(call: dict) -> str:
    fn = call.get("function") or {}
    body = {"name": fn.get("name", ""), "arguments": _arguments(fn.get("arguments", "{}"))}
    return f"{OPEN}\n{json.dumps(body, ensure_ascii=False)}\n{CLOSE}"


def generic_prompt(tools: list[dict]) -> str:
    return GENERIC_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))


def for_template(template: str | None, messages: list[dict], tools: list[dict] | None
                 ) -> tuple[list[dict], list[dict] | None]:
    """The messages (and the tools) to render with `template`: unchanged, in Hugging Face's
    convention, for a template that takes tools; else with the tools in a generic system
    message and tool calls and results as text."""
    if template_takes_tools(template):
        out = []
        for m in messages:
            m = dict(m)
            if m.get("tool_calls"):
                m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": _arguments(c["function"]["arguments"])}}
                                   for c in m["tool_calls"]]
            if m.get("content") is None:
                m["content"] = ""
            out.append(m)
        return out, tools or None
    out: list[dict] = []
    for m in messages:
        role = m["role"]
        if role == "tool":
            piece = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if out and out[-1].get("_tool"):
                out[-1]["content"] += "\n" + piece
            else:
                out.append({"role": "user", "content": piece, "_tool": True})
            continue
        text = m.get("content") or ""
        if m.get("tool_calls"):
            text = "\n".join([text] * bool(text) + [_call_text(c) for c in m["tool_calls"]])
        out.append({"role": role, "content": text})
    for m in out:
        m.pop("_tool", None)
    if tools:
        prompt = generic_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}" if out[0]["content"] else prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, None


def call_grammar(tools: list[dict], name: str | None = None, parallel: bool = False) -> str:
    """GBNF for an answer that is one tool call (`parallel`: 1 to MAX_CALLS of them), of the
    function `name` or any of `tools`, its arguments per the function's parameters schema, in
    the `<tool_call>` convention (llama.cpp's JSON-schema converter for the JSON)."""
    from llama_cpp.llama_grammar import SchemaConverter

    fns = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    alts = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                              "arguments": f.get("parameters") or {"type": "object"}},
             "required": ["name", "arguments"]} for f in fns]
    schema = alts[0] if len(alts) == 1 else {"anyOf": alts}
    conv = SchemaConverter(prop_order={"name": 0, "arguments": 1}, allow_fetch=False, dotall=False, raw_pattern=False)
    try:
        schema = conv.resolve_refs(schema, "tools")
        conv.visit(schema, "tool-call-json")
        grammar = conv.format_grammar()
    except Exception as e:  # the converter raises what it meets
        raise ToolError(f"cannot turn the tools' parameters into a grammar: {type(e).__name__}: {e}") from None
    one = f'"{OPEN}\\n" tool-call-json "\\n{CLOSE}"'
    more = f' ("\\n" {one}){{0,{MAX_CALLS - 1}}}' if parallel else ""
    return f"root ::= {one}{more}\n{grammar}\n"


def new_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _as_calls(obj, names) -> list[dict] | None:
    """A call object (or a list of them) naming offered functions with object arguments, as
    OpenAI's `tool_calls`; None when it is not one."""
    objs = obj if isinstance(obj, list) and obj else [obj]
    calls = []
    for o in objs:
        if not (isinstance(o, dict) and o.get("name") in names):
            return None
        args = o.get("arguments", o.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        calls.append({"id": new_id(), "type": "function",
                      "function": {"name": o["name"], "arguments": json.dumps(args, ensure_ascii=False)}})
    return calls


def _json(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def parse_calls(text: str, names: set[str] | frozenset[str]) -> tuple[str, list[dict]]:
    """The calls in `text` as OpenAI's `tool_calls`, and the text outside them. A call is a
    `<tool_call>` block (the template's and the generic prompt's convention) whose JSON names an
    offered function with object arguments; where an answer has none, a fenced ```json block, or
    the whole answer, that is such a JSON object (or a list of them): Qwen2.5-Coder answers so
    even when its template asks for `<tool_call>`. Anything else stays text."""
    calls: list[dict] = []
    rest: list[str] = []
    pos = 0
    for m in _CALL_RE.finditer(text):
        found = _as_calls(_json(m.group(1)), names)
        if found is None or len(found) != 1:
            continue
        rest.append(text[pos:m.start()])
        pos = m.end()
        calls += found
    if not calls:
        for start, end, lang, body in _fenced(text):
            found = _as_calls(_json(body), names) if lang in ("", "json") else None
            if found is None:
                continue
            rest.append(text[pos:start])
            pos = end
            calls += found
    if not calls:
        found = _as_calls(_json(text.strip()), names) if text.strip().startswith(("{", "[")) else None
        return ("", found) if found else (text, [])
    rest.append(text[pos:])
    return "".join(rest), calls


class CallHold:
    """Streaming with tools: `feed(piece)` returns the text that can go out as content now. From
    the first `<tool_call>` on, text is held (it becomes calls, or content at the end); a fenced
    block is held until it closes, then held on if it is a call (see `parse_calls`), else let
    go; an answer that starts as JSON (`{`, `[`) is held whole; a tail that could be the start of
    a marker is held until it is not."""

    def __init__(self, names: set[str] | frozenset[str] = frozenset()):
        self.names = names
        self.sent = ""  # the content given out so far (a prefix of the answer's text)
        self._pending = ""
        self.inside = False

    def feed(self, piece: str) -> str:
        if self.inside:
            return ""
        self._pending += piece
        out = ""
        while True:
            p = self._pending
            if not (self.sent + out).strip() and p.lstrip()[:1] in ("{", "["):
                self.inside = True  # the whole answer may be one call
                break
            i, j = p.find(OPEN), p.find(FENCE)
            if i >= 0 and (j < 0 or i < j):
                out += p[:i]
                self._pending = p[i:]
                self.inside = True
                break
            if j >= 0:
                f = _fence(p, j)
                if f is None:  # an open fence: held until it closes
                    out += p[:j]
                    self._pending = p[j:]
                    break
                end, lang, body = f
                if lang in ("", "json") and _as_calls(_json(body), self.names) is not None:
                    out += p[:j]
                    self._pending = p[j:]
                    self.inside = True
                    break
                out += p[:end]  # a block that is not a call: content
                self._pending = p[end:]
                continue
            keep = next((k for k in range(min(len(OPEN) - 1, len(p)), 0, -1)
                         if OPEN.startswith(p[-k:]) or FENCE.startswith(p[-k:])), 0)
            out += p[:len(p) - keep]
            self._pending = p[len(p) - keep:]
            break
        self.sent += out
        return out
