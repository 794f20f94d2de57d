"""A GGUF file checked with ggml's own GGUF parser before llama.cpp loads it.

llama.cpp reports a truncated or damaged file as one vague log line (or not at all); this check
names what is wrong: a header cut short, tensor data past the end of the file, no vocabulary.
It also gives the whole token list, so a draft model's vocabulary is compared with the target's
token by token.

Why ggml's parser (`gguf_init_from_file` in libggml-base, shipped inside llama-cpp-python, bound
here with ctypes) and not the `gguf` package's GGUFReader: the reader walks every array element
in Python and took 4.5 s on SmolLM2's header and 21 s on Gemma 3's (262,144 tokens) here, on
every load; ggml's parser is the one llama.cpp then uses, and reads the same headers in
milliseconds. The `gguf` package writes the synthetic files of the tests.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from .errors import ModelError, VocabMismatchError

GGUF_MAGIC = b"GGUF"
TOKENS_KEY = "tokenizer.ggml.tokens"


class _InitParams(ctypes.Structure):
    _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", ctypes.c_void_p)]


_lib = None


def _ggml():
    """libggml-base from llama-cpp-python's own folder, with the gguf_* signatures we use."""
    global _lib
    if _lib is None:
        import llama_cpp

        from .llama_init import backend_init

        backend_init()  # ggml's messages go to llama.cpp's log callback, not the terminal
        folder = os.path.join(os.path.dirname(llama_cpp.__file__), "lib")
        names = sorted(glob.glob(os.path.join(folder, "*ggml-base*")), key=len)
        if not names:
            raise ModelError(f"cannot find libggml-base in {folder} (a broken llama-cpp-python install?)")
        lib = ctypes.CDLL(names[0])
        c, i64, sz, p = ctypes.c_char_p, ctypes.c_int64, ctypes.c_size_t, ctypes.c_void_p
        for name, res, args in [
            ("gguf_init_from_file", p, [c, _InitParams]), ("gguf_free", None, [p]),
            ("gguf_get_data_offset", sz, [p]), ("gguf_get_n_tensors", i64, [p]),
            ("gguf_get_tensor_offset", sz, [p, i64]), ("gguf_get_tensor_size", sz, [p, i64]),
            ("gguf_get_tensor_name", c, [p, i64]), ("gguf_find_key", i64, [p, c]),
            ("gguf_get_arr_n", sz, [p, i64]), ("gguf_get_arr_str", c, [p, i64, sz]),
            ("gguf_get_val_str", c, [p, i64]), ("gguf_find_tensor", i64, [p, c]),
            ("gguf_get_tensor_type", ctypes.c_int, [p, i64]),
            ("ggml_type_size", sz, [ctypes.c_int]), ("ggml_blck_size", i64, [ctypes.c_int]),
        ]:
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = res, args
        _lib = lib
    return _lib


@dataclass(frozen=True)
class GGUFInfo:
    path: Path | None
    arch: str
    n_tensors: int
    n_tokens: int  # vocabulary size (0: the file has none)
    _tokens: list = field(default_factory=list, compare=False, repr=False)
    types: frozenset = frozenset()  # the ggml types of its tensors (GGML_TYPE_* numbers)
    n_params: int = 0  # weights in its tensors (this file's, for a split GGUF's first part)

    @property
    def tokens(self) -> tuple[bytes, ...]:
        """The vocabulary as stored, read on first use (a draft model's check needs it)."""
        if not self._tokens and self.n_tokens:
            self._tokens.append(_read_tokens(self.path))
        return self._tokens[0] if self._tokens else ()


_cache: dict[tuple, GGUFInfo] = {}


def check_file(path: str | os.PathLike) -> Path:
    """Fail with one clear line if `path` is not a readable GGUF file (exists, not a folder,
    starts with the GGUF magic)."""
    p = Path(path)
    if not p.exists():
        raise ModelError(f"model file not found: {p}")
    if p.is_dir():
        raise ModelError(f"model path is a directory, not a .gguf file: {p}")
    try:
        with p.open("rb") as f:
            head = f.read(4)
    except OSError as e:
        raise ModelError(f"cannot read model file {p}: {e.strerror}") from None
    if head != GGUF_MAGIC:
        raise ModelError(f"not a GGUF file (bad magic {head!r}): {p}")
    return p


