"""Checkpoint files in the formats heads are published in, written without torch (for the tests).

`save_torch` writes what `torch.save(state_dict, path)` writes (torch/serialization.py `_save`):
a zip, entries stored uncompressed, holding

    archive/data.pkl     pickle protocol 2 of an OrderedDict; each tensor is
                         REDUCE(torch._utils._rebuild_tensor_v2,
                                (storage, offset, size, stride, False, OrderedDict()))
                         where storage is a persistent id
                         ('storage', torch.<Dtype>Storage, key, 'cpu', numel)
    archive/byteorder    "little"
    archive/data/<key>   the storage's raw little-endian bytes
    archive/version      "3\\n"

The pickle opcodes are emitted by hand: the standard Pickler would have to import `torch` to
write a reference to `torch._utils._rebuild_tensor_v2`, and torch is not installed. bf16 is given
as its raw uint16 bits (`Bf16`), since numpy has no bf16. `save_safetensors` does the same for
safetensors files, for bf16, which `safetensors.numpy.save_file` cannot write.
"""

from __future__ import annotations

import json
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np


@dataclass(frozen=True)
class Bf16:
    """A bfloat16 tensor as its raw bit patterns (uint16), the top halves of float32 values."""

    bits: np.ndarray

    @staticmethod
    def from_float(values: np.ndarray) -> "Bf16":
        """float32 values rounded to the nearest bf16 (ties to even), like torch's .bfloat16()."""
        u = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
        rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        return Bf16(rounded.astype(np.uint16))

    def to_float(self) -> np.ndarray:
        """The float32 values these bits stand for (what a loader returns)."""
        return (self.bits.astype(np.uint32) << 16).view(np.float32)


@dataclass(frozen=True)
class Strided:
    """A tensor given by its storage and layout, as torch holds it: for views, offsets, sharing."""

    storage: np.ndarray | Bf16  # 1-D
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]  # in elements

    def values(self) -> np.ndarray:
        """The tensor's values (float32 for bf16), what a loader should return."""
        flat = self.storage.to_float() if isinstance(self.storage, Bf16) else self.storage
        item = flat.dtype.itemsize
        return np.lib.stride_tricks.as_strided(flat[self.offset:], self.shape,
                                               tuple(s * item for s in self.stride)).copy()


@dataclass(frozen=True)
class Global:
    """A call of an arbitrary global, module.name(*args): what a hostile checkpoint would hold."""

    module: str
    name: str
    args: tuple = ()


Tensor = np.ndarray | Bf16 | Strided

_STORAGE_NAMES = {
    np.dtype("float64"): "DoubleStorage", np.dtype("float32"): "FloatStorage",
    np.dtype("float16"): "HalfStorage", np.dtype("int64"): "LongStorage", np.dtype("int32"): "IntStorage",
    np.dtype("int16"): "ShortStorage", np.dtype("int8"): "CharStorage", np.dtype("uint8"): "ByteStorage",
    np.dtype("bool"): "BoolStorage",
}
_ST_NAMES = {
    np.dtype("float64"): "F64", np.dtype("float32"): "F32", np.dtype("float16"): "F16",
    np.dtype("int64"): "I64", np.dtype("int32"): "I32", np.dtype("int16"): "I16", np.dtype("int8"): "I8",
    np.dtype("uint8"): "U8", np.dtype("bool"): "BOOL",
}


# ---------------------------------------------------------------------------------------------
# pickle protocol 2, by hand


