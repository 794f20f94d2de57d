"""The target over llama.cpp's RPC backend, the drafter at home: two `rpc-server` processes on
127.0.0.1 hold the embedded target's layers; lookahead and a local draft model speculate over
them and give plain greedy output. Servers are stopped at the end, also when a test fails."""

import json
import os
import subprocess
import sys
import time

import pytest

from edgespec import backend
from edgespec.errors import EdgespecError

from conftest import PROMPTS
from rpc_tools import free_port, rpc_server_bin, wait_port

needs_rpc = pytest.mark.skipif(not backend.rpc(), reason="this llama-cpp-python was built without RPC "
                                                          "(.ci/run builds it with -DGGML_RPC=ON)")
PROMPT = PROMPTS[3]


@pytest.fixture(scope="module")
def servers():
    exe = rpc_server_bin(build=True)
    if exe is None:
        if os.environ.get("CI"):
            pytest.fail("rpc-server could not be built (see stderr)")
        pytest.skip("rpc-server could not be built here (cmake missing?)")
    procs, ports = [], []
    try:
        for _ in range(2):
            port = free_port()
            procs.append(subprocess.Popen([str(exe), "-H", "127.0.0.1", "-p", str(port), "-t", "1"],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            ports.append(port)
        for port in ports:
            wait_port(port)
        yield ports
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A cache of the test's own for the cost curves measured over these servers (their ports
    change every run), with the models of the real one and the session's curves measured so far
    (the local setups' are not measured again)."""
    import shutil

    from edgespec.costcache import COSTS_FILE
    from edgespec.models import cache_root

    d = tmp_path_factory.mktemp("cache")
    os.symlink(cache_root() / "models", d / "models")
    if (cache_root() / COSTS_FILE).exists():
        shutil.copy(cache_root() / COSTS_FILE, d / COSTS_FILE)
    return d


def _run(cache, *args, timeout=600):
    env = {**os.environ, "EDGESPEC_CACHE": str(cache)}
    r = subprocess.run([sys.executable, "-m", "edgespec", "run", "--json", "-t", "2", "-c", "1024", "-n", "64",
                        "-p", PROMPT, *args], capture_output=True, text=True, timeout=timeout, env=env)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.slow
@needs_rpc
def test_target_split_over_two_rpc_servers_speculates_and_stays_exact(servers, cache):
    rpc = ",".join(f"127.0.0.1:{p}" for p in servers)
    local = _run(cache, "-m", "smollm2-135m-instruct:q8_0", "--spec", "none")
    plain = _run(cache, "-m", "smollm2-135m-instruct:q8_0", "--spec", "none", "--rpc", rpc, "-ngl", "-1")
    assert plain["token_ids"] == local["token_ids"], "the same kernels on the servers: the same output"
    look = _run(cache, "-m", "smollm2-135m-instruct:q8_0", "--spec", "lookahead", "--spec-draft-n-min", "2",
                "--rpc", rpc, "-ngl", "-1")
    assert look["token_ids"] == plain["token_ids"] and look["stats"]["n_drafted"] > 0
    draft = _run(cache, "-m", "smollm2-135m-instruct:q8_0", "-md", "smollm2-135m-instruct:q4_0", "--spec", "draft",
                 "--spec-draft-n-min", "2", "--rpc", rpc, "-ngl", "-1")
    assert draft["token_ids"] == plain["token_ids"] and draft["stats"]["n_drafted"] > 0
    ex = look["stats"]["exactness"]
    assert ex["policy"] == "strict" and ex["max_exact_rows"] >= 2  # the probe ran over the RPC setup


def test_unreachable_server_is_one_line_and_no_hang():
    port = free_port()  # nothing listens there
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "edgespec", "run", "-p", "hi", "-n", "2", "--rpc", f"127.0.0.1:{port}",
                        "-ngl", "-1"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert ("cannot reach the RPC server" in r.stderr if backend.rpc() else "-DGGML_RPC=on" in r.stderr)
    assert time.monotonic() - t0 < 30
    r = subprocess.run([sys.executable, "-m", "edgespec", "run", "-p", "hi", "--rpc", "nohostport"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "HOST:PORT" in r.stderr and r.stderr.count("\n") == 1


def test_a_build_without_rpc_says_how_to_get_it(monkeypatch):
    monkeypatch.setattr(backend, "rpc", lambda: False)
    with pytest.raises(EdgespecError, match="GGML_RPC=on"):
        backend.add_rpc_servers(["127.0.0.1:1"])


@needs_rpc
def test_connect_timeout_is_bounded(monkeypatch):
    """A server that never answers the TCP handshake (a black-holed address) fails within the
    timeout, not after the system's connect timeout of minutes."""
    import socket

    def slow_connect(addr, timeout=None):
        time.sleep(timeout)
        raise TimeoutError

    monkeypatch.setattr(socket, "create_connection", slow_connect)
    t0 = time.monotonic()
    with pytest.raises(EdgespecError, match="timed out"):
        backend.add_rpc_servers(["10.255.255.1:50052"], timeout=0.5)
    assert time.monotonic() - t0 < 2
