"""A load generator for `edgespec serve` on the loopback address (or any URL):

    python -m edgespec.frontends.server.load --url http://127.0.0.1:8080 -c 8 -n 32 [--suite FILE]

`-c` clients stream chat completions at once until `-n` requests are answered, cycling over
the prompts of a bench suite. Reports requests/s, generated tokens/s, and time to first token
(p50/p95, measured by the client: request sent to first text), with the acceptance the server
reports per request. Every stream is checked: one id, one [DONE], no error."""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import threading
import time
from urllib.parse import urlsplit


def _percentile(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    i = min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))
    return xs[i]


def one_stream(url: str, messages: list[dict], max_tokens: int, key: str | None, timeout: float = 600.0) -> dict:
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=timeout)
    body = {"messages": messages, "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}}
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps(body), headers)
    r = conn.getresponse()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {r.read()[:200]!r}")
    ttft, ids, done, usage, spec, text = None, set(), 0, None, None, []
    while True:
        line = r.readline()
        if not line:
            break
        if not line.startswith(b"data: "):
            continue
        data = line[6:].strip()
        if data == b"[DONE]":
            done += 1
            continue
        ev = json.loads(data)
        if "error" in ev:
            raise RuntimeError(ev["error"]["message"])
        ids.add(ev["id"])
        if ev.get("usage"):
            usage, spec = ev["usage"], ev.get("speculative")
        for ch in ev["choices"]:
            piece = ch["delta"].get("content")
            if piece:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                text.append(piece)
    conn.close()
    if done != 1 or len(ids) != 1:
        raise RuntimeError(f"stream broken: {done} [DONE], {len(ids)} ids")
    return {"ttft": ttft if ttft is not None else time.perf_counter() - t0, "wall": time.perf_counter() - t0,
            "tokens": usage["completion_tokens"] if usage else 0, "spec": spec or {}, "text": "".join(text)}


def run_load(url: str, prompts: list[list[dict]], clients: int, n_requests: int, max_tokens: int,
             key: str | None = None) -> dict:
    results: list[dict] = []
    errors: list[str] = []
    lock = threading.Lock()
    counter = iter(range(n_requests))

    def client() -> None:
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            try:
                res = one_stream(url, prompts[i % len(prompts)], max_tokens, key)
            except Exception as e:  # noqa: BLE001 - counted and reported
                with lock:
                    errors.append(f"{type(e).__name__}: {e}")
                continue
            with lock:
                results.append(res)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ttfts = [r["ttft"] for r in results]
    tokens = sum(r["tokens"] for r in results)
    drafted = sum(r["spec"].get("drafted_tokens", 0) for r in results)
    accepted = sum(r["spec"].get("accepted_tokens", 0) for r in results)
    steps = sum(r["spec"].get("steps", 0) for r in results)
    return {
        "requests": len(results), "errors": len(errors), "error_samples": errors[:3], "clients": clients,
        "wall_s": round(wall, 2), "requests_per_s": round(len(results) / wall, 3),
        "tokens_per_s": round(tokens / wall, 1), "tokens": tokens,
        "ttft_p50_s": round(_percentile(ttfts, 0.5), 3), "ttft_p95_s": round(_percentile(ttfts, 0.95), 3),
        "acceptance_rate": round(accepted / drafted, 3) if drafted else 0.0,
        "mean_accepted_length": round(tokens / steps, 3) if steps else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m edgespec.frontends.server.load",
                                 description="Concurrent streaming clients against an edgespec (or any OpenAI) server.")
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("-c", "--clients", type=int, default=8, help="concurrent clients (default: %(default)s)")
    ap.add_argument("-n", "--requests", type=int, default=32, help="requests in all (default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=128, help="max_tokens of each request (default: %(default)s)")
    ap.add_argument("--suite", default=None, help="bench suite JSONL for the prompts (default: the built-in suite)")
    ap.add_argument("--categories", default=None, help="only these categories of the suite")
    ap.add_argument("--api-key", default=None)
    a = ap.parse_args(argv)
    from ..bench.suites import load_suite

    items = load_suite(a.suite, a.categories)
    prompts = [x["messages"] if "messages" in x else [{"role": "user", "content": x["prompt"]}] for x in items]
    res = run_load(a.url, prompts, a.clients, a.requests, a.max_tokens, a.api_key)
    print(json.dumps(res))
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
