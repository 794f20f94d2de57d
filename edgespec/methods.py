"""Every speculative method in one registry: what it is, what it needs, what it supports and how
it is built. The CLI's choices, the chat UI's drafter switch, batch's `-np` check, bench's method
list and the README's table all read it; a new method (Medusa, EAGLE, MTP) is one entry here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from .errors import EdgespecError

if TYPE_CHECKING:  # pragma: no cover
    from .drafters.base import Drafter
    from .engine import Engine


@dataclass(frozen=True)
class Options:
    """How a drafter is built for one generation."""

    seed: int | None = None  # the request's seed (None: fresh randomness)
    shared: Any = None  # a SharedLookahead when many requests draft from one trie (batch)
    max_branches: int = 1  # sequence ids the target context lends to tree branches
    single_sequence: bool = True  # False under -np > 1: chains without a draft model only


@dataclass(frozen=True)
class Method:
    name: str
    summary: str
    scheduler: str = "sequential"  # "sequential": the one-step loop drives `build`'s drafter; "pearl"
    needs_draft_model: bool = False
    needs_target_hidden: bool = False  # heads that read the target's hidden states (Medusa, EAGLE, MTP)
    needs_heads: bool = False  # a heads file (--heads)
    trees: bool = False  # may draft several branches per step
    multi_sequence: bool = False  # runs with several sequences per decode (-np > 1)
    build: Callable[["Engine", Options], "Drafter"] | None = None

    def available(self, engine: "Engine") -> bool:
        return not self.needs_draft_model or engine.draft_model is not None


def _none(engine, opt):
    from .drafters.base import NullDrafter

    return NullDrafter()


def _ngram(engine, opt):
    from .drafters.ngram import NgramDrafter

    return NgramDrafter()


def _lookahead(engine, opt):
    from .drafters.lookahead import LookaheadDrafter

    if opt.shared is not None:
        return opt.shared.drafter(opt.max_branches)
    return LookaheadDrafter(cache_path=engine.cfg.lookahead_cache, max_branches=opt.max_branches)


def _draft(engine, opt):
    from .drafters.draft_model import DraftModelDrafter

    if engine.draft_model is None:
        raise EdgespecError("--spec draft needs a draft model: pass -md MODEL")
    c = engine.cfg
    return DraftModelDrafter(engine.draft_model, engine.draft_kv, c.draft_n_max, c.draft_n_min, c.draft_p_min,
                             opt.seed, t_token=engine.draft_cost.t(1))


def _auto(engine, opt):
    from .drafters import ChainDrafter

    look = _lookahead(engine, opt)
    if engine.draft_model is None or not opt.single_sequence:
        return look
    return ChainDrafter([look, _draft(engine, opt)])


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("none", "plain decoding through the same loop: the baseline", build=_none, multi_sequence=True),
    Method("ngram", "prompt lookup: the last 1-3 tokens matched in prompt and output", build=_ngram,
           multi_sequence=True),
    Method("lookahead", "a prefix trie of prompt and output n-grams, several branches verified as a tree",
           build=_lookahead, trees=True, multi_sequence=True),
    Method("draft", "a small GGUF with the same vocabulary drafts a chain", build=_draft, needs_draft_model=True),
    Method("auto", "lookahead; when it has nothing worth verifying, the draft model if -md is given",
           build=_auto, trees=True, multi_sequence=True),
    Method("pearl", "the draft model drafts in its own thread while the target verifies (PEARL)",
           scheduler="pearl", needs_draft_model=True),
)}


def names() -> list[str]:
    return list(METHODS)


def get(name: str) -> Method:
    m = METHODS.get(name)
    if m is None:
        raise EdgespecError(f"unknown --spec method {name!r}; choose one of {', '.join(METHODS)}")
    return m


def multi_sequence() -> list[str]:
    """The methods that run with several sequences per decode."""
    return [m.name for m in METHODS.values() if m.multi_sequence]


def available(engine: "Engine") -> list[str]:
    """The methods this engine can run (the chat UI's drafter switch)."""
    return [m.name for m in METHODS.values() if m.available(engine)]


def build_drafter(engine: "Engine", name: str, opt: Options) -> "Drafter":
    m = get(name)
    if m.build is None:
        raise EdgespecError(f"{name} is a scheduler of its own, not a drafter: start it with Engine.start")
    return m.build(engine, opt)
