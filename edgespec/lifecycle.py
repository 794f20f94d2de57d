"""The life of one generation, the same for every scheduler.

Start with a prompt (checked, read into a KV cache, first token picked); then steps, each a
verified set of tokens committed through `_commit` (cut at end-of-generation or the token
limit, described as a StepEvent, added to the stats); iterate for the events; stop by closing
the iterator. The schedulers (`schedulers/`: one sequence step by step, PEARL's two threads, many
sequences per decode) differ only in how they schedule drafting and verification.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np

from .draft import Draft
from .errors import Cancelled, ContextFullError, EdgespecError
from .events import Stats, StepEvent
from .kv import KVSeq
from .rows import Shaper
from .sampling import SamplingConfig
from .verify import verify_step


@dataclass
class Lifecycle:
    """One generation. Iterate it for StepEvents; `tokens` and `stats` grow as it goes, so a
    generation stopped midway keeps everything it produced."""

    engine: Any
    prompt: list[int]
    max_tokens: int
    sampling: SamplingConfig
    tokens: list[int] = field(default_factory=list)
    stats: Stats = field(default_factory=Stats)
    context: list[int] = field(default_factory=list)  # prompt + tokens, grown in place
    t_start: float = 0.0
    prompt_hidden: np.ndarray | None = None  # see _prologue
    # asked between the prompt's chunks: True ends the generation there (raises `Cancelled`)
    cancelled: Callable[[], bool] | None = None
    # Start from the longest common prefix of the prompt and what the target's cache holds (a
    # conversation's earlier turns, a returning request), reading only the rest; see _prologue.
    reuse: bool = False
    _failed: bool = False
    # the rows' shaping (grammar, penalties, logit bias) and logprobs, per generation (rows.Shaper)
    shaper: Shaper | None = None

    @property
    def logprobs(self) -> list[tuple]:
        """(token, logprob, ((token, logprob), ...)) per generated token, when the sampling asks."""
        return self.shaper.logprobs if self.shaper is not None else []

    def __iter__(self) -> Iterator[StepEvent]:  # pragma: no cover - each scheduler has its own
        raise NotImplementedError

    @property
    def drafter_name(self) -> str:
        """What drafted (the drafter's name; for PEARL, "pearl")."""
        return ""

    def run(self) -> "Lifecycle":
        for _ in self:
            pass
        return self

    def _prologue(self, kv: KVSeq, hidden: str = "", taps: tuple[int, ...] | None = None,
                  on_rows: Callable[[int, list[int]], None] | None = None) -> tuple[int, np.random.Generator]:
        """Check the prompt, read it into `kv`'s cache and pick the first token. Returns it and
        the generation's random stream (fresh entropy unless the sampling has a seed).

        With `reuse` the cache keeps its longest common prefix with the prompt and only the rest
        is read (`stats.n_prompt_cached` counts the kept tokens); the last prompt token is always
        read again, for its logits. Hidden rows (below) then start at the first token read: a
        drafter that reads them keeps its own state for the kept prefix (see `observe`).

        `hidden` ("last" or "all") keeps the target's hidden states of the prompt's last row or
        of every row in `prompt_hidden` (heads draft from them): the post-norm output, or with
        `taps` the inputs of those layers (EAGLE-3). `on_rows(pos, rows)` is called after each
        chunk's decode with its batch rows (MTP reads the target's nextn states of every row)."""
        st = self.stats
        if not self.prompt:
            raise EdgespecError("empty prompt")
        if len(self.prompt) >= kv.capacity:
            raise ContextFullError(
                f"prompt of {len(self.prompt)} tokens does not fit in a context of {kv.capacity} tokens (raise -c)"
            )
        st.n_prompt = len(self.prompt)
        st.finish_reason = "interrupted"
        rng = np.random.default_rng(self.sampling.seed)
        self.shaper = Shaper.build(self.engine.target, self.sampling)
        t0 = time.perf_counter()
        if self.reuse:
            keep = kv.keep_prefix(self.prompt, len(self.prompt) - 1)
        else:
            keep = 0
            kv.reset()
        st.n_prompt_cached = keep
        new = self.prompt[keep:]
        if hidden:
            kv.ctx.set_embeddings(True)
        kv.ctx.set_hidden_taps(taps if hidden else None)
        if self.cancelled is not None:
            given, asked = on_rows, self.cancelled

            def on_rows(pos: int, rows: list[int]) -> None:
                if given is not None:
                    given(pos, rows)
                if pos + len(rows) < len(self.prompt) and asked():
                    raise Cancelled("the prompt's reading was given up")
        if hidden == "all":
            parts: list[np.ndarray] = []
            row = kv.extend(new, on_hidden=lambda h, pos: parts.append(h), on_rows=on_rows)
            self.prompt_hidden = np.concatenate(parts)
        else:
            row = kv.extend(new, on_rows=on_rows)
            if hidden:
                self.prompt_hidden = kv.ctx.hidden([row])
        first = verify_step(Draft(), lambda n: kv.ctx.logits(row), self.sampling, rng, self.shaper)[1]
        st.t_prompt = time.perf_counter() - t0
        self.context = list(self.prompt)
        self.t_start = time.perf_counter()
        return first, rng

    def _end_cache(self, kv: KVSeq) -> None:
        """At the end of the generation (finished, stopped, or failed): with `reuse`, leave the
        cache holding exactly the committed text but its last token, as plain decoding leaves it
        whatever the drafter did (see `KVSeq.settle`); after a failure, empty."""
        if self._failed or not self.context:
            kv.reset()
            return
        if not self.reuse:
            return
        try:
            kv.settle(self.context[:-1], self.engine.max_verify_rows)
        except Exception:  # never mask how the generation ended; the next prompt reads in full
            kv.reset()

    def _commit(self, step: int, draft: Draft, accepted: list[int], committed: list[int], t_draft: float,
                t_verify: float, drafter: str, mode: str = "") -> tuple[StepEvent, bool]:
        """Take a verified step's tokens: cut, record, describe. True when the generation is over."""
        out, done = clip(self, committed)
        self.tokens.extend(out)
        self.context.extend(out)
        # cut at the end of generation: the step yielded the end token (see StepEvent.ended)
        ended = done and len(out) < len(committed) and self.engine.target.is_eog(committed[len(out)])
        ev = step_event(step, draft, accepted, out, t_draft, t_verify, drafter, mode, ended)
        self.stats.add(ev)
        self.stats.t_gen = time.perf_counter() - self.t_start
        return ev, done


def clip(gen: Lifecycle, committed: list[int]) -> tuple[list[int], bool]:
    """Cut a step's tokens at end-of-generation, the grammar's end or the token limit; True when
    the generation is over. Each kept token advances the shaper (grammar, penalties)."""
    out: list[int] = []
    is_eog = gen.engine.target.is_eog
    shaper = gen.shaper
    for t in committed:
        if is_eog(t):
            gen.stats.finish_reason = "stop"
            return out, True
        out.append(t)
        if shaper is not None:
            shaper.commit(t)
            if shaper.finished:  # nothing but the end can follow: no step to spend on it
                gen.stats.finish_reason = "stop"
                return out, True
        if len(gen.tokens) + len(out) >= gen.max_tokens:
            gen.stats.finish_reason = "length"
            return out, True
    return out, False


def step_event(step: int, draft: Draft, accepted: list[int], out: list[int], t_draft: float, t_verify: float,
               drafter: str, mode: str = "", ended: bool = False) -> StepEvent:
    """The event of one verification step: `accepted` are draft nodes, `out` the tokens the
    step committed after `clip` (a step cut at end-of-generation keeps fewer); `ended`: it was
    cut at the end of generation, which it yielded."""
    acc_depths = tuple(range(1, len(accepted) + 1)) if draft.is_chain else tuple(draft.depths()[a] for a in accepted)
    n_acc = min(len(accepted), len(out))
    return StepEvent(
        step=step, n_drafted=len(draft), n_accept=n_acc, n_branches=len(draft.leaves()) if draft.tokens else 0,
        tokens=tuple(out), from_draft=tuple(i < n_acc for i in range(len(out))),
        t_draft=t_draft, t_verify=t_verify, drafter=drafter,
        accepted_depth=acc_depths[:n_acc], drafted_depth=_depth_counts(draft), mode=mode, ended=ended,
    )


def _depth_counts(draft: Draft) -> tuple[int, ...]:
    if not draft.tokens:
        return ()
    ds = draft.depths()
    counts = [0] * max(ds)
    for d in ds:
        counts[d - 1] += 1
    return tuple(counts)
