"""llama.cpp's own programs that tests run beside edgespec, built once from the llama.cpp source
vendored in the pinned llama-cpp-python sdist (the same code as the installed libllama): `rpc-server`
for the RPC tests, `llama-speculative-simple` for the EAGLE-3 and MTP comparisons; and a loopback
TCP proxy that adds latency, standing in for a network (this machine's kernel has no `netem`
qdisc, so `tc netem` in a namespace of the test's own is not available here).

    python tests/rpc_tools.py            # build (or find) every tool; prints their paths (.ci/run does this)
    python tests/rpc_tools.py --measure  # plain vs lookahead over two local servers, added latency
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

VERSION = "0.3.36"
# each tool by its file name here and its CMake target in llama.cpp's tree: built together, only these
TOOLS = {"rpc-server": "ggml-rpc-server", "llama-speculative-simple": "llama-speculative-simple"}


NO_AMX = ("-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON "
          "-DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON")


def _flags() -> list[str]:
    """The CPU flags of the installed wheel's build (CMAKE_ARGS, as .ci/run sets it), so the
    tools' kernels run on this CPU; without CMAKE_ARGS, .ci/run's rule: no AMX where cpuid
    reports it (some virtual machines trap its instructions)."""
    args = os.environ.get("CMAKE_ARGS", "")
    if not args:
        try:
            with open("/proc/cpuinfo") as f:
                if " amx_tile" in f.read():
                    args = NO_AMX
        except OSError:
            pass
    return [f for f in args.split() if f.startswith("-DGGML_") and "RPC" not in f]


def build_dir() -> Path:
    key = hashlib.sha1(" ".join(_flags()).encode()).hexdigest()[:12]
    return Path.home() / ".cache" / "edgespec-build" / f"llama-tools-{VERSION}-{key}"


def _kernel_build():
    """edgespec/kernel_build.py, loaded by path as setup.py loads it: .ci/run builds the tools
    before edgespec is installed, and the module needs only the standard library."""
    spec = importlib.util.spec_from_file_location(
        "_edgespec_kernel_build", Path(__file__).resolve().parent.parent / "edgespec" / "kernel_build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def build_tools() -> bool:
    """Build every tool of TOOLS into the build cache in one CMake tree (static, so each binary
    stands alone), compiling those targets and what they link only. A few minutes, once per
    set of CPU flags. False (the build's tail on stderr) when cmake is missing or it fails."""
    if shutil.which("cmake") is None:
        sys.stderr.write("cmake is not installed: cannot build llama.cpp's tools\n")
        return False
    kb = _kernel_build()
    try:
        sdist = kb.fetch_sdist(lambda msg: sys.stderr.write(msg + "\n"))
    except kb.BuildError as e:
        sys.stderr.write(f"{e}\n")
        return False
    with tempfile.TemporaryDirectory(prefix="edgespec-llama-tools-") as tmp:
        src = kb.extract(sdist, Path(tmp) / "llama.cpp")
        b = Path(tmp) / "build"
        gen = ["-G", "Ninja"] if shutil.which("ninja") else []
        cfg = ["cmake", "-S", str(src), "-B", str(b), *gen, "-DCMAKE_BUILD_TYPE=Release", "-DGGML_RPC=ON",
               "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
               "-DLLAMA_BUILD_EXAMPLES=ON", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=OFF", *_flags()]
        r = subprocess.run(cfg, capture_output=True, text=True)
        if r.returncode == 0:
            r = subprocess.run(["cmake", "--build", str(b), "-j", str(os.cpu_count() or 2), "--target",
                                *TOOLS.values()], capture_output=True, text=True)
        if r.returncode != 0:
            sys.stderr.write(r.stdout[-3000:] + r.stderr[-3000:])
            return False
        out = build_dir() / "bin"
        out.mkdir(parents=True, exist_ok=True)
        for name, target in TOOLS.items():
            built = b / "bin" / target
            if not built.is_file():
                sys.stderr.write(f"the build left no {built.name}\n")
                return False
            part = out / f".{name}.part"
            shutil.copy2(built, part)
            os.replace(part, out / name)  # whole or not at all: a test never runs half a binary
    return True


def tool_bin(name: str, build: bool = True) -> Path | None:
    """llama.cpp's `name` (a key of TOOLS): from $LLAMA_TOOLS_DIR/build/bin where that is set
    (the reference build of /work/shared/tools/build-llama-cpp-tools.sh), else the build cache,
    built there when missing and `build`. None when it is not there and cannot be built."""
    env = os.environ.get("LLAMA_TOOLS_DIR")
    if env and (Path(env) / "build" / "bin" / name).is_file():
        return Path(env) / "build" / "bin" / name
    out = build_dir() / "bin" / name
    if not out.is_file() and build:
        build_tools()
    return out if out.is_file() else None


def rpc_server_bin(build: bool = True) -> Path | None:
    """The rpc-server binary: $EDGESPEC_RPC_SERVER, else `tool_bin`."""
    env = os.environ.get("EDGESPEC_RPC_SERVER")
    if env:
        return Path(env)
    return tool_bin("rpc-server", build)


def require(name: str) -> Path:
    """For a test: the tool, built when missing; where it cannot be built the test fails under
    CI (where .ci/run builds it: a skip there would hide a comparison that never ran) and is
    skipped elsewhere."""
    import pytest

    exe = tool_bin(name)
    if exe is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} could not be built (see stderr); .ci/run builds it with `python tests/rpc_tools.py`")
        pytest.skip(f"{name} could not be built here (cmake missing?)")
    return exe


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port}")


