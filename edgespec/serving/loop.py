"""Serving requests through the engine: one at a time (every method, a shared lookahead trie) or
several sequences per decode (`-np N`), each result handed on the moment it is complete.

The one serving loop of `edgespec batch` (a list of requests) and `edgespec serve` (an endless
source that yields None when nothing is waiting, text streamed through `on_text`, a request's
`cancelled` flag stopping its sequence after the current step)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable, Iterator

from .. import methods
from ..errors import Cancelled, EdgespecError
from ..events import Stats
from ..text import TextStream
from .records import echo_logprobs, error_record, failure, logprobs_body, ok_record
from .requests import Request, prompt_of
from .schema import CHAT_URL, RequestError

@dataclass
class Totals:
    """What a run served: requests ok and failed, the merged stats of the finished ones, wall
    time, and each finished request's tokens (for --compare)."""

    ok: int = 0
    failed: int = 0
    stats: Stats = field(default_factory=Stats)
    wall: float = 0.0
    outputs: dict = field(default_factory=dict)  # custom_id -> generated token ids
    active: int = 0  # requests being decoded now (a server's source blocks only when none are)

    def add(self, st: Stats) -> None:
        self.ok += 1
        self.stats.merge(st)

    tokens_in = property(lambda self: self.stats.n_prompt)
    tokens_cached = property(lambda self: self.stats.n_prompt_cached)  # of tokens_in, found in the KV cache
    tokens_out = property(lambda self: self.stats.n_generated)
    drafted = property(lambda self: self.stats.n_drafted)
    accepted = property(lambda self: self.stats.n_accept)
    steps = property(lambda self: self.stats.n_steps)
    t_prompt = property(lambda self: self.stats.t_prompt)  # prompts are read one at a time: a sum

    @property
    def throughput(self) -> float:
        return self.tokens_out / self.wall if self.wall > 0 else 0.0

    @property
    def decode_throughput(self) -> float:
        """Generated tokens per second of wall time outside prompt processing."""
        t = self.wall - self.t_prompt
        return self.tokens_out / t if t > 0 else 0.0

    def to_dict(self) -> dict:
        st = self.stats
        return {
            "requests": self.ok + self.failed, "ok": self.ok, "failed": self.failed, "tokens_in": self.tokens_in,
            "tokens_in_cached": self.tokens_cached,
            "tokens_out": self.tokens_out, "wall_s": round(self.wall, 3), "tokens_per_s": round(self.throughput, 2),
            "prompt_s": round(self.t_prompt, 3), "decode_tokens_per_s": round(self.decode_throughput, 2),
            "drafted": self.drafted, "accepted": self.accepted, "acceptance_rate": round(st.acceptance_rate, 4),
            "mean_accepted_length": round(st.mean_accepted_length, 4),
        }


def _finish_reason(st: Stats, text: TextStream, req: Request) -> str:
    if _cancelled(req):
        return "cancelled"
    return "stop" if text.hit or st.finish_reason == "stop" else "length"


def _started_before(target, tokens: list[int], nbytes: int) -> int:
    """How many of `tokens` start within the first `nbytes` bytes of their text."""
    n = pos = 0
    for t in tokens:
        if pos >= nbytes:
            break
        pos += len(target.piece(t))
        n += 1
    return n


def _cancelled(req: Request) -> bool:
    return req.cancelled or (req.parent is not None and req.parent.cancelled)


def expand_choices(reqs: Iterable[Request | None], emit):
    """Requests with n > 1 as n requests of one choice each (seeds seed, seed+1, ...: each choice
    its own draw), and an `emit` that answers the request once all of its choices are done: one
    record with n choices and the usage and speculative counts summed."""
    from dataclasses import replace

    groups: dict[int, list] = {}

    def source():
        for req in reqs:
            if req is None or req.n <= 1 or req.error is not None:
                yield req
                continue
            groups[id(req)] = [None] * req.n
            for i in range(req.n):
                seed = req.sampling.seed
                yield replace(req, n=1, index=i, parent=req,
                              sampling=replace(req.sampling, seed=None if seed is None else seed + i))

    def emit_choice(req: Request, rec: dict) -> None:
        if req.parent is None:
            emit(req, rec)
            return
        parent = req.parent
        got = groups.get(id(parent))
        if got is None:  # an earlier choice failed: the request was answered with its error
            return
        got[req.index] = rec
        if rec["error"] is not None:
            del groups[id(parent)]
            emit(parent, {**rec, "custom_id": parent.custom_id})
            return
        if any(r is None for r in got):
            return
        del groups[id(parent)]
        body = dict(got[0]["response"]["body"])
        bodies = [r["response"]["body"] for r in got]
        body["choices"] = [{**b["choices"][0], "index": i} for i, b in enumerate(bodies)]
        u = body["usage"] = dict(body["usage"])
        u["completion_tokens"] = sum(b["usage"]["completion_tokens"] for b in bodies)
        u["total_tokens"] = u["prompt_tokens"] + u["completion_tokens"]
        sp = body["speculative"] = dict(body["speculative"])
        for k in ("steps", "drafted_tokens", "accepted_tokens"):
            sp[k] = sum(b["speculative"][k] for b in bodies)
        sp["acceptance_rate"] = round(sp["accepted_tokens"] / sp["drafted_tokens"], 4) if sp["drafted_tokens"] else 0.0
        emit(parent, {**got[0], "response": {**got[0]["response"], "body": body}})

    return source(), emit_choice


