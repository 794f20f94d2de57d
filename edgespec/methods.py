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
    from .lifecycle import Lifecycle
    from .sampling import SamplingConfig

# An edgespec.engine.Engine. Not imported, even for type checking: the engine imports this
# registry, and the registry, its builders and the drafters read the engine only through what they
# are handed (its config, target, contexts and side contexts), so no import runs back to it.
Engine = Any


@dataclass(frozen=True)
class Options:
    """How a drafter is built for one generation."""

    seed: int | None = None  # the request's seed (None: fresh randomness)
    shared: Any = None  # a SharedLookahead when many requests draft from one trie (batch)
    # the user's reply history file (edgespec.history), e.g. one API key's; None: the engine's own
    history: str | None = None
    max_branches: int = 1  # sequence ids the target context lends to tree branches
    single_sequence: bool = True  # False under -np > 1: chains without a draft model only


@dataclass(frozen=True)
class Method:
    name: str
    summary: str
    needs_draft_model: bool = False
    needs_heads: bool = False  # a heads file (--heads)
    trees: bool = False  # may draft several branches per step
    multi_sequence: bool = False  # runs with several sequences per decode (-np > 1)
    build: Callable[[Engine, Options], "Drafter"] | None = None
    # a scheduler of its own (PEARL): starts the generation itself from (engine, prompt, max_tokens,
    # sampling, reuse); None: the sequential loop drives `build`'s drafter (Engine.start)
    start: Callable[[Engine, list[int], int, "SamplingConfig", bool], "Lifecycle"] | None = None

    def available(self, engine: Engine) -> bool:
        if self.needs_draft_model and engine.draft_model is None:
            return False
        return not self.needs_heads or self.name in engine.heads_kinds()


def _none(engine, opt):
    from .drafters.base import NullDrafter

    return NullDrafter()


def _ngram(engine, opt):
    from .drafters.ngram import NgramDrafter

    return NgramDrafter(is_stop=engine.target.is_eog)


def _lookahead(engine, opt):
    from .drafters.lookahead import HISTORY, LookaheadDrafter, Sources

    if opt.shared is not None:
        return opt.shared.drafter(opt.max_branches)
    # what the target accepted after each match length, per source, is learned across the
    # engine's generations (a chat's turns, a bench's prompts) and, beside the cost curve, processes

    cals = engine.side.keep("lookahead", lambda: Sources(engine.cost)).value
    return LookaheadDrafter(cache_path=engine.cfg.lookahead_cache, max_branches=opt.max_branches,
                            calib=cals["lookahead"], is_stop=engine.target.is_eog,
                            history=_history(engine, opt), history_calib=cals[HISTORY])


def lookahead_pool(engine, share: str | None, pools: dict) -> tuple[Any, Any]:
    """The lookahead trie a request of `share` drafts from, and the pool it alone uses (to close
    when it ends) or None: requests without a share have their own; those of one share (a
    server's API key, a batch's requests) one kept in `pools`, holding the lookahead cache file
    for the default share "" and reading and growing the user's reply history where one is set
    (a server's key's: edgespec.history)."""
    from .drafters.lookahead import HISTORY, SharedLookahead, Sources

    if share is None:
        pool = SharedLookahead(None, engine.target.is_eog)
        return pool, pool
    pool = pools.get(share)
    if pool is None:
        history = _history(engine, Options())
        cal = engine.side.keep("lookahead", lambda: Sources(engine.cost)).value[HISTORY] if history else None
        path = engine.cfg.lookahead_cache if share == "" else None
        pool = pools[share] = SharedLookahead(path, engine.target.is_eog, history, cal)
    return pool, None


def _history(engine, opt):
    """The user's past replies (edgespec.history) where a history file is set: one held at a
    time, so that two users' (two API keys') replies never meet."""
    path = opt.history or engine.cfg.history
    if not path:
        return None
    from .history import History

    return engine.side.keep("history", lambda: History.open(path), fits=lambda h: str(h.path) == str(path))


def _draft(engine, opt):
    from .drafters.draft_model import DraftModelDrafter, KeptDraftState

    if engine.draft_model is None:
        raise EdgespecError("--spec draft needs a draft model: pass -md MODEL")
    c, dc = engine.cfg, engine.draft_cost
    # what the drafter learns of itself (confidence against acceptance, its times) outlives the
    # generation and, beside the target's cost curve, the process; `draft` and `auto` share it.
    # Reading n tokens to catch up costs about the curve's marginal row (an upper bound: it asks
    # logits of one row only), until catch-ups are timed.
    t_read = max(0.0, (dc.t(32) - dc.t(16)) / 16)
    key = f"draft-state:{engine.draft_model.path.name}"
    state = engine.side.keep(key, lambda: KeptDraftState(engine.cost, key, dc.t(1), t_read)).value
    return DraftModelDrafter(engine.draft_model, engine.draft_kv, c.draft_n_max, c.draft_n_min, c.draft_p_min,
                             opt.seed, is_stop=engine.target.is_eog, state=state)


def _native_mtp(engine) -> bool:
    """Whether the target has nextn (MTP) layers that llama.cpp can run as a drafter."""
    from .drafters.mtp import MTP_ARCHS

    t = engine.target
    return t.n_layer_nextn > 0 and t.load_mtp and t.arch in MTP_ARCHS