class _PickleWriter:
    """Just the opcodes a torch state dict needs (see pickletools for their meaning)."""

    def __init__(self) -> None:
        self.out = bytearray(b"\x80\x02")  # PROTO 2

    def glob(self, module: str, name: str) -> None:
        self.out += b"c" + module.encode() + b"\n" + name.encode() + b"\n"  # GLOBAL

    def value(self, v: Any) -> None:
        """A plain value: None, bool, int, float, str, tuple, dict, or a Global call."""
        if v is None:
            self.out += b"N"
        elif v is True or v is False:
            self.out += b"\x88" if v else b"\x89"  # NEWTRUE / NEWFALSE
        elif isinstance(v, int):
            self.integer(v)
        elif isinstance(v, float):
            self.out += b"G" + struct.pack(">d", v)  # BINFLOAT
        elif isinstance(v, str):
            data = v.encode("utf-8")
            self.out += b"X" + struct.pack("<I", len(data)) + data  # BINUNICODE
        elif isinstance(v, tuple):
            self.out += b"("  # MARK
            for item in v:
                self.value(item)
            self.out += b"t"  # TUPLE
        elif isinstance(v, dict):
            self.out += b"}"  # EMPTY_DICT
            self.items(v)
        elif isinstance(v, Global):
            self.glob(v.module, v.name)
            self.value(tuple(v.args))
            self.out += b"R"  # REDUCE
        else:
            raise TypeError(f"cannot pickle {type(v).__name__} here")

    def integer(self, v: int) -> None:
        if 0 <= v < 256:
            self.out += b"K" + bytes([v])  # BININT1
        elif 0 <= v < 65536:
            self.out += b"M" + struct.pack("<H", v)  # BININT2
        elif -(2 ** 31) <= v < 2 ** 31:
            self.out += b"J" + struct.pack("<i", v)  # BININT
        else:
            data = v.to_bytes((v.bit_length() + 8) // 8, "little", signed=True)
            self.out += b"\x8a" + bytes([len(data)]) + data  # LONG1

    def items(self, d: Mapping[Any, Any]) -> None:
        """SETITEMS on the dict at the top of the stack."""
        if d:
            self.out += b"("
            for k, v in d.items():
                self.value(k)
                self.value(v)
            self.out += b"u"  # SETITEMS

    def ordered_dict(self, d: Mapping[str, Any], emit: Any, metadata: bool) -> None:
        """collections.OrderedDict() filled with SETITEMS, plus BUILD of `_metadata` as state_dict() has."""
        self.glob("collections", "OrderedDict")
        self.out += b")R"  # EMPTY_TUPLE, REDUCE
        if d:
            self.out += b"("
            for k, v in d.items():
                self.value(k)
                emit(v)
            self.out += b"u"
        if metadata:
            self.out += b"}"
            self.value("_metadata")
            self.glob("collections", "OrderedDict")
            self.out += b")R"
            self.items({"": {"version": 1}})
            self.out += b"s"  # SETITEM
            self.out += b"b"  # BUILD

    def tensor(self, storage_name: str, key: str, numel: int, offset: int, shape: tuple, stride: tuple) -> None:
        self.glob("torch._utils", "_rebuild_tensor_v2")
        self.out += b"("  # MARK of the args tuple
        self.out += b"("  # the persistent id tuple
        self.value("storage")
        self.glob("torch", storage_name)
        self.value(key)
        self.value("cpu")
        self.integer(numel)
        self.out += b"tQ"  # TUPLE, BINPERSID
        self.integer(offset)
        self.value(tuple(shape))
        self.value(tuple(stride))
        self.out += b"\x89"  # requires_grad False
        self.glob("collections", "OrderedDict")
        self.out += b")R"  # backward_hooks OrderedDict()
        self.out += b"tR"  # TUPLE, REDUCE

    def finish(self) -> bytes:
        return bytes(self.out + b".")  # STOP


# ---------------------------------------------------------------------------------------------
# torch zip


def _layout(t: Tensor) -> tuple[np.ndarray | Bf16, int, tuple[int, ...], tuple[int, ...]]:
    """(1-D storage, offset, shape, stride) of a tensor; strided ndarrays keep their strides."""
    if isinstance(t, Strided):
        return t.storage, t.offset, tuple(t.shape), tuple(t.stride)
    bits = t.bits if isinstance(t, Bf16) else t
    item = bits.dtype.itemsize
    if bits.flags.c_contiguous or bits.size == 0 or any(s < 0 for s in bits.strides):
        flat = np.ascontiguousarray(bits).reshape(-1)
        stride = tuple(int(s) for s in np.cumprod((1,) + bits.shape[:0:-1])[::-1]) if bits.ndim else ()
        storage = Bf16(flat) if isinstance(t, Bf16) else flat
        return storage, 0, bits.shape, stride
    # a non-contiguous view (a transpose, a slice): keep its layout over a storage that spans it
    stride = tuple(s // item for s in bits.strides)
    span = 1 + sum((n - 1) * s for n, s in zip(bits.shape, stride))
    flat = np.zeros(span, dtype=bits.dtype)
    np.lib.stride_tricks.as_strided(flat, bits.shape, bits.strides)[...] = bits
    return (Bf16(flat) if isinstance(t, Bf16) else flat), 0, bits.shape, stride


@dataclass(frozen=True)
class _Ref:
    """A tensor entry of the pickle: which storage record, and the layout over it."""

    storage_name: str
    key: str
    numel: int
    offset: int
    shape: tuple
    stride: tuple


def _storage_identity(t: Tensor) -> int:
    """What decides storage sharing: the same ndarray/Bf16 object, or the same Strided storage."""
    return id(t.storage) if isinstance(t, Strided) else id(t)


def save_torch(path: str | Path, tensors: Mapping[str, Tensor], extra_global: Global | Any = None,
               wrap: str | None = None, prefix: str = "archive", metadata: bool = True) -> None:
    """Write `tensors` as torch.save would write the state dict, to `path`.

    Tensors that share a storage object (the same ndarray, or Strided views of one storage)
    share one storage record, as tied weights do in torch. `extra_global` adds an entry
    "__extra__" that calls a global when unpickled by an unrestricted loader: a `Global`, or any
    object whose __reduce__ returns (callable, args). `wrap` nests the dict as {wrap: dict,
    "epoch": 1}, as training scripts save. `metadata` writes state_dict()'s `_metadata` state.
    """
    storages: dict[int, tuple[str, np.ndarray | Bf16]] = {}
    entries: dict[str, Any] = {}
    for name, t in tensors.items():
        storage, offset, shape, stride = _layout(t)
        ident = _storage_identity(t)
        if ident not in storages:
            storages[ident] = (str(len(storages)), storage)
        key, storage = storages[ident]
        bits = storage.bits if isinstance(storage, Bf16) else storage
        storage_name = "BFloat16Storage" if isinstance(storage, Bf16) else _STORAGE_NAMES[bits.dtype]
        entries[name] = _Ref(storage_name, key, bits.size, offset, tuple(shape), tuple(stride))
    if extra_global is not None:
        entries["__extra__"] = extra_global if isinstance(extra_global, Global) else _as_global(extra_global)

    w = _PickleWriter()

    def emit(v: Any) -> None:
        if isinstance(v, _Ref):
            w.tensor(v.storage_name, v.key, v.numel, v.offset, v.shape, v.stride)
        else:
            w.value(v)

    if wrap is None:
        w.ordered_dict(entries, emit, metadata)
    else:
        w.out += b"}("
        w.value(wrap)
        w.ordered_dict(entries, emit, metadata)
        w.value("epoch")
        w.value(1)
        w.out += b"u"

    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as zf:
        zf.writestr(f"{prefix}/data.pkl", w.finish())
        zf.writestr(f"{prefix}/byteorder", "little")
        for key, storage in sorted(storages.values(), key=lambda ks: int(ks[0])):
            bits = storage.bits if isinstance(storage, Bf16) else storage
            little = np.ascontiguousarray(bits).astype(bits.dtype.newbyteorder("<"))
            zf.writestr(f"{prefix}/data/{key}", little.tobytes())
        zf.writestr(f"{prefix}/version", "3\n")


def _as_global(obj: Any) -> Global:
    """A Global from an object's __reduce__ (callable, args), without calling anything."""
    func, args = obj.__reduce__()[:2]
    return Global(func.__module__, func.__qualname__, tuple(args))


# ---------------------------------------------------------------------------------------------
# safetensors


def save_safetensors(path: str | Path, tensors: Mapping[str, np.ndarray | Bf16],
                     metadata: Mapping[str, str] | None = None) -> None:
    """A safetensors file (the format's spec: u64 header length, JSON header, data), bf16 included."""
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    chunks: list[bytes] = []
    offset = 0
    for name, t in tensors.items():
        bits = t.bits if isinstance(t, Bf16) else t
        data = np.ascontiguousarray(bits).astype(bits.dtype.newbyteorder("<")).tobytes()
        dtype = "BF16" if isinstance(t, Bf16) else _ST_NAMES[bits.dtype]
        header[name] = {"dtype": dtype, "shape": list(bits.shape), "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the reference writer pads the header to 8 bytes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for chunk in chunks:
            f.write(chunk)
