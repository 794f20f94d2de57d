"""Build llama.cpp's CPU backend (`ggml-cpu`) with edgespec's patches (edgespec/patches/), from the
llama.cpp that the pinned llama-cpp-python vendors in its source distribution.

Standard library only: setup.py runs this at install time (`pip install .`), before edgespec's
dependencies can be imported, and `edgespec kernels --build` runs it later. It fetches the sdist
(pip's own download, so the user's index settings hold; PyPI directly as a fallback; checked against
its pinned sha256), applies the patches, configures llama.cpp with CMake as llama-cpp-python's build
does (the same `CMAKE_ARGS`), builds only the `ggml-cpu` target (about a minute on 2 cores) and
leaves `libggml-cpu.so.0` with a manifest in the destination folder. edgespec/kernels.py loads it
in place of llama-cpp-python's own. docs/exactness.md says why.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from pathlib import Path

LLAMA_CPP_PYTHON = "0.3.36"  # the pinned version (pyproject.toml): its vendored llama.cpp is ggml-org/llama.cpp@0c1e57098
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
LIB = "libggml-cpu.so.0"
MANIFEST = "build.json"
PATCH_DIR = Path(__file__).resolve().parent / "patches"
SKIP_ENV = "EDGESPEC_KERNELS_BUILD"  # "0": setup.py builds nothing (stock kernels)
# Backends other than the CPU are built by llama-cpp-python itself; configuring them here would only
# need their toolkits. A CMAKE_ARGS that turns one on keeps it on for llama-cpp-python, off here.
_OTHER_BACKENDS = ("CUDA", "METAL", "VULKAN", "HIP", "SYCL", "MUSA", "OPENCL", "RPC", "BLAS", "CANN", "WEBGPU",
                   "ZDNN", "KOMPUTE")


class BuildError(Exception):
    """The build failed; the message is one line, `detail` the tail of what the tools printed."""

    def __init__(self, message: str, detail: str = ""):
        super().__init__(message)
        self.detail = detail


def patches() -> list[Path]:
    return sorted(PATCH_DIR.glob("*.patch"))


def patch_digest() -> str:
    """What identifies the patch set: a build made from other patches is not loaded."""
    h = hashlib.sha256()
    for p in patches():
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def unsupported() -> str:
    """Why this machine cannot use the build ('' if it can): the patches change x86 kernels, and
    loading a library in place of another by its soname is how Linux's loader works."""
    if sys.platform != "linux":
        return f"edgespec builds its CPU kernels on Linux only (this is {sys.platform}): stock kernels"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"edgespec's kernel patches are for x86-64 (this is {platform.machine()}): stock kernels"
    return ""


def cache_dir() -> Path:
    """Where downloaded sources are kept between builds."""
    env = os.environ.get("EDGESPEC_BUILD_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "edgespec-build"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_sdist(log) -> Path:
    """The llama-cpp-python sdist, verified: from the cache, else through pip, else from PyPI."""
    name = f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    folder = cache_dir() / "sdist"
    path = folder / name
    if path.is_file() and _sha256(path) == SDIST_SHA256:
        return path
    folder.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="sdist-", dir=folder))
    try:
        log(f"fetching the llama.cpp source (llama-cpp-python {LLAMA_CPP_PYTHON} sdist, 77 MB)")
        # pip's isolated build environment (setup.py runs in one) hides the venv's packages through
        # PYTHONPATH/PYTHONNOUSERSITE: a child without them sees pip again, with the user's settings.
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONNOUSERSITE", "PYTHONHOME")}
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                            f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(tmp)],
                           capture_output=True, text=True, env=env)
        got = tmp / name
        if r.returncode != 0 or not got.is_file():
            url = _pypi_url()
            with urllib.request.urlopen(url, timeout=60) as resp, open(got, "wb") as f:
                shutil.copyfileobj(resp, f)
        if _sha256(got) != SDIST_SHA256:
            raise BuildError(f"the downloaded {name} does not match its pinned sha256")
        os.replace(got, path)
        return path
    except OSError as e:
        raise BuildError(f"cannot fetch the llama-cpp-python {LLAMA_CPP_PYTHON} source: {e}") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _pypi_url() -> str:
    with urllib.request.urlopen(f"https://pypi.org/pypi/llama-cpp-python/{LLAMA_CPP_PYTHON}/json", timeout=30) as r:
        data = json.load(r)
    for u in data.get("urls", []):
        if u.get("packagetype") == "sdist":
            return u["url"]
    raise BuildError(f"PyPI lists no sdist of llama-cpp-python {LLAMA_CPP_PYTHON}")


