"""Several requests decoded together (`edgespec batch -np N`): continuous batching with drafts.

Up to N sequences share every `llama_decode`, one sequence id each, each with its own chain
draft; a finished sequence frees its slot for the next request at once. Draft-free drafters
share one Lookahead trie (and its calibration), so similar requests draft from each other.

Exactness. The context keeps one KV stream per sequence (not a unified cache): a sequence's
cells then stay in position order whatever the others do, and with a q8_0 KV cache llama.cpp's
CPU attention visits exactly the same cells in the same order as when the sequence is decoded
alone. Weights see at most `max_exact_rows` rows per decode (the engine's probe; under the `batched`
exactness policy more, see costmodel.resolve_policy), so every row's
logits equal a one-row decode's and greedy output equals plain greedy decoding token for token.
llama.cpp computes a multi-stream decode in one pass only when every sequence brings the same
number of rows (otherwise in several passes, see `split_passes`), so each step weighs one draft
length for all sequences (shorter drafts padded) against each sequence's own confident prefix
(more passes), on the measured cost curve and every drafter's confidence.

Prompts are read in chunks (`prefill_chunk` tokens, one decode each), one chunk per step,
between the other slots' steps: a long prompt delays the other streams by one chunk at a time,
and a request abandoned while its prompt is read (`stop`) frees its slot after the current
chunk. Chunks are their own decodes, as plain decoding's prompt reading is, so exactness holds.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator


import numpy as np

from .. import methods
from ..costmodel import CostModel, verify_rows
from ..draft import Draft
from ..drafters.base import Budget, NullDrafter, every
from ..errors import ContextFullError, EdgespecError
from ..events import StepEvent
from ..kv import KVSeq, decode_chains
from ..lifecycle import Lifecycle
from ..sampling import SamplingConfig
from ..rows import Shaper
from ..verify import verify_step

log = logging.getLogger(__name__)

PROBE_EVERY = 16  # steps without drafts before one token is drafted anyway (estimates recover)
PREFILL_CHUNK = 128  # prompt tokens read per decode while other sequences wait for their step


@dataclass
class Job:
    """One request for the scheduler; `tag` is the caller's own."""

    prompt: list[int]
    max_tokens: int
    sampling: SamplingConfig
    tag: Any = None
    share: str | None = ""  # jobs with the same share draft from one trie; None: a trie of its own


@dataclass
class SeqGeneration(Lifecycle):
    """One request in a slot (a `Lifecycle`: `tokens` and `stats` grow as it goes)."""

    job: Job | None = None
    kv: KVSeq | None = None
    drafter: Any = None
    stopped: bool = False
    done: bool = False
    rng: Any = None
    pending: list[int] = field(default_factory=list)  # committed, not yet in the cache
    step_no: int = 0
    read: int = 0  # prompt tokens in the cache so far
    reading: bool = True  # the prompt is still being read (no step yet)
    pool: Any = None  # a SharedLookahead of this generation's own, closed when it ends

    @property
    def drafter_name(self) -> str:
        return self.drafter.name

    def stop(self) -> None:
        """End this generation after the current step (a stop string was seen)."""
        self.stopped = True


