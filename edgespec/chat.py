"""Chat prompts rendered with the GGUF's own `tokenizer.chat_template` in Jinja2's sandbox."""

from __future__ import annotations

from datetime import datetime

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


def _raise(msg: str) -> None:
    raise TemplateError(msg)


def render(template: str | None, messages: list[dict], bos_token: str = "", eos_token: str = "",
           add_generation_prompt: bool = True) -> str:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        tpl = env.from_string(template or FALLBACK_TEMPLATE)
        return tpl.render(
            messages=messages, bos_token=bos_token, eos_token=eos_token,
            add_generation_prompt=add_generation_prompt,
        )
    except TemplateError as e:
        raise EdgespecError(f"chat template failed: {e}") from None