def extract(sdist: Path, dest: Path) -> Path:
    """vendor/llama.cpp of the sdist into `dest`; its folder."""
    prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON}/vendor/llama.cpp/"
    with tarfile.open(sdist) as tar:
        members = []
        for m in tar.getmembers():
            if not m.name.startswith(prefix) or not (m.isfile() or m.isdir()):
                continue
            rel = m.name[len(prefix):]
            if not rel or rel.startswith(("/", "..")) or "/../" in rel:
                continue
            m.name = rel
            members.append(m)
        tar.extractall(dest, members=members)
    return dest


def apply_patches(src: Path) -> None:
    for p in patches():
        for cmd in (["patch", "-p1", "--forward", "--batch", "-s", "-i", str(p)], ["git", "apply", "-p1", str(p)]):
            if shutil.which(cmd[0]) is None:
                continue
            r = subprocess.run(cmd, cwd=src, capture_output=True, text=True)
            if r.returncode == 0:
                break
            raise BuildError(f"patch {p.name} does not apply to llama-cpp-python {LLAMA_CPP_PYTHON}'s llama.cpp",
                             r.stdout + r.stderr)
        else:
            raise BuildError("neither `patch` nor `git` is installed: cannot apply the kernel patches")


def cmake_args(env: dict | None = None) -> list[str]:
    """llama-cpp-python's build settings as CMake arguments: a Release build of shared libraries
    with the user's `CMAKE_ARGS` (GGML_NATIVE and the instruction sets, as llama-cpp-python took them),
    other backends off."""
    env = os.environ if env is None else env
    user = shlex.split(env.get("CMAKE_ARGS", ""))
    if any(re.fullmatch(r"-DGGML_BACKEND_DL(:BOOL)?=(ON|on|1|TRUE|true)", a) for a in user):
        raise BuildError("CMAKE_ARGS asks for GGML_BACKEND_DL (CPU variants loaded at run time): edgespec's "
                         "kernels replace a linked ggml-cpu only")
    return (["-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
             "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=OFF", "-DLLAMA_BUILD_SERVER=OFF",
             "-DLLAMA_BUILD_COMMON=OFF"] + user + [f"-DGGML_{b}=OFF" for b in _OTHER_BACKENDS])


def _run(cmd: list[str], cwd: Path, what: str) -> None:
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if r.returncode != 0:
        tail = "\n".join((r.stdout + r.stderr).splitlines()[-30:])
        raise BuildError(f"{what} failed (exit {r.returncode})", tail)


def build(dest: Path, log=lambda msg: None, jobs: int | None = None) -> dict:
    """Build the patched `ggml-cpu` into `dest` (LIB and MANIFEST); returns the manifest."""
    why = unsupported()
    if why:
        raise BuildError(why)
    cmake = shutil.which("cmake")
    if cmake is None:
        raise BuildError("cmake is not installed (llama-cpp-python's own build needs it too)")
    started = time.time()
    args = cmake_args()
    sdist = fetch_sdist(log)
    with tempfile.TemporaryDirectory(prefix="edgespec-kernels-") as tmp:
        src = extract(sdist, Path(tmp) / "llama.cpp")
        apply_patches(src)
        out = Path(tmp) / "build"
        log("configuring llama.cpp's CPU backend (CMake)")
        gen = ["-G", "Ninja"] if shutil.which("ninja") else []
        _run([cmake, "-S", str(src), "-B", str(out)] + gen + args, Path(tmp), "cmake configure")
        log(f"compiling ggml-cpu with {len(patches())} patches (about a minute)")
        _run([cmake, "--build", str(out), "--target", "ggml-cpu", "-j", str(jobs or os.cpu_count() or 2)],
             Path(tmp), "cmake build")
        built = sorted((out / "bin").glob("libggml-cpu.so.*.*.*"))
        if not built:
            raise BuildError("the build left no libggml-cpu.so")
        ggml = built[-1].name[len("libggml-cpu.so."):]
        dest.mkdir(parents=True, exist_ok=True)
        part = dest / f".{LIB}.part"
        shutil.copyfile(built[-1], part)
        os.replace(part, dest / LIB)
    manifest = {"llama_cpp_python": LLAMA_CPP_PYTHON, "ggml": ggml, "patches": patch_digest(),
                "patch_files": [p.name for p in patches()], "cmake_args": args, "machine": platform.machine(),
                "built_at": round(time.time()), "seconds": round(time.time() - started, 1)}
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def record_failure(dest: Path, err: BuildError) -> None:
    """Leave why the build failed where the runtime looks, so that `doctor` can say it."""
    dest.mkdir(parents=True, exist_ok=True)
    (dest / MANIFEST).write_text(json.dumps({"error": str(err), "detail": err.detail[-4000:],
                                             "patches": patch_digest(), "built_at": round(time.time())}, indent=1))
