"""A load generator for `edgespec serve` on the loopback address (or any URL):

    python -m edgespec.frontends.server.load --url http://127.0.0.1:8080 -c 8 -n 32 [--suite FILE]

`-c` clients stream chat completions at once until `-n` requests are answered, cycling over
the prompts of a bench suite. Reports requests/s, generated tokens/s, and time to first token
(p50/p95, measured by the client: request sent to first text), with the acceptance the server
reports per request. Every stream is checked: one id, one [DONE], no error.

    python -m edgespec.frontends.server.load --url ... -c 16 --duration 60 --dropper

instead streams for `--duration` seconds while one more client sends ~2,000-token prompts and
drops each after 1 s, and reports the other streams' largest gap between two chunks (a stream
still open at the end, 30 s later, counts its silence since its last chunk)."""

from __future__ import annotations

import argparse
import http.client
import json
import socket
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


def long_prompt() -> str:
    """A chat message of about 2,000 tokens (SmolLM2's vocabulary: 1,934 with the template)."""
    colours = ["red", "blue", "green", "brown"]
    return "Summarize these notes: " + " ".join(f"note {i}: the {colours[i % 4]} box {i * 7} moved."
                                                 for i in range(135))


def run_gaps(url: str, prompts: list[list[dict]], clients: int, seconds: float, max_tokens: int,
             dropper: bool = True, grace: float = 30.0) -> dict:
    """`clients` streams for `seconds` (plus one client dropping long prompts after 1 s): the
    largest gap between two chunks of a stream, with p90 and median over the streams."""
    u = urlsplit(url)
    host, port = u.hostname, u.port or 80
    stop = time.monotonic() + seconds
    lock = threading.Lock()
    gaps: list[float] = []
    open_: dict[int, list] = {}  # client -> [last chunk time or None, largest gap so far]
    count = {"finished": 0, "dropped": 0, "errors": 0}

    def stream(i: int) -> None:
        while time.monotonic() < stop:
            st = [None, 0.0]
            with lock:
                open_[i] = st
            conn = http.client.HTTPConnection(host, port, timeout=600)
            body = {"messages": prompts[i % len(prompts)], "max_tokens": max_tokens, "stream": True}
            try:
                conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
                r = conn.getresponse()
                while line := r.readline():
                    if not line.startswith(b"data: {"):
                        continue
                    ev = json.loads(line[6:])
                    if any(ch["delta"].get("content") for ch in ev.get("choices", [])):  # text, not the role
                        now = time.monotonic()
                        with lock:
                            if st[0] is not None:
                                st[1] = max(st[1], now - st[0])
                            st[0] = now
                with lock:
                    gaps.append(st[1])
                    count["finished"] += 1
                    open_.pop(i, None)
            except Exception:  # noqa: BLE001 - counted
                with lock:
                    count["errors"] += 1
                    open_.pop(i, None)
            finally:
                conn.close()

    def drop() -> None:
        body = json.dumps({"messages": [{"role": "user", "content": long_prompt()}], "max_tokens": 100,
                           "stream": True}).encode()
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        while time.monotonic() < stop:
            try:
                with socket.create_connection((host, port), timeout=30) as s:
                    s.sendall(head + body)
                    time.sleep(1.0)
                count["dropped"] += 1
            except OSError:
                count["errors"] += 1

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(clients)]
    if dropper:
        threads.append(threading.Thread(target=drop, daemon=True))
    for t in threads:
        t.start()
    time.sleep(seconds)
    end = time.monotonic() + grace
    while open_ and time.monotonic() < end:
        time.sleep(0.2)
    now = time.monotonic()
    with lock:
        all_gaps = sorted(gaps + [max(st[1], now - st[0]) for st in open_.values() if st[0] is not None])
        still = len(open_)
    return {"seconds": seconds, "clients": clients, **count, "open_at_end": still,
            "max_gap_s": round(all_gaps[-1], 2) if all_gaps else None,
            "p90_gap_s": round(_percentile(all_gaps, 0.9), 2), "median_gap_s": round(_percentile(all_gaps, 0.5), 2)}


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
    ap.add_argument("--duration", type=float, default=None,
                    help="stream for this many seconds and report the largest gap between chunks (keyless server)")
    ap.add_argument("--dropper", action="store_true",
                    help="with --duration: one more client sends ~2,000-token prompts and drops each after 1 s")
    a = ap.parse_args(argv)
    from ...suites import load_suite

    items = load_suite(a.suite, a.categories)
    prompts = [x["messages"] if "messages" in x else [{"role": "user", "content": x["prompt"]}] for x in items]
    if a.duration is not None:
        res = run_gaps(a.url, prompts, a.clients, a.duration, a.max_tokens, a.dropper)
        print(json.dumps(res))
        return 1 if res["errors"] else 0
    res = run_load(a.url, prompts, a.clients, a.requests, a.max_tokens, a.api_key)
    print(json.dumps(res))
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
