"""Which llama.cpp CPU kernels this process runs: edgespec's batch-invariant build of `ggml-cpu`
(kernel_build, made at install time), loaded in place of llama-cpp-python's own, or the stock ones.

The swap works through the dynamic loader: llama-cpp-python's libllama needs `libggml-cpu.so.0` by
its soname, and a library already loaded under that soname is the one it gets. So `preload` (run
when edgespec is imported, before anything imports llama_cpp) loads llama-cpp-python's own
`libggml-base.so.0` and then the patched `libggml-cpu.so.0` into the process. Nothing else changes:
the same llama.cpp, the same flags, two summation orders moved (edgespec/patches/).

Where the build is missing, stale or cannot load (a user's own CUDA/Metal wheel, a failed build,
macOS, `EDGESPEC_KERNELS=stock`), llama-cpp-python's kernels run, and `info()` says why; the
exactness probe reads what the loaded kernels keep exact either way.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import json
import os
import sys
from pathlib import Path

from . import kernel_build

ENV = "EDGESPEC_KERNELS"  # "stock": llama-cpp-python's own; a folder: the build there; unset: the installed build
PACKAGE_DIR = Path(__file__).resolve().parent / "_kernels"  # where setup.py builds it
# The tiled K-quant kernel (Q5_K, Q6_K, IQ4_XS ... weights that are not repacked) sums in another
# order than the per-row dot product one row takes. Patch 0002 makes its row floor settable; above
# the exactness probe's largest batch (32 rows), every verification a strict policy allows takes the
# per-row kernel, and prompts (hundreds of rows) keep the tiled one.
TILED_MIN_ROWS_ENV = "GGML_CPU_TILED_MM_MIN_ROWS"
TILED_MIN_ROWS = 33

_state: dict = {"kernels": "stock", "why": "not loaded yet"}


def tiled_min_rows() -> int:
    """The tiled K-quant kernel's row floor in force (patch 0002): edgespec's, or the user's."""
    try:
        return max(1, int(os.environ.get(TILED_MIN_ROWS_ENV, "")))
    except ValueError:
        return TILED_MIN_ROWS


def cache_dir() -> Path:
    """Where `edgespec kernels --build` puts a build (the user cache folder)."""
    from .cachedir import cache_root

    return cache_root() / "kernels"


def _llama_lib_dir() -> Path | None:
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "lib"


def _manifest(folder: Path) -> dict | None:
    try:
        m = json.loads((folder / kernel_build.MANIFEST).read_text())
        return m if isinstance(m, dict) else None
    except (OSError, ValueError):
        return None


def candidates() -> list[Path]:
    env = os.environ.get(ENV, "")
    if env and env != "stock":
        return [Path(env).expanduser()]
    return [PACKAGE_DIR, cache_dir()]


def _usable(folder: Path, lib_dir: Path) -> str:
    """Why the build in `folder` cannot replace llama-cpp-python's kernels ('' if it can)."""
    m = _manifest(folder)
    if m is not None and m.get("error"):
        if m.get("skipped"):
            return f"the kernel build was skipped ({m['error']}); `edgespec kernels --build` makes it"
        return f"the kernel build failed ({m['error']}); `edgespec kernels --build` tries again"
    if m is None or not (folder / kernel_build.LIB).is_file():
        return f"no build in {folder}"
    if m.get("format") != kernel_build.MANIFEST_FORMAT:
        return "the build is from an older edgespec; `edgespec kernels --build` makes it again"
    if m.get("patches") != kernel_build.patch_digest():
        return "the build was made from other patches; `edgespec kernels --build` makes it again"
    try:
        installed = importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        installed = "?"
    if installed != m.get("llama_cpp_python"):
        return (f"built for llama-cpp-python {m.get('llama_cpp_python')}, {installed} is installed; "
                "`edgespec kernels --build` makes it again")
    have = kernel_build.cpu_flags()
    missing = sorted(set(m.get("isa") or []) - have) if have is not None else []
    if missing:
        return (f"the build uses {', '.join(missing)}, which this CPU lacks (built for another machine); "
                "`edgespec kernels --build` makes it for this one")
    try:
        foreign = kernel_build.foreign_search_paths(folder / kernel_build.LIB)
    except (OSError, ValueError, kernel_build.BuildError) as e:
        return f"{folder / kernel_build.LIB} is not a readable library ({e})"
    if foreign:
        return (f"{folder / kernel_build.LIB} searches {':'.join(foreign)} for libraries, outside its own folder; "
                "`edgespec kernels --build` makes it again")
    if not (lib_dir / kernel_build.LIB).is_file():
        return "llama-cpp-python's build has no linked libggml-cpu.so.0 (GGML_BACKEND_DL or another platform)"
    if not (lib_dir / f"libggml-base.so.{m.get('ggml')}").is_file():
        return f"llama-cpp-python's ggml is not {m.get('ggml')}"
    return ""


