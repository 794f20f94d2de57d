"""A prompt's tokens for a model: text as is, messages in the model's chat template (with
tools), or a fill-in-the-middle prompt. Control tokens (`<|im_start|>`) are read only in the
template's own text, never in what a user or a request wrote (unless asked: `run --raw`).
`Engine.prompt_tokens` and `Engine.infill_tokens` are these over the target model.
"""

from __future__ import annotations

import json

from . import chat, tools as tools_mod
from .errors import EdgespecError
from .llama import Model


def prompt_tokens(m: Model, text: str | None = None, messages: list[dict] | None = None, raw: bool = False,
                  special: bool = False, tools: list[dict] | None = None) -> list[int]:
    """A prompt's tokens: `text` as is (`raw`), else the messages (or `text` as one user
    message) in the model's chat template. Control tokens (`<|im_start|>`) are read only in
    the template's own text: a message's content is text whatever it holds, and so is raw
    text unless `special` (the command line's `run --raw`, whose user writes the prompt).
    `tools` (OpenAI's function tools) are offered through the template when it takes them,
    else in the generic tool prompt (edgespec.tools); tool calls and results in the history
    are rendered the same way."""
    if raw:
        return m.tokenize(text or "", add_special=True, parse_special=special)
    if messages is None:
        messages = [{"role": "user", "content": text or ""}]
    if tools or any(x.get("tool_calls") or x["role"] == "tool" for x in messages):
        # what a template renders itself (the tools, the calls' JSON) must not smuggle a control token
        own = [tools, [x.get("tool_calls") for x in messages]]
        if m.has_control_text(json.dumps(own, ensure_ascii=False)):
            raise EdgespecError("the tools or the tool calls hold a control token's text")
        messages, tools = tools_mod.for_template(m.chat_template, messages, tools)
    bos = m.token_text(m.bos) if m.bos >= 0 else ""
    eos = m.token_text(m.eos) if m.eos >= 0 else ""
    parts = chat.render_parts(m.chat_template, messages, bos, eos, add_generation_prompt=True,
                              has_marker=m.has_control_text, tools=tools)
    add_bos = m.add_bos and not (bos and parts and parts[0][1] and parts[0][0].startswith(bos))
    return ([m.bos] if add_bos else []) + m.tokenize_parts(parts)


def infill_tokens(m: Model, prefix: str, suffix: str) -> list[int]:
    """A fill-in-the-middle prompt (prefix-suffix-middle order, as llama.cpp's server's
    infill): the model writes what goes between `prefix` and `suffix`. Both are text (never
    a control token); EdgespecError when the vocabulary has no FIM tokens."""
    fim = m.fim_tokens
    if fim is None:
        raise EdgespecError("this model's vocabulary has no fill-in-the-middle tokens")
    pre, suf, mid = fim
    text = lambda s: m.tokenize(s, add_special=False, parse_special=False)  # noqa: E731
    return ([m.bos] if m.add_bos and m.bos >= 0 else []) + [pre, *text(prefix), suf, *text(suffix), mid]