def inspect(path: str | os.PathLike, need_vocab: bool = True) -> GGUFInfo:
    """Read the header, metadata and tensor table; check that every tensor's data lies inside
    the file and (with `need_vocab`) that there is a vocabulary. Cached per file version."""
    p = check_file(path)
    st = p.stat()
    key = (str(p.resolve()), st.st_size, st.st_mtime_ns)
    info = _cache.get(key)
    if info is None:
        info = _cache[key] = _read(p, st.st_size)
    if need_vocab and not info.n_tokens:
        raise ModelError(f"{p} has no vocabulary ({TOKENS_KEY} is missing): not a model llama.cpp can run")
    return info


def _open(p: Path):
    """ggml's parser on `p`: (its context or None, what it printed). ggml's GGUF reader writes
    its complaints straight to stderr; they are caught here and go into our one-line error."""
    lib = _ggml()
    with tempfile.TemporaryFile() as tmp:
        try:
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 - a front end's stand-in for stderr (Textual) may not flush
            pass
        saved = os.dup(2)
        os.dup2(tmp.fileno(), 2)
        try:
            ctx = lib.gguf_init_from_file(str(p).encode(), _InitParams(True, None))
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        tmp.seek(0)
        said = tmp.read().decode("utf-8", "replace").strip()
    return ctx, said


def _read(p: Path, size: int) -> GGUFInfo:
    lib = _ggml()
    ctx, said = _open(p)
    if not ctx:
        detail = said.splitlines()[-1] if said else "ggml could not parse its header"
        raise ModelError(f"cannot load model {p}: truncated or corrupt GGUF header ({detail})")
    try:
        base = lib.gguf_get_data_offset(ctx)
        n = lib.gguf_get_n_tensors(ctx)
        types = frozenset(lib.gguf_get_tensor_type(ctx, t) for t in range(n))
        n_params = 0
        for t in range(n):
            ty = lib.gguf_get_tensor_type(ctx, t)
            n_params += lib.gguf_get_tensor_size(ctx, t) * lib.ggml_blck_size(ty) // max(1, lib.ggml_type_size(ty))
            end = base + lib.gguf_get_tensor_offset(ctx, t) + lib.gguf_get_tensor_size(ctx, t)
            if end > size:
                name = lib.gguf_get_tensor_name(ctx, t).decode("utf-8", "replace")
                raise ModelError(f"cannot load model {p}: truncated or corrupt (tensor {name} ends at byte {end}, "
                                 f"the file has {size}; download or copy it again)")
        k = lib.gguf_find_key(ctx, b"general.architecture")
        arch = lib.gguf_get_val_str(ctx, k).decode("utf-8", "replace") if k >= 0 else "?"
        k = lib.gguf_find_key(ctx, TOKENS_KEY.encode())
        n_tokens = lib.gguf_get_arr_n(ctx, k) if k >= 0 else 0
        return GGUFInfo(p, arch, n, n_tokens, types=types, n_params=n_params)
    finally:
        lib.gguf_free(ctx)


_META_TYPES = {4: "gguf_get_val_u32", 5: "gguf_get_val_i32", 6: "gguf_get_val_f32", 7: "gguf_get_val_bool"}


_meta_cache: dict[tuple, dict] = {}


def read_meta(path: str | os.PathLike, prefixes: tuple[str, ...]) -> dict:
    """The string, integer, float and bool values of the keys that start with one of `prefixes`
    (arrays are left out), read with ggml's parser in milliseconds; cached per file version (a
    server's drafter for each request reads its heads' metadata from here, not from disk)."""
    p = check_file(path)
    st = p.stat()
    key = (str(p.resolve()), st.st_size, st.st_mtime_ns, tuple(prefixes))
    if key not in _meta_cache:
        _meta_cache[key] = _read_meta(p, tuple(prefixes))
    return dict(_meta_cache[key])


