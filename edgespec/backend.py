"""What llama.cpp runs on here: its compiled backends and devices (ggml's device registry, bound
with ctypes: llama-cpp-python 0.3.36 does not bind it), GPU offload and RPC support, and the
system info line. Read by `edgespec doctor` and by the engine's exactness policy."""

from __future__ import annotations

import ctypes
import glob
import os
from functools import lru_cache

DEVICE_TYPES = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel", 4: "meta"}


@lru_cache(maxsize=1)
def _ggml():
    """libggml (already loaded by libllama), or None where it cannot be found."""
    import llama_cpp

    here = os.path.join(os.path.dirname(llama_cpp.__file__), "lib")
    for pat in ("libggml.so", "libggml.dylib", "ggml.dll", "libggml.so.*"):
        for path in sorted(glob.glob(os.path.join(here, pat))):
            try:
                lib = ctypes.CDLL(path)
            except OSError:
                continue
            try:
                lib.ggml_backend_dev_count.restype = ctypes.c_size_t
                lib.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
                lib.ggml_backend_dev_get.restype = ctypes.c_void_p
                for name in ("ggml_backend_dev_name", "ggml_backend_dev_description"):
                    getattr(lib, name).argtypes = [ctypes.c_void_p]
                    getattr(lib, name).restype = ctypes.c_char_p
                lib.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
                lib.ggml_backend_dev_type.restype = ctypes.c_int
                lib.ggml_backend_dev_memory.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t),
                                                        ctypes.POINTER(ctypes.c_size_t)]
                lib.ggml_backend_dev_memory.restype = None
            except AttributeError:
                continue
            return lib
    return None


def devices() -> list[dict]:
    """Every device llama.cpp can run on: name, description, type (cpu, gpu, igpu, accel),
    memory free and total in bytes (0 where the backend does not say)."""
    import llama_cpp

    llama_cpp.llama_backend_init()
    lib = _ggml()
    if lib is None:
        return []
    out = []
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        lib.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        out.append({"name": (lib.ggml_backend_dev_name(dev) or b"").decode(errors="replace"),
                    "description": (lib.ggml_backend_dev_description(dev) or b"").decode(errors="replace"),
                    "type": DEVICE_TYPES.get(lib.ggml_backend_dev_type(dev), "other"),
                    "memory_free": free.value, "memory_total": total.value})
    return out


def has_gpu() -> bool:
    """A GPU (discrete or integrated) or accelerator device is available to offload to."""
    return any(d["type"] in ("gpu", "igpu", "accel") for d in devices())


def gpu_offload() -> bool:
    import llama_cpp

    return bool(llama_cpp.llama_supports_gpu_offload())


def rpc() -> bool:
    import llama_cpp

    return bool(llama_cpp.llama_supports_rpc())


def system_info() -> str:
    import llama_cpp

    return llama_cpp.llama_print_system_info().decode(errors="replace").strip()


def on_gpu(n_gpu_layers: int) -> bool:
    """Whether a model loaded with `n_gpu_layers` runs (partly) on a GPU here."""
    return n_gpu_layers != 0 and gpu_offload() and has_gpu()