def auto_members(engine, single_sequence: bool = True) -> list[str]:
    """What `auto` chains on this engine, in order: the trie first (on a copy its long drafts
    beat any one-token guess), then the model's own MTP layers, then the draft model (these two
    with one sequence per decode); each drafts only where its measured cost and confidence say a
    verified row pays, and the later ones are switched off where what they did cost more time
    than it saved (drafters.chain)."""
    out = ["lookahead"]
    if single_sequence and _native_mtp(engine):
        out.append("mtp")
    if single_sequence and engine.draft_model is not None:
        out.append("draft")
    return out


def _native_mtp_drafter(engine, opt):
    """The target's own nextn layers in llama.cpp (`mtp` and `auto` build it here)."""
    from .drafters.mtp import build

    return build(engine)


def _auto(engine, opt):
    from .drafters.chain import ChainDrafter, KeptGates

    names = auto_members(engine, opt.single_sequence)
    build = {"lookahead": _lookahead, "mtp": _native_mtp_drafter, "draft": _draft}
    chain = [build[name](engine, opt) for name in names]
    if len(chain) == 1:
        return chain[0]
    # what each later member gained or lost outlives the generation (a chat's turns) and, beside
    # the cost curve, the process
    gates = engine.side.keep("auto", lambda: KeptGates(engine.cost)).value
    keys = [f"draft:{engine.draft_model.path.name}" if n == "draft" else n for n in names]
    return ChainDrafter(chain, gates, keys)


def heads_runtime(engine, kind: str):
    """The numpy runtime of the heads for method `kind` (medusa, eagle, mtp): loaded once, kept
    among the engine's side contexts while the heads file stays the same."""
    from .heads.store import HeadsRuntime, heads_path

    path = heads_path(engine.cfg.heads, kind, engine.target)
    return engine.side.keep("heads", lambda: HeadsRuntime(path, kind, engine.target, engine.n_ctx_seq),
                            fits=lambda h: h.path == path).runtime


def _medusa(engine, opt):
    from .drafters.heads import MedusaDrafter

    return MedusaDrafter(heads_runtime(engine, "medusa"), is_stop=engine.target.is_eog)


def _eagle(engine, opt):
    from .drafters.heads import EagleDrafter

    head = heads_runtime(engine, "eagle")
    return EagleDrafter(head, depth=max(1, min(engine.cfg.draft_n_max, 8)), is_stop=engine.target.is_eog)


def _mtp(engine, opt):
    """The model's own nextn layers in llama.cpp where it has them, else a trained MTP module."""
    if engine.target.n_layer_nextn > 0 and not engine.cfg.heads:
        return _native_mtp_drafter(engine, opt)
    from .drafters.heads import EagleDrafter

    return EagleDrafter(heads_runtime(engine, "mtp"), depth=max(1, min(engine.cfg.draft_n_max, 1 + engine.cfg.draft_n_min // 4)),
                        name="mtp", is_stop=engine.target.is_eog)


def _eagle3(engine, opt):
    from .drafters.eagle3 import build
    from .heads.store import heads_path

    return build(engine, heads_path(engine.cfg.heads, "eagle3", engine.target), tree=opt.max_branches > 1)


def _pearl(engine, prompt, max_tokens, sampling, reuse):
    from .schedulers.pearl import PearlGeneration

    return PearlGeneration(engine, prompt, max_tokens, sampling, reuse=reuse, gamma=engine.cfg.pearl_gamma)


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("none", "plain decoding through the same loop: the baseline", build=_none, multi_sequence=True),
    Method("ngram", "prompt lookup: the last 1-3 tokens matched in prompt and output", build=_ngram,
           multi_sequence=True),
    Method("lookahead", "a prefix trie of prompt and output n-grams, several branches verified as a tree",
           build=_lookahead, trees=True, multi_sequence=True),
    Method("draft", "a small GGUF with the same vocabulary drafts a chain", build=_draft, needs_draft_model=True),
    Method("auto", "lookahead; when it has nothing worth verifying, the model's own MTP layers if it has "
           "them, then the draft model (-md, or the catalog's pair when cached); a later one that loses "
           "time is switched off by measurement",
           build=_auto, trees=True, multi_sequence=True),
    Method("pearl", "the draft model drafts in its own thread while the target verifies (PEARL)",
           start=_pearl, needs_draft_model=True),
    Method("medusa", "Medusa heads on the target's last hidden state propose the next tokens, as a tree",
           build=_medusa, needs_heads=True, trees=True),
    Method("eagle", "an EAGLE head runs ahead on the target's features (EAGLE-2's dynamic tree)",
           build=_eagle, needs_heads=True, trees=True),
    Method("eagle3", "an EAGLE-3 head (three target layers fused) in llama.cpp's own eagle3 graph (EAGLE-2's tree)",
           build=_eagle3, needs_heads=True, trees=True),
    Method("mtp", "multi-token prediction: the model's nextn layers (DeepSeek-V3 style), or a trained MTP module",
           build=_mtp, needs_heads=True, trees=True),
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


def available(engine: Engine) -> list[str]:
    """The methods this engine can run (the chat UI's drafter switch)."""
    return [m.name for m in METHODS.values() if m.available(engine)]


def build_drafter(engine: Engine, name: str, opt: Options) -> "Drafter":
    m = get(name)
    if m.build is None:
        raise EdgespecError(f"{name} is a scheduler of its own, not a drafter: start it with Engine.start")
    return m.build(engine, opt)
