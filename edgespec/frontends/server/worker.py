"""The engine's thread: requests queued by the HTTP side are served by `run_requests`, the loop
of `edgespec batch` (up to `-np` sequences per decode, the rest waiting; with `-np 1` one at a
time with every method). Text and results go back to each request's `Sink`, on the event loop
that waits for them; a request whose client went away (`cancel`) leaves the queue and every
table at once, or, when it is being read or decoded, stops after the current prompt chunk or
step, freeing the slot."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict
from typing import Any

from ...serving.loop import Totals, run_requests
from ...serving.requests import Request
from ...serving.schema import RequestError
from .metrics import Metrics

log = logging.getLogger(__name__)


class Sink:
    """One request's channel from the engine's thread to its handler on the event loop: items
    ("text", str), ("logprobs", the next text's logprobs object), ("done", record) — the batch
    record, ok or error. The text and logprobs of a choice of n > 1 come as (index, str|object)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.t_arrival = time.monotonic()
        self.t_first: float | None = None

    def put(self, item: tuple[str, Any]) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: the server is going down
            pass


class Worker:
    def __init__(self, engine, method: str, n_parallel: int, max_queue: int = 256, reuse: bool = True,
                 cache_ram: int = 0):
        """`reuse`: slots keep what they last held for the next request of the same key;
        `cache_ram`: bytes of host RAM for sequences' KV states (0: none; see promptcache)."""
        from ...promptcache import PromptCache

        self.engine = engine
        self.method = method
        self.n_parallel = n_parallel
        self.max_queue = max_queue
        self.reuse = reuse
        self.cache = PromptCache(cache_ram) if reuse and cache_ram > 0 else None
        self.totals = Totals()
        self.metrics = Metrics(self.queue_length, lambda: self.totals.active,
                               self.cache.snapshot if self.cache is not None else None)
        self._waiting: OrderedDict[int, Request] = OrderedDict()  # queued, in arrival order
        self._inflight: dict[int, Request] = {}  # submitted, not yet answered (waiting or decoding)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._closing = False
        self._stopped = False  # the engine's thread is told to end
        self.error: str | None = None  # set if the serving loop itself died
        self._thread = threading.Thread(target=self._main, name="edgespec-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def queue_length(self) -> int:
        return len(self._waiting)

    def inflight(self) -> int:
        """Requests submitted and not yet answered or cancelled (waiting or decoding)."""
        return len(self._inflight)

    def submit(self, req: Request) -> None:
        """Queue a validated request (req.sink set); a 503 when the queue is full or the loop died."""
        if self.error is not None:
            raise RequestError(f"the engine stopped: {self.error}", "server_error", 503)
        if self._closing:
            raise RequestError("the server is shutting down", "server_error", 503)
        with self._wake:
            if len(self._waiting) >= self.max_queue:
                raise RequestError(f"{self.max_queue} requests are waiting already; try again later (--max-queue)",
                                   "server_busy", 503)
            self._inflight[id(req)] = req
            self._waiting[id(req)] = req
            self._wake.notify()

    def cancel(self, req: Request) -> None:
        """The client went away: a waiting request leaves the queue and the tables now; one being
        read or decoded stops after its current chunk or step (`_emit` then forgets it)."""
        req.cancelled = True
        with self._lock:
            waiting = self._waiting.pop(id(req), None) is not None
            if waiting:
                self._inflight.pop(id(req), None)
        if waiting:
            self.metrics.cancelled.inc()

    def close(self, timeout: float = 30.0) -> None:
        """Stop taking requests, cancel what runs, and end the engine's thread."""
        self._closing = True
        with self._wake:
            waiting = list(self._waiting.values())
            self._waiting.clear()
            for req in self._inflight.values():  # sequences decoding stop after their current step
                req.cancelled = True
            self._inflight.clear()
            self._stopped = True
            self._wake.notify()
        for req in waiting:  # queued requests are answered: the server is going down
            req.sink.put(("done", _error(req, RequestError("the server is shutting down", "server_error", 503))))
        self._thread.join(timeout)

    # -- the engine's thread --------------------------------------------------------------

    def _source(self):
        """Requests as they come: blocks while nothing is decoding, else None when none waits."""
        while True:
            with self._wake:
                if not self._waiting and not self._stopped and self.totals.active == 0:
                    self._wake.wait(0.5)
                if self._stopped:
                    return
                req = self._waiting.popitem(last=False)[1] if self._waiting else None
            yield req

    def _main(self) -> None:
        try:
            run_requests(self.engine, self._source(), self.method, self.n_parallel, self._emit,
                         on_step=self._on_step, quiet=True, totals=self.totals, on_text=self._on_text,
                         on_logprobs=self._on_logprobs, reuse=self.reuse, cache=self.cache)
        except BaseException as e:  # pragma: no cover - a bug in the loop: say so on every request
            self.error = f"{type(e).__name__}: {e}"
            log.error("the serving loop stopped: %s", self.error)
            self._closing = True

    def _on_step(self, ev) -> None:
        self.metrics.step(len(ev.tokens))

    def _on_text(self, req: Request, piece: str) -> None:
        s = req.sink
        if s.t_first is None:
            s.t_first = time.monotonic()
            self.metrics.ttft.observe(s.t_first - s.t_arrival)
        s.put(("text", piece if req.parent is None else (req.index, piece)))  # a choice of n > 1: its index

    def _on_logprobs(self, req: Request, logprobs: dict) -> None:
        if req.stream:
            req.sink.put(("logprobs", logprobs if req.parent is None else (req.index, logprobs)))

    def _emit(self, req: Request, rec: dict) -> None:
        with self._lock:
            self._inflight.pop(id(req), None)
        s = req.sink
        now = time.monotonic()
        if rec["error"] is None:
            body = rec["response"]["body"]
            spec, usage = body["speculative"], body["usage"]
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            self.metrics.finished(spec["drafter"], usage["prompt_tokens"], usage["completion_tokens"],
                                  spec["drafted_tokens"], spec["accepted_tokens"], spec["steps"], cached)
        if req.cancelled:
            self.metrics.cancelled.inc()
        elif rec["error"] is None:
            if s.t_first is None:  # an empty reply: its first token still came
                self.metrics.ttft.observe(now - s.t_arrival)
            self.metrics.duration.observe(now - s.t_arrival)
        s.put(("done", rec))


def _error(req: Request, err: RequestError) -> dict:
    from ...serving.records import error_record

    return error_record(req, err)
