"""Published head checkpoints (Medusa, EAGLE, EAGLE-3) read into numpy arrays, without torch.

Why no torch: heads are converted once into edgespec's own GGUF, and pulling a 700 MB framework
into a llama.cpp runner for that is out of proportion. The formats are simple enough to read
directly:

* safetensors: an 8-byte little-endian header length, a JSON header naming each tensor's
  dtype, shape and byte range, then the raw data. The header is parsed here rather than with
  `safetensors.numpy`, because that loader cannot give bfloat16 (numpy has no such dtype), and
  many heads are published in bf16; bf16 is widened to float32 exactly (it is the top half of
  a float32).
* PyTorch's `torch.save` files (`.pt`, `.bin`): a zip holding `<prefix>/data.pkl`, a pickle of
  the state dict whose tensors refer to raw storages `<prefix>/data/<key>`. A pickle can run any
  code it names, so it is read with the same rule as `torch.load(weights_only=True)`: the
  unpickler resolves only the few globals a tensor dict needs (the tensor rebuild functions, the
  storage classes, OrderedDict) and refuses everything else before calling it. Nothing named in
  the file is ever imported.

Sharded checkpoints (`*.index.json` with a `weight_map`) are followed. Tensor names come back
exactly as stored; stripping a prefix such as `model.` or `medusa_head.` is the caller's job.
"""

from __future__ import annotations

import collections
import io
import json
import pickle
import struct
import zipfile
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..errors import ModelError

SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_INDEX = "pytorch_model.bin.index.json"
SAFETENSORS_SUFFIXES = (".safetensors",)
TORCH_SUFFIXES = (".bin", ".pt", ".pth")
# Names that upstream projects give their weights, preferred when a folder holds several files.
WELL_KNOWN = ("model.safetensors", "medusa_lm_head.safetensors", "pytorch_model.bin", "medusa_lm_head.pt")
# Files a training run leaves next to the weights; they are never weights (and training_args.bin
# is a pickle of arbitrary classes, which the restricted reader would refuse anyway).
NOT_WEIGHTS_PREFIXES = ("training_args", "optimizer", "scheduler", "rng_state", "trainer_state")

# safetensors dtype name -> (numpy little-endian dtype, is bf16 stored as uint16)
_ST_DTYPES: dict[str, tuple[str, bool]] = {
    "F64": ("<f8", False), "F32": ("<f4", False), "F16": ("<f2", False), "BF16": ("<u2", True),
    "I64": ("<i8", False), "I32": ("<i4", False), "I16": ("<i2", False), "I8": ("i1", False),
    "U8": ("u1", False), "BOOL": ("?", False),
}

# torch storage class name -> (numpy dtype without byte order, is bf16)
_TORCH_STORAGES: dict[str, tuple[str, bool]] = {
    "DoubleStorage": ("f8", False), "FloatStorage": ("f4", False), "HalfStorage": ("f2", False),
    "BFloat16Storage": ("u2", True), "LongStorage": ("i8", False), "IntStorage": ("i4", False),
    "ShortStorage": ("i2", False), "CharStorage": ("i1", False), "ByteStorage": ("u1", False),
    "BoolStorage": ("?", False), "UntypedStorage": ("u1", False),
}
_TORCH_DTYPES = {"float64": "f8", "double": "f8", "float32": "f4", "float": "f4", "float16": "f2",
                 "half": "f2", "bfloat16": "u2", "int64": "i8", "long": "i8", "int32": "i4",
                 "int": "i4", "int16": "i2", "short": "i2", "int8": "i1", "uint8": "u1", "bool": "?"}


# ---------------------------------------------------------------------------------------------
# config.json


def load_config(folder: str | Path) -> dict:
    """The checkpoint's config.json as a dict; a missing or unreadable one is a ModelError."""
    path = Path(folder) / "config.json"
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ModelError(f"{path}: no config.json in the checkpoint folder") from None
    except OSError as e:
        raise ModelError(f"{path}: cannot read: {e.strerror or e}") from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise ModelError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(config, dict):
        raise ModelError(f"{path}: expected a JSON object, found {type(config).__name__}")
    return config


# ---------------------------------------------------------------------------------------------
# entry point


def load_state_dict(path: str | Path) -> dict[str, np.ndarray]:
    """All tensors of a checkpoint file or folder, by their stored names, as numpy arrays.

    `path` is a weights file (.safetensors, .bin, .pt, .pth), an `*.index.json` of a sharded
    checkpoint, or a folder holding one of those (safetensors preferred). bf16 comes back as
    float32; every other dtype as stored.
    """
    path = Path(path)
    if not path.exists():
        raise ModelError(f"{path}: no such file or folder")
    if path.is_dir():
        path = _pick_in_folder(path)
    if path.name.endswith(".index.json"):
        return _load_sharded(path)
    return _load_file(path)


