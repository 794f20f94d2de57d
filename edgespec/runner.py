"""The engine (loaded models) and the speculative loop that every method runs through.

One step: the drafter proposes a tree -> the target scores pending tokens plus the tree in ONE
llama_decode -> the verifier keeps the longest acceptable path plus one token of the target's
own -> the KV cache keeps exactly the committed tokens -> a StepEvent goes out. Plain decoding
(`--spec none`) is the same loop with empty drafts.
"""

from __future__ import annotations

import codecs
import logging
import time
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from . import chat
from .costmodel import CostModel, load_or_measure
from .draft import Draft
from .drafters import ChainDrafter, Drafter, NullDrafter
from .drafters.base import Budget
from .errors import ContextFullError, EdgespecError
from .events import Stats, StepEvent
from .kv import KVSeq
from .llama import Context, ContextConfig, Model
from .sampling import SamplingConfig, pick
from .steps import clip, step_event
from .verify import verify_step

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    model: str
    draft: str | None = None
    n_ctx: int = 4096
    n_batch: int = 512
    threads: int = 0
    threads_draft: int = 0
    n_gpu_layers: int = 0
    n_gpu_layers_draft: int = 0
    draft_n_max: int = 16
    draft_n_min: int = 0
    draft_p_min: float = 0.0
    lookahead_cache: str | None = None
    max_branches: int = 8
    kv_type: str = "q8_0"
    pearl_gamma: int = 4


class Engine:
    """A loaded target model (and draft model, if any) with its cost curve."""

    def __init__(self, cfg: EngineConfig, quiet: bool = True):
        from .models import cache_root, resolve

        self.cfg = cfg
        self.target = Model(resolve(cfg.model, quiet=quiet), cfg.n_gpu_layers)
        ccfg = ContextConfig(cfg.n_ctx, cfg.n_batch, cfg.threads, max(1, cfg.max_branches), cfg.kv_type)
        self.ctx = Context(self.target, ccfg)
        self.kv = KVSeq(self.ctx)
        self.draft_model: Model | None = None
        self.draft_ctx: Context | None = None
        self.draft_kv: KVSeq | None = None
        if cfg.draft:
            from .drafters.draft_model import check_vocab

            self.draft_model = Model(resolve(cfg.draft, quiet=quiet), cfg.n_gpu_layers_draft)
            check_vocab(self.target, self.draft_model)
            self.draft_ctx = Context(
                self.draft_model, ContextConfig(self.ctx.n_ctx, cfg.n_batch, cfg.threads_draft or cfg.threads, 1, cfg.kv_type)
            )
            self.draft_kv = KVSeq(self.draft_ctx)  # one per context: its token list is the cache's
            self.draft_cost = load_or_measure(self.draft_ctx, self.draft_kv, cache_root() / "costs.json",
                                              cfg.n_gpu_layers_draft, quiet)
        self.cost: CostModel = load_or_measure(self.ctx, self.kv, cache_root() / "costs.json", cfg.n_gpu_layers, quiet)
        if cfg.kv_type != "q8_0":
            log.warning("with an %s KV cache, llama.cpp takes other attention kernels for one row and for many on a CPU (past 512 "
                        "cells): verified batches may differ from plain decoding in the last bits, so greedy "
                        "speculative output can differ from plain at near-ties (the q8_0 default keeps it exact)",
                        cfg.kv_type)

    # -- prompts --------------------------------------------------------------------------

    def prompt_tokens(self, text: str | None = None, messages: list[dict] | None = None, raw: bool = False) -> list[int]:
        m = self.target
        if raw:
            return m.tokenize(text or "", add_special=True, parse_special=True)
        if messages is None:
            messages = [{"role": "user", "content": text or ""}]
        bos = m.token_text(m.bos) if m.bos >= 0 else ""
        eos = m.token_text(m.eos) if m.eos >= 0 else ""
        rendered = chat.render(m.chat_template, messages, bos, eos, add_generation_prompt=True)
        add_bos = m.add_bos and not (bos and rendered.startswith(bos))
        toks = m.tokenize(rendered, add_special=False, parse_special=True)
        return ([m.bos] if add_bos else []) + toks

    # -- drafters -------------------------------------------------------------------------

    def make_drafter(self, method: str, seed: int | None = None) -> Drafter:
        from .drafters.lookahead import LookaheadDrafter
        from .drafters.ngram import NgramDrafter

        if method == "none":
            return NullDrafter()
        if method == "ngram":
            return NgramDrafter()
        if method == "lookahead":
            return LookaheadDrafter(cache_path=self.cfg.lookahead_cache, max_branches=self.cfg.max_branches)
        if method == "draft":
            return self._draft_model_drafter(seed)
        if method == "auto":
            look = LookaheadDrafter(cache_path=self.cfg.lookahead_cache, max_branches=self.cfg.max_branches)
            if self.draft_model is None:
                return look
            return ChainDrafter([look, self._draft_model_drafter(seed)])
        if method == "pearl":
            raise EdgespecError("pearl is a scheduler, not a drafter: use Engine.start")
        raise EdgespecError(f"unknown --spec method {method!r}; choose none, ngram, lookahead, draft, auto or pearl")

    def _draft_model_drafter(self, seed: int | None) -> Drafter:
        from .drafters.draft_model import DraftModelDrafter

        if self.draft_model is None or self.draft_ctx is None:
            raise EdgespecError("--spec draft needs a draft model: pass -md MODEL")
        c = self.cfg
        return DraftModelDrafter(self.draft_model, self.draft_kv, c.draft_n_max, c.draft_n_min, c.draft_p_min, seed,
                                 t_token=self.draft_cost.t(1))

    def generate(
        self, prompt: list[int], max_tokens: int, sampling: SamplingConfig, drafter: Drafter | None = None
    ) -> "Generation":
        return Generation(self, prompt, max_tokens, sampling, drafter or NullDrafter())

    def start(self, prompt: list[int], max_tokens: int, sampling: SamplingConfig, method: str):
        """A generation by method name; `pearl` is a scheduler of its own, the rest are drafters."""
        if method == "pearl":
            from .pearl import PearlGeneration

            if self.draft_ctx is None:
                raise EdgespecError("--spec pearl needs a draft model: pass -md MODEL")
            return PearlGeneration(self, prompt, max_tokens, sampling, self.cfg.pearl_gamma)
        return self.generate(prompt, max_tokens, sampling, self.make_drafter(method, sampling.seed))

    def close(self) -> None:
        for obj in (self.draft_ctx, self.draft_model, self.ctx, self.target):
            if obj is not None:
                obj.close()


