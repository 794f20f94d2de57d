"""PEARL (Liu et al., ICLR 2025): the draft model and the target work at the same time.

Two moves, switched by what the target decides:

- **pre-verify**: as soon as the draft model has its first token d1, the target verifies it
  (two rows: the pending token and d1) while the draft model goes on drafting d2..dγ. If d1 is
  rejected the round ends at once, and the rest of the draft is abandoned.
- **post-verify**: while the target verifies d2..dγ, the draft model drafts the next γ tokens
  as if all were accepted. If they were, the next round starts with a draft already made.

The draft model runs in its own thread and its own llama.cpp context; the target stays in the
calling thread. ctypes releases the GIL around llama_decode, so both really run at once. The
protocol depends only on token outcomes, never on timing: draft randomness is keyed by round,
target randomness is drawn in protocol order, so a seeded run is reproducible.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from ..draft import Draft
from ..errors import EdgespecError
from ..events import StepEvent
from ..kv import KVSeq
from ..lifecycle import Lifecycle
from ..rows import Shaper
from ..sampling import SamplingConfig, sample, warp
from ..verify import verify_greedy, verify_rejection_chain


class _DraftJob:
    """Tokens the worker drafts after a fixed base, readable as they appear."""

    def __init__(self, base: list[int], n: int, epoch: int):
        self.base, self.n, self.epoch = base, n, epoch
        self.tokens: list[int] = []
        self.probs: list[np.ndarray] = []
        self.cancelled = False
        self.done = False
        self.cond = threading.Condition()

    def wait_for(self, count: int) -> int:
        """Block until `count` tokens exist or the job ended; return how many exist."""
        with self.cond:
            while len(self.tokens) < count and not self.done:
                self.cond.wait()
            return len(self.tokens)

    def cancel(self) -> None:
        with self.cond:
            self.cancelled = True

    def finish(self) -> None:
        with self.cond:
            self.done = True
            self.cond.notify_all()


class DraftWorker(threading.Thread):
    """Owns the draft model's context; drafts one job at a time, token by token."""

    def __init__(self, kv: KVSeq, sampling: SamplingConfig, seed: int | None, is_stop=None):
        super().__init__(daemon=True, name="edgespec-draft")
        self.kv = kv
        self.is_stop = is_stop  # a job ends with an end-of-generation token: nothing after it is kept
        self.sampling = sampling
        # Draft draws are keyed by (key, job, offset) so that a seeded run is reproducible
        # whatever the threads' timing. Without a seed the key is fresh entropy: a fixed key
        # would make every drafted token a fixed function of its context instead of a draw
        # from q, and the rejection rule would no longer give the target's distribution.
        self.key = seed if seed is not None else np.random.SeedSequence().entropy
        self._jobs: list[_DraftJob] = []
        self._cv = threading.Condition()
        self._stopping = False
        self.error: BaseException | None = None
        self.t_idle = 0.0
        self.t_busy = 0.0  # drafting time of every job, finished or cancelled (read after join)
        self._n_jobs = 0
        self._ended = False
        self._current: _DraftJob | None = None

    def submit(self, base: list[int], n: int) -> _DraftJob:
        # Jobs are submitted in protocol order, so their number keys the draft randomness
        # deterministically, and no two jobs share draws.
        self._n_jobs += 1
        job = _DraftJob(list(base), n, self._n_jobs)
        with self._cv:
            if self._ended:
                job.finish()
            else:
                self._jobs.append(job)
                self._cv.notify()
        return job

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            for job in self._jobs:
                job.cancel()
            self._jobs.clear()
            current = self._current
            self._cv.notify()
        if current is not None:
            current.cancel()

    def run(self) -> None:
        try:
            while True:
                t0 = time.perf_counter()
                with self._cv:
                    while not self._jobs and not self._stopping:
                        self._cv.wait()
                    if self._stopping:
                        return
                    job = self._jobs.pop(0)
                    self._current = job
                self.t_idle += time.perf_counter() - t0
                self._draft(job)
                with self._cv:
                    self._current = None
        except BaseException as e:  # surfaced to the target thread
            self.error = e
        finally:
            with self._cv:
                self._ended = True
                leftover, self._jobs = self._jobs, []
            for job in leftover:  # nobody will draft them: wake whoever waits
                job.finish()

    def _draft(self, job: _DraftJob) -> None:
        t0 = time.perf_counter()
        try:
            if job.cancelled:
                return
            ctx = self.kv.ctx
            row, _ = self.kv.sync(job.base)
            for i in range(job.n):
                if job.cancelled:
                    return
                logits = ctx.logits(row)
                if self.sampling.greedy:
                    x, q = int(np.argmax(logits)), None
                else:
                    q = warp(logits, self.sampling)
                    rng = np.random.default_rng([self.key, job.epoch, i])
                    x = sample(q, rng)
                with job.cond:
                    job.tokens.append(x)
                    if q is not None:
                        job.probs.append(q)
                    job.cond.notify_all()
                if self.is_stop is not None and self.is_stop(x):
                    return
                if i + 1 < job.n and self.kv.room() > 1:
                    row = self.kv.extend([x])
                elif i + 1 < job.n:
                    return
        finally:
            self.t_busy += time.perf_counter() - t0
            job.finish()