class MultiDecoder:
    def __init__(self, engine, n_parallel: int, method: str, quiet: bool = False, reuse: bool = False,
                 cache=None):
        """`reuse`: each slot keeps what it last held, and a request goes to the free slot (or
        `cache`, a `PromptCache` in host RAM) sharing the longest prefix with its prompt under
        its `share` key, reading only the rest (see promptcache.SlotTable)."""
        from ..drafters.lookahead import SharedLookahead
        from ..promptcache import SlotTable

        m = methods.get(method)
        if not m.multi_sequence:
            raise EdgespecError(f"--spec {method} decodes one sequence at a time; with -np > 1 choose one of "
                                f"{', '.join(methods.multi_sequence())}")
        if method == "auto" and engine.draft_model is not None and not quiet:
            log.warning("with -np above 1, --spec auto drafts with lookahead only (the draft model is unused)")
        self.engine = engine
        self.method = method
        self.cost: CostModel = engine.cost
        self.policy = engine.policy
        exact = self.rows
        if n_parallel > exact:
            if not quiet:
                log.warning(f"{engine.target.path.name}: batches of more than {exact} rows are not bit-exact "
                            f"with this build, so at most {exact} sequences decode together (a q4_0 variant allows more)")
            n_parallel = exact
        self.n_parallel = max(1, n_parallel)
        self.ctx = engine.use_streams(self.n_parallel)
        self.kvs = [KVSeq(self.ctx, i) for i in range(self.n_parallel)]
        self.table = SlotTable(self.kvs, reuse, cache)
        self.max_draft = 16
        self.trees = m.trees
        self.pools: dict[str, SharedLookahead] = {}  # by a job's `share`
        self.prefill_chunk = PREFILL_CHUNK
        self._zero_steps = 0

    @property
    def rows(self) -> int:
        """The most rows of one decode, all sequences together (the exactness policy's limit)."""
        return verify_rows(self.cost, self.policy)

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()
        self.pools.clear()
        self.engine.use_streams(None)

    def _drafter(self, seed: int | None, share: str | None):
        """A drafter, and the trie it alone uses (None when it drafts from a shared one)."""
        pool = own = None
        if self.trees:
            pool, own = methods.lookahead_pool(self.engine, share, self.pools)
        opt = methods.Options(seed=seed, shared=pool, max_branches=1, single_sequence=False)
        return methods.build_drafter(self.engine, self.method, opt), own

    # -- the loop -------------------------------------------------------------------------

    def run(self, jobs: Iterable[Job]) -> Iterator[tuple[str, Any, Any]]:
        """Yield ("read", gen, tokens read so far) after each chunk of a prompt, ("step", gen,
        StepEvent), ("done", gen, None) and ("error", job, EdgespecError) as they happen. `jobs`
        may yield None for "nothing waiting now" (a server's queue). Call `gen.stop()` on a read
        or a step to end that generation; close the iterator to abandon the rest (slots are freed)."""
        source = iter(jobs)
        slots: list[SeqGeneration | None] = [None] * self.n_parallel
        exhausted = False
        end = object()
        turn = 0  # the slot whose prompt is read next, when several are
        try:
            while True:
                idle = False  # the source had nothing waiting (it yielded None)
                while not exhausted and not idle:
                    free = [i for i in range(self.n_parallel) if slots[i] is None]
                    if not free:
                        break
                    job = next(source, end)
                    if job is end:
                        exhausted = True
                        break
                    if job is None:
                        idle = True
                        break
                    try:
                        i, keep = self._place(job, free)
                    except Exception as e:  # that request's error; the others go on
                        yield "error", job, e
                        continue
                    try:
                        slots[i] = self._admit(job, i, keep)
                    except Exception as e:
                        self.kvs[i].reset()
                        self.table.release(i, None, False)
                        yield "error", job, e
                if not any(slots):
                    if exhausted:
                        return
                    continue  # an endless source (a server) blocks in `next` until a job comes
                reading = [i for i in range(self.n_parallel) if slots[i] is not None and slots[i].reading]
                if reading:  # one chunk of one prompt, then the others' step
                    i = min(reading, key=lambda j: (j - turn) % self.n_parallel)
                    turn = (i + 1) % self.n_parallel
                    g = slots[i]
                    try:
                        ev = self._read_chunk(g)
                    except Exception as e:
                        self._finish(g, failed=True)
                        slots[i] = None
                        yield "error", g.job, e
                    else:
                        yield ("read", g, g.read) if ev is None else ("step", g, ev)
                        if g.done or g.stopped:
                            self._finish(g)
                            slots[i] = None
                            yield "done", g, None
                active = [g for g in slots if g is not None and not g.reading]
                if not active:
                    continue
                try:
                    steps = self._step(active)
                except Exception as e:  # a failed decode fails the requests it carried, not the batch
                    steps = []
                    for i, g in enumerate(slots):
                        if g is not None and not g.reading:
                            self._finish(g, failed=True)
                            slots[i] = None
                            yield "error", g.job, e
                for g, ev in steps:
                    yield "step", g, ev
                for i, g in enumerate(slots):
                    if g is not None and (g.done or g.stopped):
                        self._finish(g)
                        slots[i] = None
                        yield "done", g, None
        finally:
            for g in slots:
                if g is not None:
                    self._finish(g, failed=True)

    def _place(self, job: Job, free: list[int]) -> tuple[int, int]:
        """The free slot for `job` and the prompt tokens its cache holds already."""
        if not job.prompt:
            raise EdgespecError("empty prompt")
        if len(job.prompt) >= self.kvs[0].capacity:
            raise ContextFullError(f"prompt of {len(job.prompt)} tokens does not fit in a context of "
                                   f"{self.kvs[0].capacity} tokens (raise -c)")
        try:
            p = self.table.place(free, job.share, job.prompt)
        except Exception:  # a slot's cache may be half changed: the free ones start empty
            for i in free:
                self.kvs[i].reset()
                self.table.release(i, None, False)
            raise
        return p.slot, p.keep

    def _admit(self, job: Job, slot: int, keep: int = 0) -> SeqGeneration:
        """A generation in `slot`, its prompt checked, not yet read; the slot's cache holds the
        prompt's first `keep` tokens already."""
        kv = self.kvs[slot]
        drafter, own = self._drafter(job.sampling.seed, job.share)
        g = SeqGeneration(self.engine, job.prompt, job.max_tokens, job.sampling, job=job, kv=kv, drafter=drafter,
                          pool=own)
        g.stats.n_prompt = len(job.prompt)
        g.stats.n_prompt_cached = g.read = keep
        g.reuse = self.table.reuse
        g.stats.finish_reason = "interrupted"
        g.shaper = Shaper.build(self.engine.target, job.sampling)  # grammar, penalties, logprobs
        g.t_start = time.perf_counter()
        kv.ctx.set_hidden_taps(None)
        return g

    def _read_chunk(self, g: SeqGeneration) -> StepEvent | None:
        """Read the next chunk of `g`'s prompt; at its end, pick the first token and return its
        step event (as `Lifecycle._prologue` does for one sequence)."""
        t0 = time.perf_counter()
        chunk = g.prompt[g.read: g.read + self.prefill_chunk]
        last = g.read + len(chunk) >= len(g.prompt)
        row = g.kv.extend(chunk, want_logits=last)
        g.read += len(chunk)
        g.stats.t_prompt += time.perf_counter() - t0
        if not last:
            return None
        g.rng = np.random.default_rng(g.sampling.seed)
        first = verify_step(Draft(), lambda n: g.kv.ctx.logits(row), g.sampling, g.rng, g.shaper)[1]
        g.context = list(g.prompt)
        g.reading = False
        g.drafter.begin(g.prompt)
        g.t_start = time.perf_counter()
        g.pending = [first]
        return self._emit(g, [first], Draft(), [], 0.0, 0.0, 0)

    def _finish(self, g: SeqGeneration, failed: bool = False) -> None:
        """End `g`: with reuse, its slot's cache is left holding exactly the committed text but
        its last token (`KVSeq.settle`, as plain decoding leaves it), or the part of the prompt
        read so far; emptied after a failure."""
        g.stats.t_gen = time.perf_counter() - g.t_start
        g.drafter.end()
        kept = False
        if g.reuse and not failed:
            try:
                if g.context:
                    g.kv.settle(g.context[:-1], self.engine.max_verify_rows)
                kept = True  # while reading, the cache holds exactly the prompt's first `read` tokens
            except Exception:  # never mask how the generation ended
                kept = False
        if not kept:
            g.kv.reset()
        self.table.release(g.kv.seq, g.job.share, kept)
        if g.pool is not None:
            g.pool.close()
            g.pool = None

    def _emit(self, g: SeqGeneration, committed: list[int], draft: Draft, accepted: list[int],
              t_draft: float, t_verify: float, step: int) -> StepEvent:
        """`draft`: the drafter's own tokens (no padding); `accepted`: those of its nodes kept."""
        ev, g.done = g._commit(step, draft, accepted, committed, t_draft, t_verify,
                                draft.source or g.drafter.name)
        return ev

    def _step(self, active: list[SeqGeneration]) -> list[tuple[SeqGeneration, StepEvent]]:
        n = len(active)
        rooms = [g.kv.room() - len(g.pending) for g in active]
        events = []
        if min(rooms) < 0:
            for g, room in zip(active, rooms):
                if room < 0:
                    g.stats.finish_reason = "context"
                    g.done = True
            active = [g for g, room in zip(active, rooms) if room >= 0]
            if not active:
                return events
            n, rooms = len(active), [r for r in rooms if r >= 0]
        kmax = min(self.max_draft, self.rows - n, min(rooms))
        drafts, paths, t_drafts = [], [], []
        for g in active:
            t1 = time.perf_counter()
            d, p = Draft(), []
            if kmax > 0 and not isinstance(g.drafter, NullDrafter):
                # every candidate, sized below with all sequences' together (`gated` off: the
                # drafter's own cost gates let everything within kmax through)
                budget = Budget(kmax, 1, 1, self.cost, g.job.sampling, g.kv.n, gated=False)
                d, p = every(g.drafter.propose(g.context, budget))
                if d.tokens and not d.is_chain:
                    raise EdgespecError("internal: batch drafts must be chains")
                p = p[: len(d)] if len(p) >= len(d) else [0.5] * len(d)
            drafts.append(d)
            paths.append(p)
            t_drafts.append(time.perf_counter() - t1)
        lens = self._choose_layout(active, paths, kmax)
        items = []
        for g, d, k in zip(active, drafts, lens):
            chain = list(d.tokens[:k])
            chain += [g.pending[-1]] * (k - len(chain))  # padding: verified like any draft
            items.append((g.kv, g.pending, chain))
        rows = sum(1 + len(c) for _, _, c in items)
        predicted = self._layout_time([g.kv.seq for g in active], [1 + len(c) for _, _, c in items],
                                      [g.kv.n for g in active], raw=True)
        t2 = time.perf_counter()
        roots = decode_chains(self.ctx, items)
        t_verify = time.perf_counter() - t2
        self.cost.observe(rows, 0, t_verify, predicted)
        for g, d, (_, pending, chain), root, td in zip(active, drafts, items, roots, t_drafts):
            accepted, nxt = verify_step(Draft.chain(chain), lambda i, r=root: self.ctx.logits(r + 1 + i),
                                        g.job.sampling, g.rng, g.shaper)
            acc_tokens = [chain[a] for a in accepted]
            g.kv.commit_chain(pending, acc_tokens)
            g.pending = [nxt]
            n_real = min(len(d), len(chain))
            real = Draft(d.tokens[:n_real], d.parents[:n_real], None, d.source,
                         d.est[:n_real] if d.est is not None else None)
            kept = [a for a in accepted if a < n_real]  # accepted padding counts as the target's own
            g.drafter.accept(real, kept, acc_tokens + [nxt])
            g.step_no += 1
            events.append((g, self._emit(g, acc_tokens + [nxt], real, kept, td, t_verify, g.step_no)))
        return events

    def _choose_layout(self, active: list[SeqGeneration], paths: list[list[float]], kmax: int) -> list[int]:
        """Draft lengths per sequence for this step: the layout with the most expected tokens
        per second of predicted decode time. llama.cpp splits a multi-stream decode into passes
        of equal rows per sequence (see `split_passes`), so two families are weighed: one length
        for all, shorter drafts padded (one pass), and each sequence its own confident prefix
        (no padding, extra passes for the longer drafts)."""
        n = len(active)
        zero = [0] * n
        longest = max((len(p) for p in paths), default=0)
        if min(kmax, longest) <= 0:
            return zero
        seqs = [g.kv.seq for g in active]
        past = [g.kv.n for g in active]
        limit = self.rows  # rows of one decode, all sequences together

        def rate(lens: list[int]) -> float:
            gain = n + sum(sum(p[:k]) for p, k in zip(paths, lens))
            return gain / self._layout_time(seqs, [1 + k for k in lens], past)

        best, best_rate = zero, rate(zero) * 1.02
        for k in range(1, min(kmax, longest) + 1):
            if n * (1 + k) > limit:
                break
            r = rate([k] * n)
            if r > best_rate:
                best, best_rate = [k] * n, r
        for tau in (0.9, 0.75, 0.6, 0.45, 0.3):
            lens = [min(kmax, sum(1 for x in p if x >= tau)) for p in paths]
            if not any(lens) or n + sum(lens) > limit:
                continue
            r = rate(lens)
            if r > best_rate:
                best, best_rate = lens, r
        if not any(best):
            self._zero_steps += 1
            if self._zero_steps >= PROBE_EVERY:  # let the calibration see outcomes now and then
                self._zero_steps = 0
                return [min(1, len(p)) for p in paths]
        else:
            self._zero_steps = 0
        return best

    def _layout_time(self, seqs: list[int], counts: list[int], past: list[int], raw: bool = False) -> float:
        by_seq = dict(zip(seqs, zip(counts, past)))
        total = 0.0
        for group in split_passes([by_seq.get(s, (0, 0))[0] for s in range(self.n_parallel)]):
            rows = sum(m for _, m in group)
            toks = sum(m * by_seq[s][1] for s, m in group)
            total += self.cost.predict_multi(rows, toks) if raw else self.cost.t_multi(rows, toks)
        return total


def split_passes(counts: list[int]) -> list[list[tuple[int, int]]]:
    """How llama.cpp (one KV stream per sequence) splits a decode in which sequence id i brings
    counts[i] rows: each pass takes the first sequence with rows left and the run of consecutive
    ids after it that have rows left, the same number of rows from each (the fewest any has).
    Returns the passes as [(sequence id, rows)]."""
    rem = list(counts)
    out = []
    while any(rem):
        first = next(i for i, r in enumerate(rem) if r > 0)
        group = [first]
        while group[-1] + 1 < len(rem) and rem[group[-1] + 1] > 0:
            group.append(group[-1] + 1)
        m = min(rem[i] for i in group)
        for i in group:
            rem[i] -= m
        out.append([(i, m) for i in group])
    return out
