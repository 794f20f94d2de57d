"""Draft-model drafting: a small GGUF with the target's vocabulary proposes a chain.

The draft model keeps its own context and KV cache. Its cache is synced to the committed tokens
at the start of every proposal (rejected draft tokens are dropped there), so it is rolled back
with the target's without the scheduler knowing it exists.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from ..costcache import load_extra, store_extra
from ..costmodel import CostModel
from ..draft import Draft
from ..errors import VocabMismatchError
from ..gguf_check import compare_vocab
from ..kv import KVSeq
from ..llama import Model
from ..sampling import sample, warp
from .base import NOTHING, Budget, Calibration, TokenTimed, top_prob


def check_vocab(target: Model, draft: Model) -> None:
    """Raise a clear error naming what differs between the two vocabularies (every token)."""
    compare_vocab(target.info, draft.info)
    if target.vocab_type != draft.vocab_type:
        raise VocabMismatchError(f"draft tokenizer type {draft.vocab_type} differs from target's {target.vocab_type}")
    if target.n_vocab != draft.n_vocab:
        raise VocabMismatchError(
            f"draft vocabulary differs from target: {draft.n_vocab} tokens ({draft.arch}) vs "
            f"{target.n_vocab} ({target.arch})"
        )
    for name in ("bos", "eos"):
        a, b = getattr(target, name), getattr(draft, name)
        if a != b:
            raise VocabMismatchError(f"draft {name.upper()} token {b} differs from target's {a}")


PRIOR_CONF = 0.8  # the draft model's top-token confidence before it has drafted here
PROBE_SHARE = 0.02  # what probing may cost, as a share of the plain steps since the last probe
# A catch-up serves the steps after it too (the draft model then reads only what each step
# commits): its time is weighed as spread over this many steps of drafting.
CATCH_UP_STEPS = 16
# Its gate passes on the confidence of its recent drafts; the chain then decides token by token
# and may draft nothing (the next token's confidence too low, or under --draft-p-min), after the
# catch-up and a decode were paid. So the gate weighs those by the learned share of its runs that
# drafted (`DraftState.hit`, an average over about 1 / HIT_RATE runs, never taken below HIT_FLOOR).
WEIGH_HITS = True
HIT_RATE = 0.1
HIT_FLOOR = 0.05


@dataclass
class DraftState:
    """What the draft model's drafter learns of itself, kept across generations (a chat's turns,
    `auto`'s steps) and, beside the target's cost curve, across processes: the calibration of its
    confidence against what the target accepts, that confidence lately, its seconds per drafted
    token and per token read to catch up, and how long it waits between probes while it does not
    pay. A new process starts where the last one ended, so `auto` never pays again to learn that
    a draft model loses on this machine (or, with `--spec draft` runs, how often it is right)."""

    calib: Calibration = field(default_factory=lambda: Calibration(prior=1.0))
    mean_conf: float = PRIOR_CONF
    t_token: float = 0.0  # seconds per drafted token (measured at load, then EMA)
    t_read: float = 0.0  # seconds per token read in a catch-up (estimated at load, then EMA)
    probe_every: int = 32
    skipped: int = 0
    hit: float = 1.0  # the share of its runs (after the gate or as a probe) that drafted a token

    def to_dict(self) -> dict:
        return {"est": float(self.calib.est[0]), "acc": float(self.calib.acc[0]), "mean_conf": self.mean_conf,
                "t_token": self.t_token, "t_read": self.t_read, "probe_every": self.probe_every, "hit": self.hit}

    @classmethod
    def from_dict(cls, d: dict | None, t_token: float, t_read: float) -> "DraftState":
        s = cls(t_token=t_token, t_read=t_read)
        try:
            if d:
                est, acc = float(d["est"]), float(d["acc"])
                if est > 0 and 0 <= acc <= 2 * est:
                    s.calib.est[:] = est
                    s.calib.acc[:] = acc
                s.mean_conf = min(1.0, max(0.0, float(d["mean_conf"])))
                s.t_token = float(d.get("t_token") or t_token)
                s.t_read = float(d.get("t_read") or t_read)
                s.probe_every = min(1024, max(32, int(d.get("probe_every", 32))))
                s.hit = min(1.0, max(0.0, float(d.get("hit", 1.0))))
        except (KeyError, TypeError, ValueError):
            return cls(t_token=t_token, t_read=t_read)  # a record of another version: learn again
        return s


class KeptDraftState:
    """The draft state as the engine's side context: read from beside the target's cost curve
    when first needed, written back there when the engine closes (as `auto`'s gates are)."""

    bound = False

    def __init__(self, cost: CostModel, key: str, t_token: float, t_read: float):
        self.cost, self.key = cost, key
        self.value = DraftState.from_dict(load_extra(cost, key), t_token, t_read)

    def close(self) -> None:
        store_extra(self.cost, self.key, self.value.to_dict())


class DraftModelDrafter(TokenTimed):
    name = "draft"
    reads = NOTHING
    taps = None

    def __init__(self, model: Model, kv: KVSeq, n_max: int = 16, n_min: int = 0, p_min: float = 0.0,
                 seed: int | None = None, t_token: float = 0.0, is_stop=None, state: DraftState | None = None):
        """`is_stop(token)`: the token ends a generation; a greedy draft ends before it (the row
        before yields it where the target ends), a sampled one with it (never a filter on a drawn
        token: the drafted law stays the draft model's). `state`: what it learned before (kept by
        the engine), else a fresh one with `t_token` seconds per drafted token."""
        self.model = model
        self.is_stop = is_stop
        self.kv = kv
        self.n_max, self.n_min, self.p_min = n_max, n_min, p_min
        self.state = state if state is not None else DraftState(t_token=t_token)
        self.rng = np.random.default_rng(None if seed is None else seed + 1)

    # the TokenTimed loop reads these; they live in the kept state
    @property
    def calib(self) -> Calibration:
        return self.state.calib

    @property
    def t_token(self) -> float:
        return self.state.t_token

    @t_token.setter
    def t_token(self, v: float) -> None:
        self.state.t_token = v

    def begin(self, prompt: list[int]) -> None:
        pass  # the cache is synced to the context on every proposal

    def propose(self, context: list[int], budget: Budget) -> Draft:
        limit = min(self.n_max, budget.max_nodes, self.kv.room() - 2)
        if limit <= 0 or limit < self.n_min:
            return Draft()
        st = self.state
        gated = self.n_min == 0 and st.t_token > 0
        if gated:
            # Running the draft model costs even when its draft is then dropped: reading what was
            # committed since it last ran (the prompt, the first time; a stretch another drafter
            # drafted, in `auto`; weighed as spread over the CATCH_UP_STEPS steps it serves), then a
            # decode per token. So it runs only where that pays on this machine's cost curve:
            # never where even an always-right draft would not pay for it;
            # not while a draft as good as its recent ones (its confidence, calibrated against
            # what the target accepted, kept across processes) would not; and a probe now and then
            # (its confidence is learned only from what it drafts) only while probes cost at most
            # PROBE_SHARE of the plain steps between them. A run that then drafts nothing still
            # paid its catch-up and a decode: weighed by the share of runs that drafted (WEIGH_HITS).
            behind = len(context) - min(self.kv.common_prefix(context), len(context) - 1)
            catch_up = max(0, behind - 1) * st.t_read
            fee = catch_up / CATCH_UP_STEPS  # a step's share of it
            best = min(1.0, self.calib.factor(1))  # what a draft model sure of every token would be worth
            if budget.gate([best ** i for i in range(1, limit + 1)], st.t_token, fee) == 0:
                return Draft()
            a = min(0.99, self.calib.factor(1) * st.mean_conf)
            if WEIGH_HITS:
                # a run drafts with chance h: it pays if h x (the draft's worth) exceeds
                # (1 - h) x (what a run that drafts nothing costs: the fee and the one decode)
                h = max(HIT_FLOOR, st.hit)
                fee = (fee + (1.0 - h) * st.t_token) / h
            if budget.gate([a ** i for i in range(1, limit + 1)], st.t_token, fee) == 0:
                st.skipped += 1
                plain = budget.cost.t(1, budget.n_past)
                probe = catch_up + st.t_token + budget.cost.t(2, budget.n_past) - plain
                if st.skipped < st.probe_every or probe > PROBE_SHARE * st.skipped * plain:
                    return Draft()
                st.probe_every = min(1024, st.probe_every * 2)  # probe less often each time
            else:
                st.probe_every = 32
            st.skipped = 0
        t0 = time.perf_counter()
        row, n_new = self.kv.sync(context)
        dt = time.perf_counter() - t0
        if n_new <= 2:  # a catch-up of a token or two costs about one draft step
            self._time_token(dt)
        elif n_new >= 8:  # a longer one: its time per token read (drafting's entry fee, above)
            st.t_read = dt / n_new if st.t_read == 0 else 0.8 * st.t_read + 0.2 * dt / n_new
        ctx, sampling, stop = self.kv.ctx, budget.sampling, self.is_stop
        logits = q = None
        probs: list[np.ndarray] = []

        def top() -> float:
            nonlocal logits, q
            logits = ctx.logits(row)
            q = None if sampling.greedy else warp(logits, sampling)
            t = top_prob(logits) if q is None else float(q.max())  # the distribution's, never the drawn token's
            st.mean_conf = 0.95 * st.mean_conf + 0.05 * t
            return t

        def draw() -> int | None:
            if q is None:
                x = int(np.argmax(logits))
                # greedy: the target ends here if the row before yields the end token, which it
                # does as the step's own token; the end token's row would buy nothing
                return None if stop is not None and stop(x) else x
            probs.append(q)
            return sample(q, self.rng)

        def advance(x: int, n: int) -> bool:
            nonlocal row
            if stop is not None and stop(x):
                return False  # sampled: a stop after a drafted token, never a filter on it (exactness)
            t0 = time.perf_counter()
            row = self.kv.extend([x])
            self._time_token(time.perf_counter() - t0)
            return True

        tokens, est, _ = self.gated_chain(budget, limit, self.n_min, self.p_min, top, draw, advance)
        if gated:
            st.hit += HIT_RATE * ((1.0 if tokens else 0.0) - st.hit)
        if len(tokens) < max(1, self.n_min):
            return Draft()
        d = Draft.chain(tokens, probs or None, self.name, est)
        if n_new > 2:  # a catch-up: charged to this step as the gate weighed it, a share
            d.spread = dt * (1.0 - 1.0 / CATCH_UP_STEPS)
        return d

    def end(self) -> None:
        pass
