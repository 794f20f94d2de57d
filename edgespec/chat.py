"""Chat prompts rendered with the GGUF's own `tokenizer.chat_template` in Jinja2's sandbox, as
parts that say which text is the template's own (control tokens allowed) and which is a
message's content (text, never a control token)."""

from __future__ import annotations

import json

import re
import secrets
from datetime import datetime
from typing import Callable

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import EdgespecError

# Used when a GGUF carries no template (base models): plain turns, one per line.
FALLBACK_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}\n\n"
    "{% elif m['role'] == 'user' %}User: {{ m['content'] }}\n"
    "{% else %}Assistant: {{ m['content'] }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(msg: str) -> None:
    raise TemplateError(msg)


def render(template: str | None, messages: list[dict], bos_token: str = "", eos_token: str = "",
           add_generation_prompt: bool = True, tools: list[dict] | None = None) -> str:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    # as Hugging Face's templates are rendered (transformers' own filter): keys in their order and
    # no HTML escaping (Jinja's own `tojson` sorts keys and writes `<` as \u003c)
    env.filters["tojson"] = _tojson
    try:
        tpl = env.from_string(template or FALLBACK_TEMPLATE)
        return tpl.render(
            messages=messages, bos_token=bos_token, eos_token=eos_token,
            add_generation_prompt=add_generation_prompt, **({"tools": tools} if tools else {}),
        )
    except TemplateError as e:
        raise EdgespecError(f"chat template failed: {e}") from None


def render_parts(template: str | None, messages: list[dict], bos_token: str = "", eos_token: str = "",
                 add_generation_prompt: bool = True,
                 has_marker: Callable[[str], bool] | None = None,
                 tools: list[dict] | None = None) -> list[tuple[str, bool]]:
    """The rendered prompt as parts `(text, from_template)`: the template's own text (which may
    hold control tokens such as `<|im_start|>`) and the messages' contents (text: a pasted
    `<|im_end|>` must not end a turn), in order.

    The template is rendered with a placeholder in each content's place and once with the
    contents: when the contents (or the contents stripped, for templates that trim) put in the
    placeholders' places give the same text, the parts are exact. A template that rewrites a
    content in some other way (e.g. cuts a reasoning block from an old answer) gets its own
    rendering whole, as one template part, when no content holds a control token's text
    (`has_marker`), else the contents as sent in the placeholders' places.

    Only non-empty string contents get a placeholder (an empty or null one, e.g. an assistant
    message that only calls tools, is rendered as it is); `tools` (for templates that take
    them) is the template's own text: its JSON is escaped by the template's `tojson`."""
    nonce = secrets.token_hex(8)
    placed = [{**m, "content": f"\ue000{nonce}:{i}\ue001"} if isinstance(m.get("content"), str) and m["content"]
              else m for i, m in enumerate(messages)]
    shaped = render(template, placed, bos_token, eos_token, add_generation_prompt, tools)
    pieces = re.split(f"\ue000{nonce}:(\\d+)\ue001", shaped)  # template, index, template, index, ...
    contents = [m.get("content") or "" for m in messages]
    full = render(template, messages, bos_token, eos_token, add_generation_prompt, tools)

    def parts_with(pick) -> list[tuple[str, bool]]:
        out = [(pieces[0], True)]
        for j in range(1, len(pieces), 2):
            out += [(pick(contents[int(pieces[j])]), False), (pieces[j + 1], True)]
        return [p for p in out if p[0]]

    for pick in (lambda c: c, str.strip):
        parts = parts_with(pick)
        if "".join(t for t, _ in parts) == full:
            return parts
    if has_marker is None or not any(has_marker(c) for c in contents):
        return [(full, True)]
    return parts_with(lambda c: c)
