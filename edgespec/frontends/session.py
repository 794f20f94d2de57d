"""A multi-turn chat over an Engine: the conversation, the drafter in use, stop and regenerate.

Used by `edgespec chat` in both its forms (the Textual UI and the line-by-line mode for pipes);
it knows nothing about either.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

from .. import methods
from ..engine import Engine
from ..errors import ContextFullError
from ..events import Stats, StepEvent
from ..sampling import SamplingConfig
from ..text import TextStream


@dataclass
class Reply:
    text: str
    tokens: list[int]
    from_draft: list[bool]
    stats: Stats
    method: str
    stopped: bool = False


@dataclass
class ChatSession:
    engine: Engine
    method: str = "auto"
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    max_tokens: int = 512
    system: str | None = None
    # read only what a turn adds: the target's cache keeps the conversation (Lifecycle.reuse)
    reuse: bool = True
    messages: list[dict] = field(default_factory=list)
    total: Stats = field(default_factory=Stats)
    _stop: threading.Event = field(default_factory=threading.Event)

    @property
    def model_name(self) -> str:
        from ..models import stores

        spec = self.engine.cfg.model  # a store's file may be a blob named by its hash: its spec then
        return spec if stores.parse(spec) is not None else self.engine.target.path.name

    @property
    def draft_note(self) -> str:
        """The draft model loaded, and why: "[vocab] name" (paired by vocabulary), "" without one."""
        from ..models import display_name

        cfg = self.engine.cfg
        if self.engine.draft_model is None:
            return ""
        why = {"same vocabulary": "[vocab] ", "catalog pair": "[pair] "}.get(cfg.draft_why, "")
        return why + display_name(cfg.draft).rsplit("/", 1)[-1]

    @property
    def exactness(self) -> str:
        """The exactness policy in force and, on a CPU, the kernels behind it, short: "strict ≤32 rows
        (patched)" (edgespec's batch-invariant kernels; "stock": llama.cpp's; see `edgespec doctor`)."""
        ex = self.engine.exactness_info()
        kern = {"batch-invariant": "patched", "per-row": "per-row", "stock": "stock"}.get(ex.get("kernels"), "")
        tail = f" ({kern})" if kern and ex.get("backend") == "cpu" else ""
        return f"{ex['policy']} ≤{ex['max_verify_rows']} rows{tail}"

    def piece(self, token: int) -> str:
        return self.engine.target.detokenize([token])

    def methods(self) -> list[str]:
        """The methods this engine can switch between (from the registry)."""
        return methods.available(self.engine)

    def clear(self) -> None:
        self.messages.clear()

    def stop(self) -> None:
        """Ask the running reply to stop at the next step (callable from any thread)."""
        self._stop.set()

    def prompt_tokens(self) -> list[int]:
        msgs = ([{"role": "system", "content": self.system}] if self.system else []) + self.messages
        return self.engine.prompt_tokens(messages=msgs)

    def send(self, text: str, on_event: Callable[[StepEvent, str], None] | None = None) -> Reply:
        self.messages.append({"role": "user", "content": text})
        return self._reply(on_event)

    def regenerate(self, on_event: Callable[[StepEvent, str], None] | None = None) -> Reply | None:
        """Drop the last reply and answer the last user message again."""
        if self.messages and self.messages[-1]["role"] == "assistant":
            self.messages.pop()
        if not self.messages:
            return None
        return self._reply(on_event)

    def _reply(self, on_event) -> Reply:
        self._stop.clear()
        prompt = self.prompt_tokens()
        room = self.engine.ctx.n_ctx - len(prompt)
        if room < 2:
            self.messages.pop()
            raise ContextFullError(
                f"the conversation ({len(prompt)} tokens) fills the context of {self.engine.ctx.n_ctx} tokens: clear it"
            )
        gen = self.engine.start(prompt, min(self.max_tokens, room - 1), self.sampling, self.method, reuse=self.reuse)
        stream = TextStream(self.engine.target)
        text, flags = [], []
        stopped = False
        steps = iter(gen)
        try:
            for ev in steps:
                piece = stream.feed(ev.tokens)
                text.append(piece)
                flags.extend(ev.from_draft)
                if on_event is not None:
                    on_event(ev, piece)
                if self._stop.is_set():
                    stopped = True
                    break
        finally:
            steps.close()  # the generation ends here (its cache is left for the next turn), not at GC
        if stopped:
            gen.stats.finish_reason = "interrupted"
        text.append(stream.flush())
        reply = Reply("".join(text), list(gen.tokens), flags, gen.stats, self.method, stopped)
        # a stopped reply is kept: the user sees it, and the next turn builds on it
        self.messages.append({"role": "assistant", "content": reply.text})
        self.total.merge(gen.stats)
        # between turns: a cost curve that proved far off (or was measured on a busy machine) is
        # measured again once the machine is quiet, its progress reported (front ends show it),
        # else what its online correction learned is written back (costcache.keep_up)
        self.engine.heal_cost(quiet=False)
        return reply