@dataclass
class PearlGeneration(Lifecycle):
    gamma: int = 4

    @property
    def drafter_name(self) -> str:
        return "pearl"

    def __iter__(self) -> Iterator[StepEvent]:
        eng, st, cfg = self.engine, self.stats, self.sampling
        if eng.draft_ctx is None:
            raise EdgespecError("--spec pearl needs a draft model: pass -md MODEL")
        if Shaper.needed(cfg):  # its carried verdicts bypass the shaped rows
            raise EdgespecError("--spec pearl takes no grammar, response_format, penalties, logit_bias or logprobs: "
                                "use --spec draft")
        kv = eng.kv
        gamma = max(1, min(self.gamma, eng.max_verify_rows - 1))
        first, rng = self._prologue(kv)
        worker = DraftWorker(eng.draft_kv, cfg, cfg.seed, eng.target.is_eog)
        worker.start()
        pending: list[int] = [first]  # committed, not in the target's cache
        carry = None  # the target's verdict for the next position, known but not yet used
        job, used = None, 0  # the running draft job and how many of its tokens were verified
        try:
            ev, done = self._commit(0, Draft(), [], [first], 0.0, 0.0, "pearl")
            yield ev
            step = 0
            while not done:
                step += 1
                base = list(self.context)
                if kv.room() < len(pending) + gamma + 1:
                    st.finish_reason = "context"
                    return
                mode = "post" if carry is not None else "pre"
                if job is None:
                    job, used = worker.submit(base, gamma), 0
                # pre-verify takes the first token as soon as it exists; post-verify the rest
                need = 1 if mode == "pre" else job.n - used
                tw = time.perf_counter()
                have = job.wait_for(used + need) - used
                t_wait = time.perf_counter() - tw
                if worker.error is not None:
                    raise worker.error
                if have <= 0:  # the draft model's context is full: stop as plain decoding would
                    st.finish_reason = "context"
                    return
                n = min(need, have)
                with job.cond:
                    draft = Draft.chain(job.tokens[used:used + n], job.probs[used:used + n] if not cfg.greedy else None, "pearl")
                tv = time.perf_counter()
                next_job = None
                if mode == "post":  # draft on, as if everything is accepted
                    next_job = worker.submit(base + draft.tokens, gamma)
                accepted, nxt, carry = self._verify(kv, pending, draft, carry, rng)
                t_verify = time.perf_counter() - tv
                all_ok = nxt is None
                committed = [draft.tokens[a] for a in accepted] + ([] if all_ok else [nxt])
                if mode == "pre" and all_ok:
                    used += n  # d1 accepted: the rest of this job becomes the post-verify draft
                    pending = []
                    if used >= job.n:
                        job = None
                elif mode == "pre":
                    job.cancel()  # rejected: the round ends early, the rest is dropped
                    job, pending = None, [nxt]
                    st.n_early_exit += 1
                elif all_ok:
                    job, used, pending = next_job, 0, []
                else:
                    next_job.cancel()
                    job, pending = None, [nxt]
                st.n_pre += mode == "pre"
                st.n_post += mode == "post"
                ev, done = self._commit(step, draft, accepted, committed, t_wait, t_verify, "pearl", mode)
                yield ev
        except GeneratorExit:  # stopped by the reader: the cache is consistent
            raise
        except BaseException:
            self._failed = True
            raise
        finally:
            st.t_gen = time.perf_counter() - self.t_start
            worker.stop()
            # No timeout: the worker may be inside a decode of the draft context, and the next
            # generation (or Engine.close) must not touch that context before it returns.
            worker.join()
            st.t_idle_draft = worker.t_idle
            st.t_draft_busy = worker.t_busy
            # drafting the target did not wait for ran behind verification
            st.t_draft_hidden = max(0.0, worker.t_busy - st.t_draft)
            self._end_cache(kv)

    def _verify(self, kv: KVSeq, pending, draft: Draft, carry, rng):
        """Verify a chain. With `carry` (the target's verdict for the next position, from the
        last row of the previous batch) the first draft token is checked against it and the
        cache needs no pending row. Returns (accepted, token or None, new carry)."""
        if carry is not None:
            head = Draft.chain(draft.tokens[:1], draft.probs[:1] if draft.probs else None)
            acc, y = self._check(head, lambda node: carry, rng)
            if not acc:
                return [], y, None
            x0 = draft.tokens[0]
            rest = Draft.chain(draft.tokens[1:], draft.probs[1:] if draft.probs else None)
            acc, y, carry2 = self._walk(kv, [x0], rest, rng)
            return [0] + [a + 1 for a in acc], y, carry2
        return self._walk(kv, pending, draft, rng)

    def _walk(self, kv: KVSeq, pending, draft: Draft, rng):
        """Score pending + draft in one decode and apply the rule along the chain; when every
        token passes, the last row's verdict is carried instead of drawing a bonus token."""
        cfg, ctx = self.sampling, kv.ctx
        layout = kv.decode_tree(pending, draft)
        if cfg.greedy:
            verdict = lambda node: int(np.argmax(ctx.logits(layout.row(node))))  # noqa: E731
        else:
            verdict = lambda node: warp(ctx.logits(layout.row(node)), cfg)  # noqa: E731
        acc, y = self._check(draft, verdict, rng)
        carry = verdict(len(draft.tokens) - 1) if y is None else None
        kv.commit_tree(layout, pending, draft, acc)
        return acc, y, carry

    def _check(self, draft: Draft, verdict, rng):
        """The shared verifiers, without the bonus draw."""
        if self.sampling.greedy:
            return verify_greedy(draft, verdict, bonus=False)
        return verify_rejection_chain(draft, verdict, rng, bonus=False)