def run_requests(engine, reqs: Iterable[Request | None], method: str, n_parallel: int, emit, on_step=None,
                 quiet: bool = False, totals: Totals | None = None, on_text=None, on_logprobs=None,
                 reuse: bool = False, cache=None) -> Totals:
    """Serve `reqs` (None items: nothing is waiting now); `emit(req, record)` receives every
    result as soon as it is complete, `on_text(req, piece)` the text as it is final (stop strings
    cut), `on_logprobs(req, entries)` just before it the log-probabilities of the tokens that text
    starts (requests that ask for them). `totals` (filled as results come) keeps the count when the
    run is interrupted. `reuse`: each sequence slot keeps what it last held, and a request goes to
    the free slot whose cache shares the longest prefix with its prompt among those last used by
    its share (a conversation's next turn, a shared system prompt), or to `cache` (a
    `promptcache.PromptCache` in host RAM) when it holds a longer one, and reads only the rest
    (requests without a share reuse nothing); the run starts cold, so two runs of the same
    requests see the same caches."""
    totals = totals if totals is not None else Totals()
    model_name = engine.cfg.model
    reqs, emit = expand_choices(reqs, emit)
    t0 = time.perf_counter()

    def fail(req: Request, err: RequestError) -> None:
        totals.failed += 1
        emit(req, error_record(req, err))

    def gone(req: Request) -> None:
        emit(req, error_record(req, RequestError("the client went away", "cancelled", 499)))

    def tokens_of(req: Request) -> list[int] | None:
        """The request's prompt tokens, or None after writing its error line."""
        if req.error:
            fail(req, req.error)
            return None
        if req.tokens is not None:
            return req.tokens
        try:
            return prompt_of(engine, req)
        except RequestError as e:
            fail(req, e)
        except EdgespecError as e:
            fail(req, RequestError(str(e)))
        except UnicodeEncodeError:
            fail(req, RequestError("the prompt is not valid Unicode text (a lone surrogate such as \\ud800)"))
        except Exception as e:  # one request never ends the batch
            fail(req, failure(e))
        return None

    sent: dict[int, int] = {}  # id(request) -> logprob entries handed to on_logprobs

    def release(req: Request, gen, text: TextStream) -> int:
        """Hand on the logprobs of the tokens the released text starts; the count released."""
        if req.sampling.logprobs is None:
            return 0
        n = _started_before(engine.target, gen.tokens, len(text.given.encode("utf-8")))
        done = sent.get(id(req), 0)
        if on_logprobs is not None and n > done:
            offset = len(engine.target.detokenize(gen.tokens[:done])) if done else 0
            offset += len(req.prompt) if req.echo else 0
            on_logprobs(req, logprobs_body(engine.target, gen.logprobs[done:n], req.url == CHAT_URL, offset))
        sent[id(req)] = n
        return n

    def step_text(req: Request, gen, text: TextStream, piece: str) -> None:
        if on_text and piece:
            release(req, gen, text)
            on_text(req, piece)

    def finished(req: Request, gen, text: TextStream) -> None:
        rest = text.flush()
        n = release(req, gen, text)
        sent.pop(id(req), None)
        if on_text and rest:
            on_text(req, rest)
        totals.add(gen.stats)
        totals.outputs[req.custom_id] = list(gen.tokens)
        lp = None
        if req.sampling.logprobs is not None:
            chat = req.url == CHAT_URL
            lp = logprobs_body(engine.target, gen.logprobs[:n], chat, len(req.prompt) if req.echo else 0)
            if req.echo:
                lp = echo_logprobs(engine.target, req.prompt, lp)
        emit(req, ok_record(req, text.final(), _finish_reason(gen.stats, text, req), gen.stats, model_name, method,
                            gen.drafter_name, lp))

    try:
        if n_parallel <= 1:
            if reuse:
                engine.kv.reset()
            _serve_one_by_one(engine, reqs, method, fail, gone, tokens_of, finished, on_step, step_text, totals,
                              reuse, cache)
            return totals
        from ..schedulers.multi import Job, MultiDecoder

        dec = MultiDecoder(engine, n_parallel, method, quiet=quiet, reuse=reuse, cache=cache)
        texts: dict[int, TextStream] = {}  # by id of the Job, which error events carry too

        def jobs() -> Iterator[Job | None]:
            for req in reqs:
                if req is None:
                    yield None  # nothing waiting: the decoder goes on with what it has
                    continue
                if req.cancelled:  # the client left before its turn (serve)
                    gone(req)
                    continue
                prompt = tokens_of(req)
                if prompt is not None:
                    totals.active += 1
                    yield Job(prompt, req.max_tokens, req.sampling, tag=req, share=req.share)

        events = dec.run(jobs())
        try:
            for kind, g, x in events:
                if kind == "read":  # a chunk of the prompt is read
                    if g.job.tag.cancelled:
                        g.stop()
                elif kind == "step":
                    req = g.job.tag
                    text = texts.get(id(g.job))
                    if text is None:
                        text = texts[id(g.job)] = TextStream(engine.target, req.stop)
                    if on_step:
                        on_step(x)
                    step_text(req, g, text, text.feed(x.tokens))
                    if text.hit or _cancelled(req):
                        g.stop()
                elif kind == "done":
                    totals.active -= 1
                    finished(g.job.tag, g, texts.pop(id(g.job)))
                else:  # here `g` is the request's Job
                    totals.active -= 1
                    texts.pop(id(g), None)
                    fail(g.tag, failure(x))
        finally:
            events.close()  # frees the slots (their KV cells) before the context goes
            dec.close()
        return totals
    finally:
        totals.wall = time.perf_counter() - t0