def _newest_first(folders: list[Path]) -> list[Path]:
    """The builds in the order they are tried: the newest first, so that `edgespec kernels --build`
    (into the cache) replaces what `pip install` built (in the package)."""
    return sorted(folders, key=lambda f: -float((_manifest(f) or {}).get("built_at") or 0))


def preload() -> dict:
    """Load the patched kernels in place of llama-cpp-python's own, once, before llama_cpp is
    imported; returns `info()`."""
    global _state
    if _state.get("why") != "not loaded yet":
        return _state
    why = kernel_build.unsupported()
    if os.environ.get(ENV) == "stock":
        why = f"{ENV}=stock"
    elif not why and "llama_cpp" in sys.modules:
        why = "llama_cpp was imported before edgespec: its own kernels are loaded"
    lib_dir = _llama_lib_dir()
    if not why and lib_dir is None:
        why = "llama-cpp-python is not installed"
    if not why:
        reasons = []
        asked = candidates()
        for folder in _newest_first(asked) if len(asked) > 1 else asked:
            r = _usable(folder, lib_dir)
            if not r:
                try:
                    ctypes.CDLL(str(lib_dir / "libggml-base.so.0"), mode=ctypes.RTLD_GLOBAL)
                    ctypes.CDLL(str(folder / kernel_build.LIB), mode=ctypes.RTLD_GLOBAL)
                except OSError as e:
                    reasons.append(f"{folder / kernel_build.LIB} does not load: {e}")
                    continue
                if not os.environ.get(TILED_MIN_ROWS_ENV, "").strip():  # unset or empty: ggml's 8 otherwise
                    os.environ[TILED_MIN_ROWS_ENV] = str(TILED_MIN_ROWS)
                _state = {"kernels": "batch-invariant", "path": str(folder / kernel_build.LIB),
                          "patches": kernel_build.patch_digest(), "why": ""}
                return _state
            reasons.append(r)
        # the installed build's reason is the one that matters where no other build was made
        why = next((r for r in reasons if not r.startswith("no build in")), reasons[0] if reasons else "no build")
    _state = {"kernels": "stock", "why": why}
    return _state


def info() -> dict:
    """Which kernels run: `kernels` ('batch-invariant' or 'stock'), `why` stock, the build's path.
    Once llama.cpp is loaded, what the process maps is checked too (Linux)."""
    s = dict(_state)
    if s["kernels"] == "batch-invariant" and "llama_cpp" in sys.modules:
        try:
            maps = Path("/proc/self/maps").read_text()
        except OSError:
            return s
        mapped = {line.split()[-1] for line in maps.splitlines() if "libggml-cpu" in line}
        if any(Path(p).parent != Path(s["path"]).parent for p in mapped):
            s = {"kernels": "stock", "why": f"llama.cpp loaded its own ggml-cpu as well ({', '.join(sorted(mapped))})"}
    return s


def batch_invariant() -> bool:
    return info()["kernels"] == "batch-invariant"


# Environment settings that change the CPU kernels' arithmetic (which kernel sums a batch, and in
# which order): each is part of the cost cache's key, since a probe read under one says nothing of another.
ARITHMETIC_ENV = ("GGML_CPU_TILED_MM", "GGML_CPU_TILED_MM_FORCE", TILED_MIN_ROWS_ENV, "GGML_CPU_DISABLE_FUSION")


def tag() -> str:
    """What sets these kernels apart, for the cost cache's key: a probe read with one set of
    kernels, or one setting of their arithmetic, says nothing about another."""
    s = info()
    env = "".join(f"|{k[len('GGML_CPU_'):].lower()}={os.environ[k]}" for k in ARITHMETIC_ENV if k in os.environ)
    return (f"|bi{s['patches']}" if s["kernels"] == "batch-invariant" else "") + env


def build_notice() -> str:
    """One line, once per reason, where the stock kernels run because edgespec's could not be built or
    loaded here: `run`, `chat` and `serve` print it, with the command that retries ('' otherwise:
    the batch-invariant kernels run, the user asked for the stock ones, or another platform)."""
    s = _state
    if s.get("kernels") != "stock" or os.environ.get(ENV) == "stock" or kernel_build.unsupported() \
            or s.get("why", "").startswith("llama_cpp was imported"):
        return ""
    mark = f"{(_manifest(PACKAGE_DIR) or {}).get('built_at')}|{s.get('why')}"
    said = cache_dir() / "notice-said"
    try:
        if said.read_text() == mark:
            return ""
    except OSError:
        pass
    try:
        said.parent.mkdir(parents=True, exist_ok=True)
        said.write_text(mark)
    except OSError:
        pass
    why = s.get("why", "")
    retry = "" if "kernels --build" in why else "; `edgespec kernels --build` builds them"
    return (f"edgespec: note: llama.cpp's stock CPU kernels run, not edgespec's batch-invariant ones ({why}){retry}; "
            "on K-quant models exact verification is then capped at a few rows")