def _read_meta(p: Path, prefixes: tuple[str, ...]) -> dict:
    lib = _ggml()
    if not hasattr(lib, "_meta_bound"):
        i64, vp = ctypes.c_int64, ctypes.c_void_p
        for name, res, args in (("gguf_get_n_kv", i64, [vp]), ("gguf_get_key", ctypes.c_char_p, [vp, i64]),
                                ("gguf_get_kv_type", ctypes.c_int, [vp, i64]),
                                ("gguf_get_val_u32", ctypes.c_uint32, [vp, i64]),
                                ("gguf_get_val_i32", ctypes.c_int32, [vp, i64]),
                                ("gguf_get_val_f32", ctypes.c_float, [vp, i64]),
                                ("gguf_get_val_bool", ctypes.c_bool, [vp, i64])):
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = res, args
        lib._meta_bound = True
    ctx, said = _open(p)
    if not ctx:
        raise ModelError(f"cannot read {p}: {said.splitlines()[-1] if said else 'not a GGUF header'}")
    try:
        out: dict = {}
        for k in range(lib.gguf_get_n_kv(ctx)):
            key = lib.gguf_get_key(ctx, k).decode("utf-8", "replace")
            if not key.startswith(prefixes):
                continue
            t = lib.gguf_get_kv_type(ctx, k)
            if t == 8:  # GGUF_TYPE_STRING
                out[key] = lib.gguf_get_val_str(ctx, k).decode("utf-8", "replace")
            elif t in _META_TYPES:
                out[key] = getattr(lib, _META_TYPES[t])(ctx, k)
        return out
    finally:
        lib.gguf_free(ctx)


def _read_tokens(p: Path) -> tuple[bytes, ...]:
    lib = _ggml()
    ctx, _ = _open(p)
    if not ctx:
        raise ModelError(f"cannot read the vocabulary of {p}")
    try:
        k = lib.gguf_find_key(ctx, TOKENS_KEY.encode())
        get = lib.gguf_get_arr_str
        return tuple(get(ctx, k, i) for i in range(lib.gguf_get_arr_n(ctx, k)))
    finally:
        lib.gguf_free(ctx)


@dataclass(frozen=True)
class TensorLocation:
    """Where one tensor's bytes lie in a GGUF file, and their ggml type."""

    offset: int  # from the start of the file
    nbytes: int
    ggml_type: int


def tensor_location(path: str | os.PathLike, name: str) -> TensorLocation | None:
    """The location of tensor `name` in `path`, or None when the file has no such tensor."""
    lib = _ggml()
    p = check_file(path)
    ctx, _ = _open(p)
    if not ctx:
        raise ModelError(f"cannot read the tensor table of {p}")
    try:
        t = lib.gguf_find_tensor(ctx, name.encode())
        if t < 0:
            return None
        return TensorLocation(lib.gguf_get_data_offset(ctx) + lib.gguf_get_tensor_offset(ctx, t),
                              lib.gguf_get_tensor_size(ctx, t), lib.gguf_get_tensor_type(ctx, t))
    finally:
        lib.gguf_free(ctx)


def vocab_fingerprint(info: GGUFInfo) -> str:
    """A short hash of the whole token list: heads record the tokenizer they were made for."""
    import hashlib

    h = hashlib.sha256()
    for t in info.tokens:
        h.update(len(t).to_bytes(4, "little"))
        h.update(t)
    return h.hexdigest()[:16]


def compare_vocab(target: GGUFInfo, draft: GGUFInfo) -> None:
    """Raise naming the first token that differs between two vocabularies (all of them compared)."""
    if target.n_tokens != draft.n_tokens:
        raise VocabMismatchError(f"draft vocabulary differs from target: {draft.n_tokens} tokens ({draft.arch}) vs "
                                 f"{target.n_tokens} ({target.arch})")
    a, b = target.tokens, draft.tokens
    if a == b:
        return
    if len(a) != len(b):
        raise VocabMismatchError(f"draft vocabulary differs from target: {len(b)} tokens ({draft.arch}) vs "
                                 f"{len(a)} ({target.arch})")
    i = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    raise VocabMismatchError(f"draft vocabulary differs from target at token {i}: "
                             f"{b[i].decode('utf-8', 'replace')!r} vs {a[i].decode('utf-8', 'replace')!r}")