class DelayProxy:
    """127.0.0.1:port -> target port, every chunk delayed by `delay_s` in each direction (a
    round trip gains 2x delay_s), as a network link would; stops with the test."""

    def __init__(self, target_port: int, delay_s: float):
        self.target, self.delay = target_port, delay_s
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            u = socket.create_connection(("127.0.0.1", self.target))
            for s in (c, u):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._pipe, args=(c, u), daemon=True).start()
            threading.Thread(target=self._pipe, args=(u, c), daemon=True).start()

    def _pipe(self, a: socket.socket, b: socket.socket) -> None:
        import queue

        q: queue.Queue = queue.Queue()

        def later():  # keeps order; each chunk leaves `delay` after it came
            while True:
                t, data = q.get()
                if data is None:  # pass the end on at once (a close() would wait for the other
                    try:  # direction's blocked recv, and the server would never see the client go)
                        b.shutdown(socket.SHUT_WR)
                    except OSError:
                        pass
                    return
                wait = t + self.delay - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                try:
                    b.sendall(data)
                except OSError:
                    return

        threading.Thread(target=later, daemon=True).start()
        try:
            while True:
                data = a.recv(1 << 16)
                if not data:
                    break
                q.put((time.monotonic(), data))
        except OSError:
            pass
        q.put((0.0, None))

    def close(self) -> None:
        self.closed = True
        self.sock.close()


MEASURE_PROMPT = "Write the numbers from 1 to 120 separated by commas, then write them again."
RUNS = {"none": [], "lookahead": [], "lookahead forced": ["--spec-draft-n-min", "3"]}


def measure(delays_ms=(0.0, 0.5, 2.0, 5.0), n_tokens: int = 128, repeat: int = 2,
            model: str = "smollm2-135m-instruct:q8_0") -> list[dict]:
    """Plain against lookahead (as the cost model sizes it, and forced to draft 3 nodes a step),
    the target split over two local rpc-servers (one thread each), each reached through a proxy
    adding `delay` each way: tokens/s as the round trip grows. A cache of its own keeps the
    cost curves measured over each setup (the proxies' ports change every run)."""
    import json
    import statistics

    from edgespec.models import cache_root

    exe = rpc_server_bin()
    ports = [free_port(), free_port()]
    procs = [subprocess.Popen([str(exe), "-H", "127.0.0.1", "-p", str(p), "-t", "1"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL) for p in ports]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        os.symlink(cache_root() / "models", Path(tmp) / "models")
        env = {**os.environ, "EDGESPEC_CACHE": tmp}
        try:
            for port in ports:
                wait_port(port)
            for d in delays_ms:
                proxies = [DelayProxy(port, d / 1000) for port in ports]
                rpc = ",".join(f"127.0.0.1:{x.port}" for x in proxies)
                res: dict[str, list[dict]] = {name: [] for name in RUNS}
                for _ in range(repeat):
                    for name, extra in RUNS.items():
                        r = subprocess.run([sys.executable, "-m", "edgespec", "run", "--json", "-m", model, "-t", "2",
                                            "-c", "1024", "-n", str(n_tokens), "--spec", name.split()[0], *extra,
                                            "--rpc", rpc, "-ngl", "-1", "-p", MEASURE_PROMPT],
                                           capture_output=True, text=True, timeout=900, env=env)
                        if r.returncode != 0:
                            raise RuntimeError(r.stderr)
                        res[name].append(json.loads(r.stdout)["stats"])
                for x in proxies:
                    x.close()
                base = statistics.median(s["tokens_per_s"] for s in res["none"])
                row = {"delay_ms_each_way": d, "none_tok_s": round(base, 1)}
                for name in list(RUNS)[1:]:
                    tps = statistics.median(s["tokens_per_s"] for s in res[name])
                    row[f"{name} tok/s"] = round(tps, 1)
                    row[f"{name} speedup"] = round(tps / base, 2)
                    row[f"{name} mean acc. len"] = round(statistics.mean(s["mean_accepted_length"] for s in res[name]), 2)
                print(json.dumps(row), file=sys.stderr)
                rows.append(row)
        finally:
            for p in procs:
                p.terminate()
                p.wait(10)
    return rows


if __name__ == "__main__":
    if sys.argv[1:] == ["--measure"]:
        for row in measure():
            print(row)
        sys.exit(0)
    paths = {name: tool_bin(name) for name in TOOLS}
    for name, p in paths.items():
        print(p if p else f"{name}: build failed")
    sys.exit(0 if all(paths.values()) else 1)
