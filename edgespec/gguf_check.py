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

ggml's parser checks a file's layout but not what a key's value means: `gguf_get_val_str` on a
value that is not a string (an architecture stored as a number) or `gguf_get_arr_str` on an array
of numbers trips a `GGML_ASSERT`, which aborts the whole process. Every value is read here only
after its type is checked (`_kv_type`), so a hostile file is one `ModelError`, never an abort:
`edgespec models` and `auto`'s draft search read files the user never named. Only regular files
are opened (`file_problem`): a FIFO named `*.gguf` would block the reader forever.
"""

from __future__ import annotations

import ctypes
import errno
import glob
import os
import stat
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from .errors import ModelError, VocabMismatchError

GGUF_MAGIC = b"GGUF"
TOKENS_KEY = "tokenizer.ggml.tokens"
ARCH_KEY = "general.architecture"
# enum gguf_type (ggml/include/gguf.h)
GGUF_TYPES = ("uint8", "int8", "uint16", "int16", "uint32", "int32", "float32", "bool", "string", "array",
              "uint64", "int64", "float64")
GGUF_TYPE_INT32, GGUF_TYPE_FLOAT32, GGUF_TYPE_STRING, GGUF_TYPE_ARRAY = 5, 6, 8, 9
# (key, element type, one per token) of the arrays llama.cpp's vocabulary loader reads unchecked
_VOCAB_ARRAYS = (("tokenizer.ggml.scores", GGUF_TYPE_FLOAT32, True),
                 ("tokenizer.ggml.token_type", GGUF_TYPE_INT32, True),
                 ("tokenizer.ggml.merges", GGUF_TYPE_STRING, False))


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
            ("gguf_get_kv_type", ctypes.c_int, [p, i64]), ("gguf_get_arr_type", ctypes.c_int, [p, i64]),
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


def file_problem(path: str | os.PathLike) -> str | None:
    """What keeps `path` from being read as a model file, in a few words (not found, a symlink
    loop, a folder, not a regular file, empty), else None. Never blocks and never raises."""
    try:
        st = os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "a symlink loop"
        if e.errno in (errno.ENOENT, errno.ENOTDIR):
            return "not found"
        return f"cannot read it ({e.strerror})"
    except ValueError:  # a NUL byte in the name
        return "not found"
    if stat.S_ISDIR(st.st_mode):
        return "a directory, not a .gguf file"
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file (a FIFO, socket or device)"
    if st.st_size == 0:
        return "an empty file"
    return None


def check_file(path: str | os.PathLike) -> Path:
    """Fail with one clear line if `path` is not a readable GGUF file (a regular file, not
    empty, starting with the GGUF magic). It is opened without blocking and checked to be a
    regular file again once open, so a FIFO swapped in meanwhile cannot hang the reader."""
    p = Path(path)
    problem = file_problem(p)
    if problem == "not found":
        raise ModelError(f"model file not found: {p}")
    if problem is not None:
        raise ModelError(f"cannot use model file {p}: {problem}")
    try:
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    except OSError as e:
        raise ModelError(f"cannot read model file {p}: {e.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ModelError(f"cannot use model file {p}: not a regular file (a FIFO, socket or device)")
        head = os.read(fd, 4)
    except OSError as e:
        raise ModelError(f"cannot read model file {p}: {e.strerror}") from None
    finally:
        os.close(fd)
    if head != GGUF_MAGIC:
        raise ModelError(f"not a GGUF file (bad magic {head!r}): {p}")
    return p


def _file_key(p: Path, *extra) -> tuple:
    """A cache key for one version of a checked file (a link's target, by its real path)."""
    st = p.stat()
    try:
        real = str(p.resolve())
    except (OSError, RuntimeError):  # a loop made since the check: the path as given
        real = str(p)
    return (real, st.st_size, st.st_mtime_ns, *extra)


def inspect(path: str | os.PathLike, need_vocab: bool = True) -> GGUFInfo:
    """Read the header, metadata and tensor table; check that every tensor's data lies inside
    the file and (with `need_vocab`) that there is a vocabulary. Cached per file version."""
    p = check_file(path)
    key = _file_key(p)
    info = _cache.get(key)
    if info is None:
        info = _cache[key] = _read(p, key[1])
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
        arch = _string(lib, ctx, p, ARCH_KEY)
        k = _key(lib, ctx, p, TOKENS_KEY, GGUF_TYPE_ARRAY, GGUF_TYPE_STRING)
        n_tokens = lib.gguf_get_arr_n(ctx, k) if k >= 0 else 0
        # llama.cpp's vocabulary loader reads these raw (gguf_get_arr_data, gguf_get_arr_str): checked
        # here so that a file the user names is one line, not an assert or a read past an array
        for name, elem, per_token in _VOCAB_ARRAYS:
            k = _key(lib, ctx, p, name, GGUF_TYPE_ARRAY, elem)
            if k >= 0 and per_token and lib.gguf_get_arr_n(ctx, k) < n_tokens:
                raise ModelError(f"cannot load model {p}: its {name} has {lib.gguf_get_arr_n(ctx, k)} entries for "
                                 f"{n_tokens} tokens (a damaged or hand-made GGUF)")
        return GGUFInfo(p, "?" if arch is None else arch, n, n_tokens, types=types, n_params=n_params)
    finally:
        lib.gguf_free(ctx)


def _type_name(t: int) -> str:
    return GGUF_TYPES[t] if 0 <= t < len(GGUF_TYPES) else f"type {t}"


def _key(lib, ctx, p: Path, name: str, kind: int, elem: int | None = None) -> int:
    """The id of key `name` (-1: absent), checked to hold a value of type `kind` (an array:
    of `elem`) before anything reads it: ggml asserts, and aborts, on a read of the wrong type."""
    k = lib.gguf_find_key(ctx, name.encode())
    if k < 0:
        return k
    t = lib.gguf_get_kv_type(ctx, k)
    if t != kind or (t == GGUF_TYPE_ARRAY and elem is not None and lib.gguf_get_arr_type(ctx, k) != elem):
        got = _type_name(t) + (f" of {_type_name(lib.gguf_get_arr_type(ctx, k))}" if t == GGUF_TYPE_ARRAY else "")
        want = _type_name(kind) + (f" of {_type_name(elem)}" if elem is not None else "")
        raise ModelError(f"cannot load model {p}: its {name} is a {got}, not a {want} (a damaged or hand-made GGUF)")
    return k


def _string(lib, ctx, p: Path, name: str) -> str | None:
    k = _key(lib, ctx, p, name, GGUF_TYPE_STRING)
    return None if k < 0 else lib.gguf_get_val_str(ctx, k).decode("utf-8", "replace")


_META_TYPES = {4: "gguf_get_val_u32", 5: "gguf_get_val_i32", 6: "gguf_get_val_f32", 7: "gguf_get_val_bool"}


_meta_cache: dict[tuple, dict] = {}


def read_meta(path: str | os.PathLike, prefixes: tuple[str, ...]) -> dict:
    """The string, integer, float and bool values of the keys that start with one of `prefixes`
    (arrays are left out), read with ggml's parser in milliseconds; cached per file version (a
    server's drafter for each request reads its heads' metadata from here, not from disk)."""
    p = check_file(path)
    key = _file_key(p, tuple(prefixes))
    if key not in _meta_cache:
        _meta_cache[key] = _read_meta(p, tuple(prefixes))
    return dict(_meta_cache[key])


def _read_meta(p: Path, prefixes: tuple[str, ...]) -> dict:
    lib = _ggml()
    if not hasattr(lib, "_meta_bound"):
        i64, vp = ctypes.c_int64, ctypes.c_void_p
        for name, res, args in (("gguf_get_n_kv", i64, [vp]), ("gguf_get_key", ctypes.c_char_p, [vp, i64]),
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
            if t == GGUF_TYPE_STRING:
                out[key] = lib.gguf_get_val_str(ctx, k).decode("utf-8", "replace")
            elif t in _META_TYPES:
                out[key] = getattr(lib, _META_TYPES[t])(ctx, k)
        return out
    finally:
        lib.gguf_free(ctx)


def _read_tokens(p: Path) -> tuple[bytes, ...]:
    lib = _ggml()
    check_file(p)
    ctx, _ = _open(p)
    if not ctx:
        raise ModelError(f"cannot read the vocabulary of {p}")
    try:
        k = _key(lib, ctx, p, TOKENS_KEY, GGUF_TYPE_ARRAY, GGUF_TYPE_STRING)
        if k < 0:
            return ()
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
