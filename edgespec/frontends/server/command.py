"""The `edgespec serve` command: load the engine, bind the socket (one clear line when the
address is taken), start the engine's thread and uvicorn; Ctrl+C or SIGTERM stops taking
requests, cancels what is decoding and exits."""

from __future__ import annotations

import ipaddress
import logging
import os
import signal
import socket
import sys

from ...errors import EdgespecError
from ...sampling import SamplingConfig
from ...serving.requests import Defaults
from ..options import ServeOptions

log = logging.getLogger("edgespec.serve")

API_KEY_ENV = "EDGESPEC_API_KEY"


def model_name(cfg) -> str:
    """The id /v1/models reports: the catalog name, or a file's stem."""
    m = cfg.model
    return os.path.splitext(os.path.basename(m))[0] if m.endswith(".gguf") else m


def bind(host: str, port: int) -> socket.socket:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise EdgespecError(f"cannot resolve --host {host}: {e.strerror}") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise EdgespecError(f"cannot listen on {host}:{port}: {e.strerror} (choose another --port)") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def protocol(header_timeout: float):
    """uvicorn's h11 protocol, with a deadline for a new connection's first request head: one
    that sends nothing, or its headers a byte at a time, is closed after `header_timeout` s
    (uvicorn's own timers start after a first answer; the app times the body)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Protocol(H11Protocol):
        _head_due = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._head_due = self.loop.call_later(header_timeout, self._head_late)

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not None and self._head_due is not None:
                self._head_due.cancel()
                self._head_due = None

        def connection_lost(self, exc) -> None:
            if self._head_due is not None:
                self._head_due.cancel()
                self._head_due = None
            super().connection_lost(exc)

        def _head_late(self) -> None:
            self._head_due = None
            if self.cycle is None and not self.transport.is_closing():
                self.transport.close()

    return Protocol


def uvicorn_config(app, read_timeout: float = 30.0, max_connections: int = 64):
    """How uvicorn runs the app: idle keep-alive connections closed after 5 s, a first request
    head due within `read_timeout`, at most `max_connections` at once (more get a 503), quiet
    logs (the app logs what matters in one line)."""
    import uvicorn

    return uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=3,
                          lifespan="off", http=protocol(read_timeout), timeout_keep_alive=5,
                          limit_concurrency=max_connections, h11_max_incomplete_event_size=64 * 1024)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def run_serve(a: ServeOptions, cfg, sampling: SamplingConfig) -> int:
    """The `edgespec serve` command (options validated and settled by the CLI; `sampling`: the
    flags' settings, for requests that do not set theirs)."""
    try:
        import uvicorn
    except ImportError:
        raise EdgespecError("edgespec serve needs uvicorn and starlette: pip install uvicorn starlette") from None
    from ...engine import Engine
    from .app import Server
    from .worker import Worker

    api_key = a.api_key if a.api_key is not None else os.environ.get(API_KEY_ENV) or None
    if api_key and a.history:  # the key's own reply history, never another key's (edgespec.history)
        from dataclasses import replace

        from ...history import path_for
        from ...models import cache_root

        cfg = replace(cfg, history=str(path_for(cache_root(), api_key)))
    sock = bind(a.host, a.port)  # before loading: a taken port fails at once
    host, port = sock.getsockname()[:2]
    try:
        engine = Engine(cfg, quiet=a.quiet)
    except BaseException:
        sock.close()
        raise
    n_par = a.parallel
    if n_par > engine.max_verify_rows:
        log.warning(f"{engine.target.path.name}: batches of more than {engine.max_verify_rows} rows are not "
                    f"bit-exact with this build: -np {n_par} is lowered to {engine.max_verify_rows}")
        n_par = engine.max_verify_rows
    max_tokens = a.n_predict if a.n_predict else engine.n_ctx_seq
    defaults = Defaults(max_tokens, sampling)
    from ...promptcache import cache_bytes

    reuse = a.reuse
    ram = cache_bytes(a.cache_ram) if reuse else 0
    worker = Worker(engine, a.spec, n_par, a.max_queue, reuse=reuse, cache_ram=ram)
    name = model_name(cfg)
    local = is_loopback(host)
    server = Server(engine, worker, name, defaults, api_key, local_only=local, cors=a.cors,
                    read_timeout=a.read_timeout)
    worker.start()
    shown = f"[{host}]" if ":" in host else host
    log.info(f"serving {name} at http://{shown}:{port}/v1 (--spec {a.spec}, -np {n_par}, "
             f"{engine.n_ctx_seq} tokens of context per sequence{', API key required' if api_key else ''}"
             f"{_reuse_note(reuse, ram, api_key)}); "
             "Ctrl+C stops")
    if not local and not api_key:
        log.warning(f"listening on {a.host} without --api-key: anyone who can reach port {port} can use the model")
    config = uvicorn_config(server.app, a.read_timeout, a.max_connections)
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then raises the signal again for the
    # handlers it found: these make both a KeyboardInterrupt here, and the stop a clean one.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        worker.close()
        server.close()
        sock.close()
        if not worker.alive:  # else a decode still runs: the process exit frees the model
            engine.close()
    print("edgespec: server stopped", file=sys.stderr)
    return 0


def _reuse_note(reuse: bool, ram: int, api_key: str | None) -> str:
    if not reuse:
        return ", no KV reuse"
    if not api_key:
        return ", no KV reuse between requests without --api-key"
    return f", KV reuse, prompt cache {ram >> 20} MiB" if ram else ", KV reuse"