def _pick_in_folder(folder: Path) -> Path:
    """The one weights file (or index) of a folder: safetensors first, then torch files."""
    for index in (SAFETENSORS_INDEX, TORCH_INDEX):
        if (folder / index).is_file():
            return folder / index
    for suffixes in (SAFETENSORS_SUFFIXES, TORCH_SUFFIXES):
        found = sorted(p for p in folder.iterdir()
                       if p.is_file() and p.suffix in suffixes and not p.name.startswith(NOT_WEIGHTS_PREFIXES))
        if len(found) == 1:
            return found[0]
        for name in WELL_KNOWN:
            if folder / name in found:
                return folder / name
        if found:
            names = ", ".join(p.name for p in found)
            raise ModelError(f"{folder}: several weight files and no index ({names}); name the file to load")
    raise ModelError(f"{folder}: no weights (*.safetensors, *.bin, *.pt or an *.index.json) in the folder")


def _load_sharded(index_path: Path) -> dict[str, np.ndarray]:
    """Every shard named by an index's weight_map, checked to hold the tensors it promises."""
    try:
        weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise ModelError(f"{index_path}: not a checkpoint index with a weight_map ({type(e).__name__})") from None
    if not isinstance(weight_map, dict):
        raise ModelError(f"{index_path}: weight_map is not an object")
    out: dict[str, np.ndarray] = {}
    for shard in sorted(set(weight_map.values())):
        shard_path = index_path.parent / shard
        if not shard_path.is_file():
            raise ModelError(f"{index_path}: shard {shard} is missing")
        for name, array in _load_file(shard_path).items():
            if name in out:
                raise ModelError(f"{shard_path}: tensor {name} is also in another shard")
            out[name] = array
    missing = [name for name in weight_map if name not in out]
    if missing:
        raise ModelError(f"{index_path}: {len(missing)} tensors listed in the index are in no shard "
                         f"(first: {missing[0]})")
    return out


def _load_file(path: Path) -> dict[str, np.ndarray]:
    """One weights file, its format told by its first bytes rather than by its name."""
    try:
        with open(path, "rb") as f:
            head = f.read(9)
    except OSError as e:
        raise ModelError(f"{path}: cannot read: {e.strerror or e}") from None
    if head[:4] == b"PK\x03\x04":
        return _load_torch_zip(path)
    if head[:1] == b"\x80":
        raise ModelError(f"{path}: a legacy (pre-1.6, non-zip) torch file; re-save it with a recent torch "
                         "or as safetensors")
    if len(head) == 9 and head[8:9] == b"{":
        return _load_safetensors(path)
    raise ModelError(f"{path}: neither safetensors nor a torch zip checkpoint")


# ---------------------------------------------------------------------------------------------
# safetensors


