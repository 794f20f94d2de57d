"""What llama.cpp runs on here: its compiled backends and devices (ggml's device registry, bound
with ctypes: llama-cpp-python 0.3.36 does not bind it), GPU offload and RPC support, and the
system info line; the devices a model offloads to with RPC servers. Read by `edgespec doctor`, by
the engine's exactness policy and by the engine when it loads its models."""

from __future__ import annotations

import ctypes
import glob
import logging
import os
from functools import lru_cache

log = logging.getLogger(__name__)

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


# -- llama.cpp's RPC backend ----------------------------------------------------------------

RPC_INSTALL = ('CMAKE_ARGS="-DGGML_RPC=on" pip install --no-cache-dir --force-reinstall --no-deps '
               'llama-cpp-python==0.3.36')
_rpc_regs: dict[str, list[int]] = {}  # endpoint -> its devices, registered once per process


def parse_endpoint(text: str) -> tuple[str, int]:
    """HOST:PORT (or [IPv6]:PORT) -> (host, port); one clear line when it is not one."""
    from .errors import EdgespecError

    host, sep, port = text.strip().rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise EdgespecError(f"RPC server {text!r} is not HOST:PORT (e.g. 192.168.1.20:50052)")
    return host, int(port)


def _rpc_lib():
    lib = _ggml()
    if lib is None:
        return None
    try:
        lib.ggml_backend_reg_by_name.argtypes = [ctypes.c_char_p]
        lib.ggml_backend_reg_by_name.restype = ctypes.c_void_p
        lib.ggml_backend_reg_get_proc_address.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        lib.ggml_backend_reg_get_proc_address.restype = ctypes.c_void_p
        lib.ggml_backend_register.argtypes = [ctypes.c_void_p]
        lib.ggml_backend_register.restype = None
        lib.ggml_backend_reg_dev_count.argtypes = [ctypes.c_void_p]
        lib.ggml_backend_reg_dev_count.restype = ctypes.c_size_t
        lib.ggml_backend_reg_dev_get.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.ggml_backend_reg_dev_get.restype = ctypes.c_void_p
    except AttributeError:
        return None
    return lib


def add_rpc_servers(endpoints: list[str], timeout: float = 3.0) -> list[int]:
    """Register llama.cpp RPC servers (`rpc-server` on other machines) as devices, as llama.cpp's
    own `--rpc` does; returns their devices (pointers) for a model's device list. Each server is
    first reached with a plain TCP connect bounded by `timeout`, so an unreachable one is one
    clear line, never a hang in llama.cpp's connect."""
    import socket

    from .errors import EdgespecError

    if not rpc():
        raise EdgespecError(f"this llama-cpp-python was built without llama.cpp's RPC backend; reinstall it with "
                            f"RPC on: {RPC_INSTALL}")
    lib = _rpc_lib()
    reg = lib.ggml_backend_reg_by_name(b"RPC") if lib is not None else None
    fn = lib.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_rpc_add_server") if reg else None
    if not fn:
        raise EdgespecError(f"llama.cpp's RPC backend is not usable in this build ({RPC_INSTALL})")
    add_server = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)(fn)
    devices: list[int] = []
    for ep in endpoints:
        host, port = parse_endpoint(ep)
        key = f"{host}:{port}"
        if key not in _rpc_regs:
            try:
                socket.create_connection((host, port), timeout=timeout).close()
            except OSError as e:
                why = "timed out" if isinstance(e, TimeoutError) else (e.strerror or str(e))
                raise EdgespecError(f"cannot reach the RPC server {key}: {why} (is `rpc-server -H HOST -p {port}` "
                                    "running there, and the port open?)") from None
            r = add_server(f"{host}:{port}".encode())
            if not r:
                raise EdgespecError(f"the RPC server {key} did not answer llama.cpp's handshake (another version?)")
            lib.ggml_backend_register(r)
            _rpc_regs[key] = [lib.ggml_backend_reg_dev_get(r, i) for i in range(lib.ggml_backend_reg_dev_count(r))]
        devices += _rpc_regs[key]
    return devices


def local_gpu_devices() -> list[int]:
    """This machine's own GPU devices (not RPC ones), as pointers."""
    lib = _ggml()
    if lib is None:
        return []
    rpc_devs = {d for devs in _rpc_regs.values() for d in devs}
    out = []
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        if dev not in rpc_devs and DEVICE_TYPES.get(lib.ggml_backend_dev_type(dev)) in ("gpu", "igpu"):
            out.append(dev)
    return out



def devices_for(rpc: tuple[str, ...], rpc_draft: tuple[str, ...],
                n_gpu_layers: int) -> tuple[list[int] | None, list[int] | None]:
    """Devices for the target and the draft model: with `rpc` servers the target offloads to them
    (and this machine's GPUs), the draft model only to this machine's GPUs unless `rpc_draft`
    names servers for it. Without RPC: llama.cpp's default (every device), None."""
    if not rpc and not rpc_draft:
        return None, None
    target = add_rpc_servers(list(rpc)) if rpc else []
    draft = add_rpc_servers(list(rpc_draft)) if rpc_draft else []
    local = local_gpu_devices()
    if rpc and n_gpu_layers == 0:
        log.warning("--rpc: the target's layers stay here with -ngl 0; -ngl N (or -1: all) offloads them to "
                    "the RPC servers")
    return local + target, local + draft