@dataclass
class Generation:
    """One generation. Iterate it for StepEvents; `tokens` and `stats` grow as it goes, so a
    generation stopped midway keeps everything it produced."""

    engine: Engine
    prompt: list[int]
    max_tokens: int
    sampling: SamplingConfig
    drafter: Drafter
    tokens: list[int] = field(default_factory=list)
    stats: Stats = field(default_factory=Stats)

    def __iter__(self) -> Iterator[StepEvent]:
        eng, st, cfg = self.engine, self.stats, self.sampling
        ctx, kv = eng.ctx, eng.kv
        rng = np.random.default_rng(cfg.seed)
        st.n_prompt = len(self.prompt)
        if not self.prompt:
            raise EdgespecError("empty prompt")
        if len(self.prompt) >= ctx.n_ctx:
            raise ContextFullError(
                f"prompt of {len(self.prompt)} tokens does not fit in a context of {ctx.n_ctx} tokens (raise -c)"
            )
        st.finish_reason = "interrupted"
        t0 = time.perf_counter()
        kv.reset()
        row = kv.extend(self.prompt)
        first = pick(ctx.logits(row), cfg, rng)
        st.t_prompt = time.perf_counter() - t0
        self.drafter.begin(self.prompt)
        t_start = time.perf_counter()
        pending = [first]
        context = list(self.prompt)
        step_no = 0
        try:
            committed = [first]
            draft, accepted = Draft(), []
            t_draft = t_verify = 0.0
            while True:
                out, done = self._clip(committed)
                self.tokens.extend(out)
                context.extend(out)  # prompt + tokens, grown in place rather than rebuilt each step
                st.t_gen = time.perf_counter() - t_start
                ev = step_event(step_no, draft, accepted, out, t_draft, t_verify, draft.source or self.drafter.name)
                st.add(ev)
                yield ev
                if done:
                    return
                step_no += 1
                room = ctx.n_ctx - kv.n - len(pending)
                if room < 0:
                    st.finish_reason = "context"
                    return
                budget = Budget(
                    max_nodes=min(room, ctx.n_batch, eng.cost.max_exact_rows) - len(pending),
                    max_branches=ctx.cfg.n_seq_max,
                    fixed_rows=len(pending),
                    cost=eng.cost,
                    sampling=cfg,
                    n_past=kv.n,
                )
                t1 = time.perf_counter()
                draft = self.drafter.propose(context, budget) if budget.max_nodes > 0 else Draft()
                t2 = time.perf_counter()
                n_before = kv.n
                layout = kv.decode_tree(pending, draft)
                eng.cost.observe(len(pending) + len(draft), n_before, time.perf_counter() - t2)
                accepted, nxt = verify_step(draft, lambda n: ctx.logits(layout.row(n)), cfg, rng)
                relay = kv.commit_tree(layout, pending, draft, accepted)
                pending = relay + [nxt]
                committed = [draft.tokens[a] for a in accepted] + [nxt]
                t3 = time.perf_counter()
                t_draft, t_verify = t2 - t1, t3 - t2
                self.drafter.accept(draft, accepted, committed)
        finally:
            st.t_gen = time.perf_counter() - t_start
            self.drafter.end()

    def run(self) -> "Generation":
        for _ in self:
            pass
        return self

    def _clip(self, committed: list[int]) -> tuple[list[int], bool]:
        return clip(self, committed)


class TextStream:
    """Token ids -> text, incrementally, without splitting multi-byte characters."""

    def __init__(self, model: Model):
        self.model = model
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, tokens) -> str:
        return self._dec.decode(b"".join(self.model.piece(t) for t in tokens))

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)
