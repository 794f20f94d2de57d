"""What `GET /metrics` reports, in Prometheus' text format (prometheus_client, one registry per
server): requests by endpoint and status, tokens in and out, drafted and accepted tokens and
steps per drafter (with the acceptance rate and mean accepted length derived from them), queue
length, sequences decoding, tokens/s over the last ten seconds, time to first token; prompt tokens
found in the KV cache vs read, and the host-RAM prompt cache (`--cache-ram`): its bytes, entries,
hits, misses and evictions."""

from __future__ import annotations

import threading
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

disable_created_metrics()  # no *_created series: counters since the server started

RATE_WINDOW = 10.0  # seconds of generated tokens behind the tokens/s gauge


class Metrics:
    def __init__(self, queue_len, active, cache=None):
        """`queue_len()` and `active()`: read at scrape time from the worker; `cache()`: the
        prompt cache's counters (`PromptCache.snapshot`), None without one."""
        self.registry = r = CollectorRegistry()
        self.requests = Counter("edgespec_requests", "HTTP requests answered", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("edgespec_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.prompt_cached = Counter("edgespec_prompt_tokens_cached", "of the prompt tokens of finished requests, "
                                     "those found in the KV cache (a slot's or restored from --cache-ram): not read",
                                     registry=r)
        self.prompt_read = Counter("edgespec_prompt_tokens_evaluated", "of the prompt tokens of finished requests, "
                                   "those read (evaluated)", registry=r)
        self.completion_tokens = Counter("edgespec_completion_tokens", "tokens generated for finished requests",
                                         registry=r)
        self.drafted = Counter("edgespec_drafted_tokens", "draft tokens verified", ["method"], registry=r)
        self.accepted = Counter("edgespec_accepted_tokens", "draft tokens accepted", ["method"], registry=r)
        self.steps = Counter("edgespec_steps", "verification steps (decodes of a sequence)", ["method"], registry=r)
        self.cancelled = Counter("edgespec_cancelled_requests", "requests whose client went away mid-generation",
                                 registry=r)
        self.ttft = Histogram("edgespec_time_to_first_token_seconds", "request arrival to its first generated token",
                              buckets=(0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30), registry=r)
        self.duration = Histogram("edgespec_request_duration_seconds", "request arrival to its last token",
                                  buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120), registry=r)
        self._lock = threading.Lock()
        self._recent: deque = deque()  # (time, tokens) of recent steps
        self._by_method: dict[str, list[int]] = {}  # method -> [drafted, accepted, steps]
        self._queue_len, self._active, self._cache = queue_len, active, cache
        r.register(_Derived(self))

    def step(self, n_tokens: int) -> None:
        now = time.monotonic()
        with self._lock:
            self._recent.append((now, n_tokens))
            while self._recent and self._recent[0][0] < now - RATE_WINDOW:
                self._recent.popleft()

    def finished(self, method: str, n_prompt: int, n_out: int, drafted: int, accepted: int, steps: int,
                 n_cached: int = 0) -> None:
        self.prompt_tokens.inc(n_prompt)
        self.prompt_cached.inc(n_cached)
        self.prompt_read.inc(max(0, n_prompt - n_cached))
        self.completion_tokens.inc(n_out)
        self.drafted.labels(method).inc(drafted)
        self.accepted.labels(method).inc(accepted)
        self.steps.labels(method).inc(steps)
        with self._lock:
            d = self._by_method.setdefault(method, [0, 0, 0, 0])
            d[0] += drafted
            d[1] += accepted
            d[2] += steps
            d[3] += n_out

    def tokens_per_s(self) -> float:
        now = time.monotonic()
        with self._lock:
            n = sum(k for t, k in self._recent if t >= now - RATE_WINDOW)
        return n / RATE_WINDOW

    def by_method(self) -> dict[str, list[int]]:
        with self._lock:
            return {k: list(v) for k, v in self._by_method.items()}

    def text(self) -> bytes:
        return generate_latest(self.registry)


class _Derived:
    """Gauges computed at scrape time."""

    def __init__(self, m: Metrics):
        self.m = m

    def collect(self):
        m = self.m
        g = GaugeMetricFamily("edgespec_queue_length", "requests waiting for a free sequence slot")
        g.add_metric([], m._queue_len())
        yield g
        g = GaugeMetricFamily("edgespec_active_sequences", "sequences being decoded now")
        g.add_metric([], m._active())
        yield g
        g = GaugeMetricFamily("edgespec_tokens_per_second", f"tokens generated per second over the last "
                                                            f"{RATE_WINDOW:.0f} s, all sequences together")
        g.add_metric([], round(m.tokens_per_s(), 3))
        yield g
        rate = GaugeMetricFamily("edgespec_acceptance_rate", "accepted / drafted tokens, finished requests",
                                 labels=["method"])
        mal = GaugeMetricFamily("edgespec_mean_accepted_length", "tokens committed per verification step, "
                                                                 "finished requests", labels=["method"])
        for method, (drafted, accepted, steps, out) in sorted(m.by_method().items()):
            rate.add_metric([method], accepted / drafted if drafted else 0.0)
            mal.add_metric([method], out / steps if steps else 0.0)
        yield rate
        yield mal
        snap = m._cache() if m._cache is not None else {"limit": 0, "bytes": 0, "entries": 0, "hits": 0,
                                                        "misses": 0, "evictions": 0}
        for name, help_, key in (("bytes", "bytes of KV state held in host RAM (--cache-ram)", "bytes"),
                                 ("limit_bytes", "the bound of --cache-ram, in bytes (0: no RAM cache)", "limit"),
                                 ("entries", "sequences' KV states held in host RAM", "entries")):
            g = GaugeMetricFamily(f"edgespec_cache_ram_{name}", help_)
            g.add_metric([], snap[key])
            yield g
        for name, help_ in (("hits", "requests whose prompt's prefix was restored from the RAM cache"),
                            ("misses", "requests with a key that found no prefix of their prompt in a slot "
                                       "nor in the RAM cache"),
                            ("evictions", "RAM cache entries dropped (least recently used) to make room")):
            c = CounterMetricFamily(f"edgespec_cache_ram_{name}", help_)
            c.add_metric([], snap[name])
            yield c
