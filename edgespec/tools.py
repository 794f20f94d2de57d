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


def parse_calls(text: str, names: set[str] | frozenset[str]) -> tuple[str, list[dict]]:
    """The calls in `text` (blocks whose JSON names an offered function, with object arguments)
    as OpenAI's `tool_calls`, and the text outside them (other blocks stay text)."""
    calls: list[dict] = []
    rest: list[str] = []
    pos = 0
    for m in _CALL_RE.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            continue
        if not (isinstance(obj, dict) and obj.get("name") in names):
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                continue
        if not isinstance(args, dict):
            continue
        rest.append(text[pos:m.start()])
        pos = m.end()
        calls.append({"id": new_id(), "type": "function",
                      "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}})
    rest.append(text[pos:])
    return "".join(rest), calls


class CallHold:
    """Streaming with tools: `feed(piece)` returns the text that can go out as content now; from
    the first `<tool_call>` on, text is held (it becomes calls, or content at the end), and a
    tail that could be the start of one is held until it is not."""

    def __init__(self):
        self.sent = ""  # the content given out so far (a prefix of the answer's text)
        self._pending = ""
        self.inside = False

    def feed(self, piece: str) -> str:
        if self.inside:
            return ""
        self._pending += piece
        i = self._pending.find(OPEN)
        if i >= 0:
            out, self.inside = self._pending[:i], True
        else:
            keep = next((k for k in range(min(len(OPEN) - 1, len(self._pending)), 0, -1)
                         if OPEN.startswith(self._pending[-k:])), 0)
            out = self._pending[:len(self._pending) - keep]
        self._pending = self._pending[len(out):]
        self.sent += out
        return out