def _load_safetensors(path: Path) -> dict[str, np.ndarray]:
    """A safetensors file parsed by hand (see the module docstring for why)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        if header_len > size - 8 or header_len > 100_000_000:
            raise ModelError(f"{path}: safetensors header length {header_len} runs past the file")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ModelError(f"{path}: safetensors header is not valid JSON") from None
    if not isinstance(header, dict):
        raise ModelError(f"{path}: safetensors header is not an object")
    data_start = 8 + header_len
    data_len = size - data_start
    raw = np.memmap(path, dtype=np.uint8, mode="r", offset=data_start, shape=(data_len,)) if data_len else \
        np.zeros(0, np.uint8)
    out: dict[str, np.ndarray] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        out[name] = _safetensors_tensor(path, name, info, raw)
    del raw
    return out


def _safetensors_tensor(path: Path, name: str, info: Any, raw: np.ndarray) -> np.ndarray:
    """One tensor of a safetensors file, copied out of the mapping and in native byte order."""
    try:
        dtype_name, shape, (begin, end) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
    except (KeyError, TypeError, ValueError):
        raise ModelError(f"{path}: tensor {name} has a malformed header entry") from None
    if dtype_name not in _ST_DTYPES:
        raise ModelError(f"{path}: tensor {name} has dtype {dtype_name}, which edgespec cannot read")
    np_dtype, is_bf16 = _ST_DTYPES[dtype_name]
    dtype = np.dtype(np_dtype)
    count = int(np.prod(shape, dtype=np.int64))
    if not (0 <= begin <= end <= len(raw)) or end - begin != count * dtype.itemsize or min(shape, default=0) < 0:
        raise ModelError(f"{path}: tensor {name} ({dtype_name} {list(shape)}) has bytes {begin}..{end}, "
                         f"outside the file or of the wrong size")
    array = np.frombuffer(raw[begin:end], dtype=dtype, count=count).reshape(shape)
    return _to_native(array, is_bf16)


def _to_native(array: np.ndarray, is_bf16: bool) -> np.ndarray:
    """A fresh, writable, C-ordered, native-order copy; bf16 bit patterns widened to float32."""
    if is_bf16:
        return (array.astype(np.uint32, order="C") << 16).view(np.float32)
    return np.array(array, dtype=array.dtype.newbyteorder("="), order="C", copy=True)


# ---------------------------------------------------------------------------------------------
# torch zip files


class _StorageType:
    """What the unpickler hands out for `torch.FloatStorage` and friends: just a dtype."""

    __slots__ = ("dtype", "is_bf16")

    def __init__(self, dtype: str, is_bf16: bool) -> None:
        self.dtype = dtype
        self.is_bf16 = is_bf16


class _Storage:
    """One storage record of the zip, as a flat array in its stored dtype (bf16 kept as uint16)."""

    __slots__ = ("array", "is_bf16")

    def __init__(self, array: np.ndarray, is_bf16: bool) -> None:
        self.array = array
        self.is_bf16 = is_bf16


def _rebuild_tensor(storage: Any, offset: Any, size: Any, stride: Any, *_: Any) -> np.ndarray:
    """torch._utils._rebuild_tensor(_v2): a strided view of a storage, copied out contiguous."""
    if not isinstance(storage, _Storage):
        raise pickle.UnpicklingError("a tensor's storage is not a storage record")
    try:
        offset, size, stride = int(offset), tuple(int(s) for s in size), tuple(int(s) for s in stride)
    except (TypeError, ValueError):
        raise pickle.UnpicklingError("a tensor's offset, size or stride is not integers") from None
    if len(size) != len(stride) or offset < 0 or any(s < 0 for s in size) or any(s < 0 for s in stride):
        raise pickle.UnpicklingError(f"bad tensor layout: offset {offset}, size {size}, stride {stride}")
    flat = storage.array
    if 0 in size:
        view = np.empty(size, dtype=flat.dtype)
    else:
        last = offset + sum((n - 1) * s for n, s in zip(size, stride))
        if last >= len(flat):
            raise pickle.UnpicklingError(f"tensor {size} with stride {stride} at offset {offset} runs past its "
                                         f"storage of {len(flat)} elements")
        item = flat.dtype.itemsize
        view = np.lib.stride_tricks.as_strided(flat[offset:], shape=size, strides=tuple(s * item for s in stride),
                                               writeable=False)
    return _to_native(view, storage.is_bf16)


def _rebuild_parameter(data: Any, *_: Any) -> Any:
    """torch._utils._rebuild_parameter(_with_state) and nn.Parameter: the tensor itself."""
    return data


def _torch_size(dims: Any = ()) -> tuple:
    """torch.Size: a tuple."""
    return tuple(dims)


def _codecs_encode(text: Any, encoding: str = "utf-8") -> bytes:
    """_codecs.encode, which protocol-2 pickles use to spell a bytes object; text only."""
    if not isinstance(text, str) or not isinstance(encoding, str):
        raise pickle.UnpicklingError("_codecs.encode called with something other than text")
    return text.encode(encoding)


_ALLOWED: dict[tuple[str, str], Callable[..., Any] | type] = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("torch.nn.parameter", "Parameter"): _rebuild_parameter,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch", "Size"): _torch_size,
    ("_codecs", "encode"): _codecs_encode,
}


class _WeightsUnpickler(pickle.Unpickler):
    """An unpickler that can build a dict of tensors and nothing else (torch's weights_only rule).

    `find_class` never imports: it maps the handful of allowed names to local stand-ins and
    refuses the rest, so a checkpoint naming `os.system` fails before anything is called.
    Storages come from the zip through `persistent_load`, read once per key (tensors may share one).
    """

    def __init__(self, data: bytes, zf: zipfile.ZipFile, prefix: str, byteorder: str, path: Path) -> None:
        super().__init__(io.BytesIO(data))
        self._zf = zf
        self._prefix = prefix
        self._byteorder = "<" if byteorder == "little" else ">"
        self._path = path
        self._storages: dict[str, _Storage] = {}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module == "torch" and name in _TORCH_STORAGES:
            return _StorageType(*_TORCH_STORAGES[name])
        if module == "torch" and name in _TORCH_DTYPES:
            return _StorageType(_TORCH_DTYPES[name], name == "bfloat16")
        raise ModelError(f"{self._path}: refusing to unpickle {module}.{name}: a checkpoint must hold only tensors")

    def persistent_load(self, pid: Any) -> _Storage:
        if not (isinstance(pid, tuple) and len(pid) >= 5 and pid[0] in ("storage", b"storage")):
            raise pickle.UnpicklingError(f"unknown persistent id {pid!r:.60}")
        storage_type, key, _location, numel = pid[1:5]
        if not isinstance(storage_type, _StorageType):
            raise pickle.UnpicklingError("a storage whose type is not a torch storage class")
        key = key.decode("ascii") if isinstance(key, bytes) else str(key)
        if key not in self._storages:
            self._storages[key] = self._read_storage(storage_type, key, int(numel))
        return self._storages[key]

    def _read_storage(self, storage_type: _StorageType, key: str, numel: int) -> _Storage:
        record = f"{self._prefix}data/{key}"
        try:
            data = self._zf.read(record)
        except KeyError:
            raise ModelError(f"{self._path}: storage record {record} is missing from the archive") from None
        dtype = np.dtype(storage_type.dtype).newbyteorder(self._byteorder)
        if len(data) < numel * dtype.itemsize:
            raise ModelError(f"{self._path}: storage {record} has {len(data)} bytes, needs {numel * dtype.itemsize}")
        return _Storage(np.frombuffer(data, dtype=dtype, count=numel), storage_type.is_bf16)


def _load_torch_zip(path: Path) -> dict[str, np.ndarray]:
    """A torch.save zip: its data.pkl read with the restricted unpickler, then unwrapped to tensors."""
    try:
        with zipfile.ZipFile(path) as zf:
            prefix = _archive_prefix(zf, path)
            byteorder = _archive_byteorder(zf, prefix, path)
            unpickler = _WeightsUnpickler(zf.read(prefix + "data.pkl"), zf, prefix, byteorder, path)
            try:
                obj = unpickler.load()
            except ModelError:
                raise
            except Exception as e:  # a malformed pickle can fail in many ways; all mean "not a checkpoint"
                reason = (str(e).splitlines() or [""])[0][:200]
                raise ModelError(f"{path}: cannot unpickle the checkpoint: {type(e).__name__}: {reason}") from None
    except zipfile.BadZipFile as e:
        raise ModelError(f"{path}: damaged zip archive ({e})") from None
    return _tensors_of(obj, path)


def _archive_prefix(zf: zipfile.ZipFile, path: Path) -> str:
    """The folder inside the zip holding data.pkl: the file's stem when torch.save got a path, else 'archive/'."""
    names = [n for n in zf.namelist() if n == "data.pkl" or n.endswith("/data.pkl")]
    if not names:
        if any(n.endswith("constants.pkl") for n in zf.namelist()):
            raise ModelError(f"{path}: a TorchScript archive, not a state dict")
        raise ModelError(f"{path}: a zip without data.pkl, not a torch checkpoint")
    return min(names, key=len)[: -len("data.pkl")]


def _archive_byteorder(zf: zipfile.ZipFile, prefix: str, path: Path) -> str:
    """'little' or 'big' from the byteorder record; files without one are little-endian (torch's rule)."""
    try:
        mark = zf.read(prefix + "byteorder").strip()
    except KeyError:
        return "little"
    if mark not in (b"little", b"big"):
        raise ModelError(f"{path}: unknown byte order {mark[:20]!r}")
    return mark.decode()


def _tensors_of(obj: Any, path: Path) -> dict[str, np.ndarray]:
    """The tensor dict inside an unpickled object: unwrapped from {"state_dict"|"model"|"module": ...}."""
    if not isinstance(obj, dict):
        raise ModelError(f"{path}: holds a {type(obj).__name__}, not a dict of tensors")
    for wrapper in ("state_dict", "model", "module"):
        inner = obj.get(wrapper)
        if isinstance(inner, dict) and any(isinstance(v, np.ndarray) for v in inner.values()):
            obj = inner
            break
    out: dict[str, np.ndarray] = {}
    for key, value in obj.items():
        if isinstance(value, np.ndarray):
            if not isinstance(key, str):
                raise ModelError(f"{path}: a tensor is stored under a non-text key {key!r:.40}")
            out[key] = value
        elif value is None or isinstance(value, (bool, int, float, str, bytes)):
            continue  # bookkeeping such as an epoch number or a version string
        else:
            raise ModelError(f"{path}: entry {key!r:.60} is a {type(value).__name__}, not a tensor")
    return out
