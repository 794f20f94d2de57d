"""The speculative loop for one sequence, step by step (every method but PEARL runs through it).

One step: the drafter proposes candidates -> as many as pay on the cost curve are kept (the one
sizing step, `drafters.base.sized`) -> the target scores pending tokens plus the tree in ONE
llama_decode -> the verifier keeps the longest acceptable path plus one token of the target's
own -> the KV cache keeps exactly the committed tokens -> a StepEvent goes out. Plain decoding
(`--spec none`) is the same loop with empty drafts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

from ..costmodel import loss_slack
from ..draft import Draft
from ..drafters.base import ALL_ROWS, FEATURES, LAYER_TAPS, NEXTN_ROWS, NOTHING, Budget, Drafter, NullDrafter, sized
from ..events import StepEvent
from ..lifecycle import Lifecycle
from ..verify import verify_step

# The loss bound's ledger charges the measured drafting time of steps that a draft model drafted
# (False: the curve's row costs only, as before; scripts/conv_bench.py's --uncharged-arm measures
# the difference). Only the draft model's: its catch-ups and decodes cost a large, uneven share of a
# step the curve does not see; the text drafters' lookups cost a small, steady one (0.3-0.6% of a
# 1.5B step), and charging their measured time would make their sizes depend on timing noise.
CHARGE_DRAFTING = True
CHARGED_SOURCES = frozenset({"draft"})
# A draft model's catch-up (reading what was committed since it last ran: the whole prompt, the
# first time in a reply) serves the steps after it too; its gate weighs it as spread over them
# (draft_model.CATCH_UP_STEPS), and so does the ledger (`Draft.spread`). Charged whole, one early
# catch-up put a chat reply so far behind that lookahead's bets stopped for the rest of it (5
# drafting steps instead of 48; docs/laptop.md). False: charged whole.
SPREAD_CATCH_UP = True


@dataclass
class Generation(Lifecycle):
    drafter: Drafter = field(default_factory=NullDrafter)

    @property
    def drafter_name(self) -> str:
        return self.drafter.name

    def __iter__(self) -> Iterator[StepEvent]:
        eng, st, cfg = self.engine, self.stats, self.sampling
        ctx, kv = eng.ctx, eng.kv
        # what the drafter reads from the target (declared, see drafters.base): its features
        # (heads), or the batch rows of every target decode, read right after it (MTP's nextn states)
        reads, observe = self.drafter.reads, self.drafter.observe if self.drafter.reads != NOTHING else None
        features = reads in FEATURES
        outputs = ctx.embeddings, ctx.taps  # restored at the end when the prologue changes them
        self.drafter.begin(self.prompt)  # before the prompt: a drafter may follow it chunk by chunk
        try:
            first, rng = self._prologue(
                kv, ("all" if reads in (ALL_ROWS, LAYER_TAPS) else "last") if features else "",
                self.drafter.taps if reads == LAYER_TAPS else None,
                on_rows=(lambda pos, rows: observe(pos, rows, None)) if reads == NEXTN_ROWS else None)
            if features:
                observe(len(self.prompt) - len(self.prompt_hidden), [], self.prompt_hidden)
                self.prompt_hidden = None
            self.t_start = time.perf_counter()
            pending = [first]  # committed, not yet in the cache
            step_no = 0
            committed = [first]
            draft, accepted = Draft(), []
            t_draft = t_verify = 0.0
            # fixed for the generation; looked up once (every step's Python time is a share of
            # the plain step it runs next to)
            max_rows = min(ctx.n_batch, eng.max_verify_rows)
            n_seq_max, cost, n_min = ctx.cfg.n_seq_max, eng.cost, eng.cfg.draft_n_min
            propose, accept = self.drafter.propose, self.drafter.accept
            # against plain decoding, in plain steps: tokens committed less the steps their rows
            # cost (predicted by the curve) and the drafting time of the steps a draft model
            # drafted (as measured: its decodes, and its catch-up on what others drafted as its
            # gate spreads it, SPREAD_CATCH_UP; the curve sees neither), so that bets that did not
            # pay cannot put a reply more than LOSS_SHARE behind plain (see CostModel.best_size).
            # A 1.5B chat reply lost 15% of its time to a 0.5B draft model's catch-ups and decodes
            # for 13 kept tokens while its verifications alone ran 1.13x plain (docs/laptop.md);
            # `auto`'s gates, which also measure it, judge a member over 24 askings and across
            # replies, too late for one.
            ledger, n_tokens = 0.0, 1
            while True:
                ev, done = self._commit(step_no, draft, accepted, committed, t_draft, t_verify,
                                        draft.source or self.drafter.name)
                yield ev
                if done:
                    return
                step_no += 1
                room = ctx.n_ctx - kv.n - len(pending)
                if room < 0:
                    st.finish_reason = "context"
                    return
                n_before = kv.n
                budget = Budget(
                    max_nodes=min(room, max_rows) - len(pending),
                    max_branches=n_seq_max,
                    fixed_rows=len(pending),
                    cost=cost,
                    sampling=cfg,
                    n_past=n_before,
                    n_min=n_min,
                    slack=loss_slack(ledger, n_tokens),
                )
                t1 = time.perf_counter()
                # the drafter's candidates, as many as pay on the cost curve (see drafters.base.sized)
                draft = sized(propose(self.context, budget), budget) if budget.max_nodes > 0 else Draft()
                t2 = time.perf_counter()
                layout = kv.decode_tree(pending, draft)
                cost.observe(len(pending) + len(draft), n_before, time.perf_counter() - t2)
                accepted, nxt = verify_step(draft, lambda n: ctx.logits(layout.row(n)), cfg, rng, self.shaper)
                if observe is not None:  # the root (the last pending token) and the accepted path
                    rows = [layout.row(-1)] + [layout.row(a) for a in accepted]
                    observe(len(self.context) - 1, rows, ctx.hidden(rows) if features else None)
                # accepted nodes off the first branch are re-laid by the next decode (see commit_tree)
                relay = kv.commit_tree(layout, pending, draft, accepted)
                pending = relay + [nxt]
                committed = [draft.tokens[a] for a in accepted] + [nxt]
                t3 = time.perf_counter()
                t_draft, t_verify = t2 - t1, t3 - t2
                n_tokens += len(committed)
                if draft.tokens:  # a plain step is even with plain decoding
                    ledger += len(committed) - 1 - cost.step_loss(budget.fixed_rows + len(draft), budget.fixed_rows,
                                                                  n_before)
                    if CHARGE_DRAFTING and (draft.source or self.drafter.name) in CHARGED_SOURCES:
                        spent = t_draft - draft.spread if SPREAD_CATCH_UP else t_draft
                        ledger -= max(0.0, spent) / cost.t(budget.fixed_rows, n_before)
                accept(draft, accepted, committed)
        except GeneratorExit:  # stopped by the reader: the cache is consistent
            raise
        except BaseException:
            self._failed = True
            raise
        finally:
            st.t_gen = time.perf_counter() - self.t_start if self.t_start else 0.0
            self.drafter.end()
            self._end_cache(kv)
            if features and ctx.ptr:  # the context's outputs as the prologue found them
                ctx.set_embeddings(outputs[0])
                ctx.set_hidden_taps(outputs[1])