def _serve_one_by_one(engine, reqs, method, fail, gone, tokens_of, finished, on_step, step_text, totals,
                      reuse: bool = False, cache=None) -> None:
    """`-np 1`: every method, each request a generation of its own; lookahead requests (and
    auto's) with the same `share` draft from one trie, so similar requests draft from each
    other; a request without one has its own trie. The draft model's cache (which keeps the
    last prompt) is cleared between requests that do not share. With `reuse` the one slot is
    placed as in the multi-sequence scheduler (`promptcache.SlotTable`): kept from the request
    before of the same share, or restored from `cache`."""
    from ..drafters.lookahead import SharedLookahead
    from ..promptcache import SlotTable

    m = methods.get(method)
    table = SlotTable([engine.kv], reuse, cache)
    pools: dict[str, SharedLookahead] = {}
    last_share: object = ()
    try:
        for req in reqs:
            if req is None:
                continue
            if req.cancelled:
                gone(req)
                continue
            prompt = tokens_of(req)
            if prompt is None:
                continue
            totals.active = 1
            own = None
            # the caches (the target's, read from where the last prompt left it with `reuse`; the
            # draft model's) carry over only between requests of one share (one API key)
            same = req.share is not None and req.share == last_share
            if engine.draft_kv is not None and not same:
                engine.draft_kv.reset()
            last_share = req.share
            use = reuse and req.share is not None
            gen, placed = None, False  # placed: the slot's cache was touched for this request
            try:
                if table.kvs[0] is not engine.kv:  # the engine's context was replaced
                    table = SlotTable([engine.kv], reuse, cache)
                if len(prompt) < engine.kv.capacity and prompt:  # else the generation says why
                    placed = True
                    table.place([0], req.share if use else None, prompt)
                drafter = None
                if m.trees:
                    shared, own = methods.lookahead_pool(engine, req.share, pools)
                    opt = methods.Options(seed=req.sampling.seed, shared=shared, max_branches=engine.cfg.max_branches)
                    drafter = methods.build_drafter(engine, method, opt)
                gen = engine.start(prompt, req.max_tokens, req.sampling, method, drafter=drafter, reuse=use)
                gen.cancelled = lambda: req.cancelled
                text = TextStream(engine.target, req.stop)
                steps = iter(gen)
                try:
                    for ev in steps:
                        if on_step:
                            on_step(ev)
                        step_text(req, gen, text, text.feed(ev.tokens))
                        if text.hit or _cancelled(req):
                            break
                finally:
                    steps.close()
            except Cancelled:  # given up while its prompt was read
                totals.active = 0
                if placed:
                    _empty(engine, table)
                gone(req)
                continue
            except Exception as e:  # one request never ends the batch: it gets its error line
                totals.active = 0
                if placed:  # else the cache is as the request before left it
                    _empty(engine, table)
                fail(req, failure(e))
                continue
            finally:
                if own is not None:
                    own.close()
            totals.active = 0
            # the generation left the cache settled (reuse) or as it was (not reused again)
            table.release(0, req.share, use and not gen._failed)
            finished(req, gen, text)
    finally:
        for pool in pools.values():
            pool.close()


def _empty(engine, table) -> None:
    """After a failed request (-np 1): the cache starts empty, reused by nobody."""
    try:
        engine.kv.reset()
    except Exception:
        pass
    if table.kvs[0] is engine.kv:
        table.release(0, None, False)
