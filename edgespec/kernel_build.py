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
from pathlib import Path

LLAMA_CPP_PYTHON = "0.3.36"  # the pinned version (pyproject.toml): its vendored llama.cpp is ggml-org/llama.cpp@0c1e57098
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
LIB = "libggml-cpu.so.0"
MANIFEST = "build.json"
PATCH_DIR = Path(__file__).resolve().parent / "patches"
SKIP_ENV = "EDGESPEC_KERNELS_BUILD"  # "0": setup.py builds nothing (stock kernels)
SDIST_ENV = "EDGESPEC_SDIST"  # a local copy of the sdist, used instead of the index
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


def patch_digest(chosen: list[Path] | None = None) -> str:
    """What identifies the patch set: a build made from other patches is not loaded."""
    h = hashlib.sha256()
    for p in patches() if chosen is None else chosen:
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


def _pypi_fetch():
    """edgespec/pypi_fetch.py, also when this module was loaded by path (setup.py)."""
    if __package__:
        from . import pypi_fetch
        return pypi_fetch
    import importlib.util
    spec = importlib.util.spec_from_file_location("_edgespec_pypi_fetch", Path(__file__).with_name("pypi_fetch.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is made
    spec.loader.exec_module(mod)
    return mod


def fetch_sdist(log) -> Path:
    """The llama-cpp-python sdist, verified against its pinned sha256 before anything reads it:
    `EDGESPEC_SDIST` (a local copy, for machines without an index), the cache, else the index pip
    is configured for (edgespec/pypi_fetch.py: fetched as a file, nothing of it run)."""
    name = f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    pf = _pypi_fetch()
    local = os.environ.get(SDIST_ENV)
    if local:
        if not Path(local).is_file() or pf.sha256(Path(local)) != SDIST_SHA256:
            raise BuildError(f"{SDIST_ENV}={local} is not llama-cpp-python {LLAMA_CPP_PYTHON}'s sdist "
                             f"(sha256 {SDIST_SHA256[:12]}...)")
        return Path(local)
    path = cache_dir() / "sdist" / name
    if path.is_file() and pf.sha256(path) == SDIST_SHA256:
        return path
    log(f"fetching the llama.cpp source (llama-cpp-python {LLAMA_CPP_PYTHON} sdist, 77 MB)")
    try:
        return pf.fetch("llama-cpp-python", name, SDIST_SHA256, path)
    except (pf.FetchError, OSError) as e:
        raise BuildError(f"cannot fetch the llama.cpp source: {e}; offline, set {SDIST_ENV} to a copy of {name}") from e


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
        if hasattr(tarfile, "data_filter"):  # refuses links and modes that reach outside `dest`
            tar.extractall(dest, members=members, filter="data")
        else:
            tar.extractall(dest, members=members)
    return dest


def apply_patches(src: Path, chosen: list[Path] | None = None) -> None:
    for p in patches() if chosen is None else chosen:
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


# A tiny program that uses AMX as ggml's AMX kernels do: ask Linux for the tile state, configure
# the tiles, multiply one int8 tile pair. Exit 0 where AMX runs; a signal or another code where not.
_AMX_PROBE = r"""
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
int main(void) {
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) != 0) return 3;
    static unsigned char cfg[64];
    static int8_t a[16 * 64], b[16 * 64];
    static int32_t c[16 * 16];
    memset(a, 1, sizeof a);
    memset(b, 1, sizeof b);
    cfg[0] = 1;  /* palette 1; tiles 0-2: 16 rows of 64 bytes */
    for (int t = 0; t < 3; t++) { cfg[16 + 2 * t] = 64; cfg[48 + t] = 16; }
    _tile_loadconfig(cfg);
    _tile_zero(0);
    _tile_loadd(1, a, 64);
    _tile_loadd(2, b, 64);
    _tile_dpbssd(0, 1, 2);
    _tile_stored(0, c, 64);
    _tile_release();
    return c[0] == 64 ? 0 : 4;
}
"""


def amx_runs(cc: str | None = None) -> bool | None:
    """Whether this machine runs AMX instructions (None: no compiler here knows them, so no build
    uses them). Some virtual machines report AMX in cpuid and /proc/cpuinfo but trap it: a native
    build of llama.cpp then dies of SIGILL in every model command."""
    cc = cc or os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        return None
    with tempfile.TemporaryDirectory(prefix="edgespec-amx-") as tmp:
        src, exe = Path(tmp) / "amx.c", Path(tmp) / "amx"
        src.write_text(_AMX_PROBE)
        try:
            r = subprocess.run([cc, "-O1", "-mamx-tile", "-mamx-int8", str(src), "-o", str(exe)],
                               capture_output=True, timeout=120)
            if r.returncode != 0:
                return None
            return subprocess.run([str(exe)], capture_output=True, timeout=30).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            return None


# ggml's options for the x86 extensions of a non-native build, and the /proc/cpuinfo flags each needs
# (GGML_AVX512 compiles with AVX-512 F, CD, VL, DQ and BW). AMX has none here: it is what is left out.
_GGML_ISA_OPTIONS = (
    ("GGML_SSE42", ("sse4_2",)), ("GGML_AVX", ("avx",)), ("GGML_AVX2", ("avx2",)), ("GGML_BMI2", ("bmi2",)),
    ("GGML_FMA", ("fma",)), ("GGML_F16C", ("f16c",)), ("GGML_AVX_VNNI", ("avx_vnni",)),
    ("GGML_AVX512", ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw")),
    ("GGML_AVX512_VBMI", ("avx512vbmi",)), ("GGML_AVX512_VNNI", ("avx512_vnni",)),
    ("GGML_AVX512_BF16", ("avx512_bf16",)),
)


def without_amx(flags: set[str]) -> list[str]:
    """CMake arguments for a build that uses what this CPU reports except AMX."""
    out = ["-DGGML_NATIVE=OFF"]
    avx512 = all(f in flags for f in dict(_GGML_ISA_OPTIONS)["GGML_AVX512"])
    for option, need in _GGML_ISA_OPTIONS:
        on = all(f in flags for f in need) and (avx512 or not option.startswith("GGML_AVX512_"))
        out.append(f"-D{option}={'ON' if on else 'OFF'}")
    return out + ["-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]


def _native(user: list[str]) -> bool:
    """Whether these CMake arguments leave GGML_NATIVE on (llama.cpp's default) and say nothing of AMX."""
    if any("AMX" in a.upper() for a in user):
        return False
    return not any(re.fullmatch(r"-DGGML_NATIVE(:BOOL)?=(OFF|off|0|FALSE|false|NO|no)", a) for a in user)


def trapped_amx(user: list[str], flags: set[str] | None = None, probe=amx_runs) -> bool:
    """Whether a native build would use AMX that this machine reports but does not run."""
    flags = cpu_flags() if flags is None else flags
    if not flags or "amx_tile" not in flags or not _native(user):
        return False
    return probe() is False


def cmake_args(env: dict | None = None, amx_check=trapped_amx) -> list[str]:
    """llama-cpp-python's build settings as CMake arguments: a Release build of shared libraries
    with the user's `CMAKE_ARGS` (GGML_NATIVE and the instruction sets, as llama-cpp-python took them),
    other backends off. The library's only search path is its own folder (`$ORIGIN`): CMake's
    default build RPATH names the build's temporary folder, which anyone could recreate.
    On a machine that reports AMX but traps it, a native build becomes one for the same
    extensions without AMX (`amx_check`)."""
    env = os.environ if env is None else env
    user = shlex.split(env.get("CMAKE_ARGS", ""))
    if any(re.fullmatch(r"-DGGML_BACKEND_DL(:BOOL)?=(ON|on|1|TRUE|true)", a) for a in user):
        raise BuildError("CMAKE_ARGS asks for GGML_BACKEND_DL (CPU variants loaded at run time): edgespec's "
                         "kernels replace a linked ggml-cpu only")
    if platform.machine().lower() in ("x86_64", "amd64") and amx_check(user):
        user = user + without_amx(cpu_flags() or set())
    return (["-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
             "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=OFF", "-DLLAMA_BUILD_SERVER=OFF",
             "-DLLAMA_BUILD_COMMON=OFF", "-DCMAKE_EXPORT_COMPILE_COMMANDS=ON"] + user
            + [f"-DGGML_{b}=OFF" for b in _OTHER_BACKENDS]
            + ["-DCMAKE_SKIP_BUILD_RPATH=OFF", "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON", "-DCMAKE_INSTALL_RPATH=$ORIGIN"])


BUILD_TIMEOUT = 3600  # seconds for each of configure and compile: a stuck toolchain ends, stock kernels run


def _run(cmd: list[str], cwd: Path, what: str) -> None:
    try:
        r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=BUILD_TIMEOUT)
    except subprocess.TimeoutExpired as e:
        raise BuildError(f"{what} did not finish in {BUILD_TIMEOUT} s") from e
    if r.returncode != 0:
        tail = "\n".join((r.stdout + r.stderr).splitlines()[-30:])
        raise BuildError(f"{what} failed (exit {r.returncode})", tail)


# The compiler's predefined macros for x86 instruction-set extensions, and the name /proc/cpuinfo
# gives each: what a build needs of the CPU that runs it.
_ISA_MACROS = {
    "__SSE3__": "pni", "__SSSE3__": "ssse3", "__SSE4_1__": "sse4_1", "__SSE4_2__": "sse4_2", "__POPCNT__": "popcnt",
    "__AVX__": "avx", "__AVX2__": "avx2", "__FMA__": "fma", "__F16C__": "f16c", "__BMI__": "bmi1", "__BMI2__": "bmi2",
    "__AVXVNNI__": "avx_vnni", "__AVX512F__": "avx512f", "__AVX512CD__": "avx512cd", "__AVX512BW__": "avx512bw",
    "__AVX512DQ__": "avx512dq", "__AVX512VL__": "avx512vl", "__AVX512VBMI__": "avx512vbmi",
    "__AVX512VBMI2__": "avx512_vbmi2", "__AVX512VNNI__": "avx512_vnni", "__AVX512BF16__": "avx512_bf16",
    "__AVX512FP16__": "avx512_fp16", "__AVX512IFMA__": "avx512ifma", "__AVX512BITALG__": "avx512_bitalg",
    "__AVX512VPOPCNTDQ__": "avx512_vpopcntdq", "__AMX_TILE__": "amx_tile", "__AMX_INT8__": "amx_int8",
    "__AMX_BF16__": "amx_bf16", "__GFNI__": "gfni", "__VAES__": "vaes", "__VPCLMULQDQ__": "vpclmulqdq",
}


def isa_of(build: Path) -> list[str]:
    """The x86 extensions the compiled ggml-cpu uses, read from how CMake compiled it: its -m/-march
    flags given to the same compiler, which names what they enable."""
    try:
        commands = json.loads((build / "compile_commands.json").read_text())
    except (OSError, ValueError) as e:
        raise BuildError(f"the build left no readable compile_commands.json: {e}") from e
    entry = next((c for c in commands if c.get("file", "").endswith("ggml-cpu/ggml-cpu.c")), None)
    if entry is None:
        raise BuildError("compile_commands.json does not name ggml-cpu.c")
    argv = entry.get("arguments") or shlex.split(entry.get("command", ""))
    flags = [a for a in argv[1:] if a.startswith(("-m", "-march", "-mtune"))]
    r = subprocess.run([argv[0]] + flags + ["-dM", "-E", "-x", "c", os.devnull], capture_output=True, text=True,
                       timeout=60)
    if r.returncode != 0:
        raise BuildError("the compiler did not say which instructions the build uses", r.stderr[-2000:])
    macros = {line.split()[1] for line in r.stdout.splitlines() if line.startswith("#define ")}
    return sorted(flag for m, flag in _ISA_MACROS.items() if m in macros)


def cpu_flags() -> set[str] | None:
    """This CPU's extensions as /proc/cpuinfo names them (None where it cannot be read)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        return None
    return None


def search_paths(lib: Path) -> list[str]:
    """The RPATH and RUNPATH entries of an ELF shared library (64-bit little-endian, as x86-64 builds
    are): where the loader looks for what it needs before the system's folders."""
    import struct

    data = lib.read_bytes()
    if data[:6] != b"\x7fELF\x02\x01":
        raise BuildError(f"{lib} is not a 64-bit little-endian ELF file")
    try:
        shoff, = struct.unpack_from("<Q", data, 0x28)
        shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
        sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
        out = []
        for sh in sections:
            if sh[1] != 6:  # SHT_DYNAMIC
                continue
            strtab = sections[sh[6]]  # sh_link: its string table
            for off in range(sh[4], sh[4] + sh[5], 16):
                tag, val = struct.unpack_from("<qQ", data, off)
                if tag == 0:
                    break
                if tag in (15, 29):  # DT_RPATH, DT_RUNPATH
                    start = strtab[4] + val
                    out += data[start:data.index(b"\0", start)].decode(errors="replace").split(":")
        return out
    except (struct.error, IndexError, ValueError) as e:
        raise BuildError(f"{lib} is not a readable ELF file ({e})") from e


def foreign_search_paths(lib: Path) -> list[str]:
    """Search paths of `lib` outside its own folder (an empty entry means the working directory)."""
    return [p for p in search_paths(lib) if p not in ("$ORIGIN", "${ORIGIN}")]


MANIFEST_FORMAT = 2  # 2: the instruction sets recorded, search paths inside the library's folder


def build(dest: Path, log=lambda msg: None, jobs: int | None = None, patch_files: list[Path] | None = None) -> dict:
    """Build the patched `ggml-cpu` into `dest` (LIB and MANIFEST); returns the manifest.
    `patch_files`: a subset of the patches (the tests' controls); all of them by default."""
    why = unsupported()
    if why:
        raise BuildError(why)
    cmake = shutil.which("cmake")
    if cmake is None:
        raise BuildError("cmake is not installed (llama-cpp-python's own build needs it too)")
    started = time.time()
    args = cmake_args()
    if "-DGGML_AMX_TILE=OFF" in args and "-DGGML_AMX_TILE=OFF" not in shlex.split(os.environ.get("CMAKE_ARGS", "")):
        log("this CPU reports AMX but does not run it (a virtual machine's trap): building for its other "
            "instruction sets without AMX")
    chosen = patches() if patch_files is None else list(patch_files)
    sdist = fetch_sdist(log)
    with tempfile.TemporaryDirectory(prefix="edgespec-kernels-") as tmp:
        try:
            src = extract(sdist, Path(tmp) / "llama.cpp")
        except (OSError, tarfile.TarError) as e:
            raise BuildError(f"cannot unpack the llama.cpp source: {e}") from e
        apply_patches(src, chosen)
        out = Path(tmp) / "build"
        log("configuring llama.cpp's CPU backend (CMake)")
        gen = ["-G", "Ninja"] if shutil.which("ninja") else []
        _run([cmake, "-S", str(src), "-B", str(out)] + gen + args, Path(tmp), "cmake configure")
        log(f"compiling ggml-cpu with {len(chosen)} patches (about a minute)")
        _run([cmake, "--build", str(out), "--target", "ggml-cpu", "-j", str(jobs or os.cpu_count() or 2)],
             Path(tmp), "cmake build")
        built = sorted((out / "bin").glob("libggml-cpu.so.*.*.*"))
        if not built:
            raise BuildError("the build left no libggml-cpu.so")
        foreign = foreign_search_paths(built[-1])
        if foreign:
            raise BuildError(f"the built library searches {':'.join(foreign)} for libraries (only $ORIGIN is allowed)")
        isa = isa_of(out) if platform.machine().lower() in ("x86_64", "amd64") else []
        ggml = built[-1].name[len("libggml-cpu.so."):]
        dest.mkdir(parents=True, exist_ok=True)
        part = dest / f".{LIB}.part"
        shutil.copyfile(built[-1], part)
        os.replace(part, dest / LIB)
    digest = patch_digest(chosen)
    manifest = {"format": MANIFEST_FORMAT, "llama_cpp_python": LLAMA_CPP_PYTHON, "ggml": ggml, "patches": digest,
                "patch_files": [p.name for p in chosen], "cmake_args": args, "machine": platform.machine(),
                "isa": isa, "built_at": round(time.time()), "seconds": round(time.time() - started, 1)}
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def record_failure(dest: Path, err: BaseException, skipped: bool = False) -> None:
    """Leave why the build failed (or was skipped) where the runtime looks, so that `run`, `chat`,
    `serve` and `doctor` can say it."""
    dest.mkdir(parents=True, exist_ok=True)
    detail = getattr(err, "detail", "") or ""
    (dest / MANIFEST).write_text(json.dumps({"error": str(err) or type(err).__name__, "skipped": skipped,
                                             "detail": detail[-4000:], "patches": patch_digest(),
                                             "built_at": round(time.time())}, indent=1))
