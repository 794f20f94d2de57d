"""Fixtures on the real embedded models, fetched into the edgespec cache on first use, and on tiny
synthetic models written at session start (tests/synthetic_tiny.py)."""

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest


def _own_cache() -> None:
    """The tests' own edgespec cache: nothing a test measures (cost curves, heads, lookahead
    caches) reaches the user's. Downloads are shared: the models and suites folders are the
    user's, linked (their files are only ever written whole, under a temporary name)."""
    from edgespec.models import cache_root

    real = cache_root()
    own = Path(tempfile.mkdtemp(prefix="edgespec-test-cache-"))
    for shared in ("models", "suites"):
        (real / shared).mkdir(parents=True, exist_ok=True)
        os.symlink(real / shared, own / shared)
    os.environ["EDGESPEC_CACHE"] = str(own)
    atexit.register(shutil.rmtree, own, True)


_own_cache()

from edgespec.costmodel import flat
from edgespec.engine import Engine, EngineConfig
from edgespec.sampling import SamplingConfig

GREEDY = SamplingConfig(temp=0.0)

PROMPTS = [
    "Repeat this list exactly, then say which item is longest:\n- apples and pears\n- a loaf of brown bread\n"
    "- apples and pears\n- twelve eggs\n- a loaf of brown bread",
    "Write a short Python function that returns the factorial of n, then write it again with a docstring.",
    "What is the capital of France? Answer in one sentence.",
    "Copy this sentence three times: The quick brown fox jumps over the lazy dog.",
    # past 512 KV cells, where llama.cpp's CPU attention takes other paths for one row and for many
    "Summarize this log, then repeat its last three lines exactly:\n"
    + "".join(f"2026-11-29 12:{i:02d}:07 worker-{i % 7} processed batch {i * 37} in {(i * 13) % 97} ms, queue depth {i % 11}\n"
              for i in range(24)),
]


@pytest.fixture(scope="session")
def smol():
    eng = Engine(EngineConfig(model="smollm2-135m-instruct:q4_0", n_ctx=2048, threads=2))
    yield eng
    eng.close()


@pytest.fixture(scope="session")
def smol_pair():
    eng = Engine(EngineConfig(model="smollm2-135m-instruct:q8_0", draft="smollm2-135m-instruct:q4_0", n_ctx=2048, threads=2))
    yield eng
    eng.close()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """A tiny target (Q8_0) and its draft model (Q4_0) on SmolLM2's tokenizer, written at session
    start (tests/synthetic_tiny.py): the algorithm tests' models, milliseconds a completion."""
    import synthetic_tiny

    from edgespec.models import resolve

    return synthetic_tiny.write_pair(tmp_path_factory.mktemp("tiny"), resolve("smollm2-135m-instruct:q4_0", quiet=True))


@pytest.fixture(scope="session")
def tiny_pair(tiny_models):
    target, draft = tiny_models
    eng = Engine(EngineConfig(model=str(target), draft=str(draft), n_ctx=512, threads=2))
    yield eng
    eng.close()


class Spy:
    """Wraps a drafter and records every draft and what the target accepted of it."""

    def __init__(self, inner):
        self.inner = inner
        self.name = inner.name
        self.reads, self.taps = inner.reads, inner.taps
        self.log = []

    def observe(self, pos, rows, hidden):
        self.inner.observe(pos, rows, hidden)

    def begin(self, prompt):
        self.inner.begin(prompt)

    def propose(self, context, budget):
        return self.inner.propose(context, budget)

    def accept(self, draft, accepted, committed):
        self.log.append((draft, list(accepted)))
        self.inner.accept(draft, accepted, committed)

    def end(self):
        self.inner.end()


def generate(engine, prompt_tokens, n, method="none", sampling=GREEDY, drafter=None, gpu_like=False):
    saved = engine.cost
    if gpu_like:
        engine.cost = flat(0.05, saved.max_exact_rows)  # verifying k tokens costs one; drafting is cheap
    try:
        d = drafter or engine.make_drafter(method, sampling.seed)
        return engine.generate(prompt_tokens, n, sampling, d).run()
    finally:
        engine.cost = saved


def serve_in_thread(s) -> None:
    """Start `s.worker` and serve `s.server.app` with uvicorn in a daemon thread, on a free
    loopback port: sets `s.port`, `s.url`, `s.uv`, `s.thread`, `s.sock` (stop: `s.uv.should_exit`)."""
    import threading
    import time

    import uvicorn

    from edgespec.frontends.server.command import bind

    sock = bind("127.0.0.1", 0)
    s.port = sock.getsockname()[1]
    s.url = f"http://127.0.0.1:{s.port}"
    s.worker.start()
    s.uv = uvicorn.Server(uvicorn.Config(s.server.app, log_level="warning", lifespan="off",
                                         timeout_graceful_shutdown=2))
    s.uv.install_signal_handlers = lambda: None  # not the main thread
    s.thread = threading.Thread(target=s.uv.run, kwargs={"sockets": [sock]}, daemon=True)
    s.thread.start()
    for _ in range(100):
        if s.uv.started:
            break
        time.sleep(0.05)
    s.sock = sock


def pytest_collection_modifyitems(config, items):
    """Tests marked `large` (the 1.5B chat model) are left out of the default suite, said as
    deselected (not skipped: nothing it could run was left unrun), unless EDGESPEC_TEST_LARGE=1."""
    if os.environ.get("EDGESPEC_TEST_LARGE") == "1":
        return
    large = [it for it in items if it.get_closest_marker("large")]
    if large:
        config.hook.pytest_deselected(items=large)
        items[:] = [it for it in items if not it.get_closest_marker("large")]
