"""A thin layer over llama-cpp-python's low-level C API: models, contexts, batches, logits.

Nothing here decides what to draft or accept. Only `kv.KVSeq` calls the memory (KV cache)
operations defined at the bottom of `Context`.
"""

from __future__ import annotations

import ctypes
import os
import re
from dataclasses import dataclass

import numpy as np

from .errors import ContextFullError, EdgespecError, ModelError
from .gguf_check import inspect
from .llama_init import _LOG, backend_init  # noqa: F401 (backend_init re-exported)
from .kvtypes import DEFAULT_KV, KV_TYPES, kv_paths_agree, kv_spec, kv_types  # noqa: F401 (re-exported)
from .quants import QUANT_TYPES

import llama_cpp as lc  # noqa: E402  (imports after our own modules on purpose: it prints nothing)

# llama_get_logits_ith returning the row's address as an int: the binding's own returns a float
# pointer, which costs a cast to an address on every call (a step reads its logits right after a
# decode, when all of this is cold: the cast and a new numpy view took ~36 us of a ~9 ms step)
_logits_addr = lc.llama_cpp._lib["llama_get_logits_ith"]
_logits_addr.argtypes = [ctypes.c_void_p, ctypes.c_int32]
_logits_addr.restype = ctypes.c_void_p


# ggml types whose CPU matrix product takes other kernels for a batch than for one row (x86, this
# build; docs/exactness.md): the tiled K-quant kernel from 8 rows (ggml-cpu/tiled/tiled.cpp:
# Q2_K-Q6_K, IQ1-IQ4_XS) and the repacked Q4_K GEMM from 4 rows (ggml-cpu/repack.cpp).
BATCH_DEPENDENT_TYPES = frozenset({10, 11, 12, 13, 14, 16, 17, 18, 19, 21, 22, 23, 29})
TILED_ENV = "GGML_CPU_TILED_MM"


def batch_dependent(path: str | os.PathLike) -> bool:
    """Whether the model holds weights that llama.cpp's CPU backend multiplies with other kernels
    in a batch than for one row (so batched verification differs from plain decoding)."""
    return bool(inspect(path).types & BATCH_DEPENDENT_TYPES)


def use_exact_kernels() -> bool:
    """Ask the CPU backend for the per-row dot-product kernel at every batch size for K-quants
    (GGML_CPU_TILED_MM=0: the tiled kernel off). llama.cpp reads it once per process, at its first
    K-quant-capable matrix product, so it holds only if set before that; a value the user set is
    kept. Returns whether the tiled kernel is off as asked (the exactness probe has the last word)."""
    os.environ.setdefault(TILED_ENV, "0")
    return os.environ[TILED_ENV] == "0"


def kernel_tag(model: "Model") -> str:
    """What sets the CPU kernels of this model apart, for the cost cache's key: which ggml-cpu is
    loaded (edgespec's batch-invariant build or the stock one) with the settings of its arithmetic
    (kernels.tag), and repacking."""
    from . import kernels

    return kernels.tag() + ("" if model.repack else "|norepack")


def last_log_error() -> str:
    """The most recent llama.cpp log line that looks like an error, for user-facing messages."""
    for line in reversed(_LOG):
        s = line.strip()
        if s and ("error" in s.lower() or "failed" in s.lower() or "invalid" in s.lower()):
            return s
    return ""


class Model:
    """A loaded GGUF model and its vocabulary."""

    def __init__(self, path: str | os.PathLike, n_gpu_layers: int = 0, load_mtp: bool = False,
                 devices: list[int] | None = None, repack: bool = True):
        """`load_mtp`: also load the model's nextn (MTP) layers, for an MTP draft context;
        `devices`: ggml devices to offload layers to (None: all; [] none, the CPU only);
        `repack`: let the CPU backend repack weights into its interleaved layout (llama.cpp's
        `use_extra_bufts`), whose kernels for 4 rows and more differ from one row's."""
        backend_init()
        self.info = inspect(path)  # a damaged file gets a clear line before llama.cpp sees it
        self.path = self.info.path
        params = lc.llama_model_default_params()
        params.n_gpu_layers = int(n_gpu_layers)
        params.load_mtp = bool(load_mtp)
        params.use_extra_bufts = bool(repack)
        self.load_mtp = bool(load_mtp)
        self.repack = bool(repack)
        if devices is not None:  # the devices to offload to (else every one llama.cpp knows)
            arr = (ctypes.c_void_p * (len(devices) + 1))(*devices, None)
            params.devices = ctypes.cast(arr, ctypes.c_void_p)
        _LOG.clear()
        ptr = lc.llama_model_load_from_file(str(self.path).encode(), params)
        if not ptr:
            detail = last_log_error() or "llama.cpp could not load it"
            raise ModelError(f"cannot load model {self.path} (truncated or corrupt?): {detail}")
        self.ptr = ptr
        self.vocab = lc.llama_model_get_vocab(ptr)
        self.n_vocab = int(lc.llama_vocab_n_tokens(self.vocab))
        self.n_ctx_train = int(lc.llama_model_n_ctx_train(ptr))
        self.n_layer = int(lc.llama_model_n_layer(ptr))
        self.n_embd = int(lc.llama_model_n_embd(ptr))
        self.n_layer_nextn = int(lc.llama_model_n_layer_nextn(ptr))  # MTP layers (counted when loaded)
        self.bos = int(lc.llama_vocab_bos(self.vocab))
        self.eos = int(lc.llama_vocab_eos(self.vocab))
        self.add_bos = bool(lc.llama_vocab_get_add_bos(self.vocab))
        self.vocab_type = int(lc.llama_vocab_type(self.vocab))
        self._eog: dict[int, bool] = {}
        self._pieces: dict[int, bytes] = {}
        self._control: tuple | None = None
        self._longest: int | None = None
        buf = ctypes.create_string_buffer(256)
        n = lc.llama_model_desc(ptr, buf, 256)
        self.desc = buf.value[: max(n, 0)].decode("utf-8", "replace")

    # -- metadata -------------------------------------------------------------------------

    def meta(self, key: str) -> str | None:
        size = 1 << 16
        while True:
            buf = ctypes.create_string_buffer(size)
            n = lc.llama_model_meta_val_str(self.ptr, key.encode(), buf, size)
            if n < 0:
                return None
            if n < size:
                return buf.raw[:n].decode("utf-8", "replace")
            size = n + 1

    @property
    def fim_tokens(self) -> tuple[int, int, int] | None:
        """The fill-in-the-middle tokens (prefix, suffix, middle) llama.cpp found in the
        vocabulary (`<|fim_prefix|>`, `<fim_prefix>`, ...), or None."""
        ids = (lc.llama_vocab_fim_pre(self.vocab), lc.llama_vocab_fim_suf(self.vocab), lc.llama_vocab_fim_mid(self.vocab))
        return tuple(int(i) for i in ids) if all(i >= 0 for i in ids) else None

    @property
    def chat_template(self) -> str | None:
        return self.meta("tokenizer.chat_template")

    @property
    def arch(self) -> str:
        return self.meta("general.architecture") or "?"

    # -- vocabulary -----------------------------------------------------------------------

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        data = text.encode("utf-8")
        n_max = len(data) + 8
        arr = (lc.llama_token * n_max)()
        n = lc.llama_tokenize(self.vocab, data, len(data), arr, n_max, add_special, parse_special)
        if n < 0:
            n_max = -n
            arr = (lc.llama_token * n_max)()
            n = lc.llama_tokenize(self.vocab, data, len(data), arr, n_max, add_special, parse_special)
        return list(arr[:n])

    @property
    def control_tokens(self) -> tuple[re.Pattern | None, dict[str, int]]:
        """The texts of the tokens that only special parsing makes (control and unknown tokens,
        e.g. `<|im_start|>`) as one pattern, longest first as llama.cpp matches them, and each
        text's id. Found once, on first use (one attribute call per token of the vocabulary)."""
        if self._control is None:
            kinds = lc.LLAMA_TOKEN_ATTR_CONTROL | lc.LLAMA_TOKEN_ATTR_UNKNOWN
            ids: dict[str, int] = {}
            for t in range(self.n_vocab):
                if lc.llama_vocab_get_attr(self.vocab, t) & kinds:
                    text = self.token_text(t)
                    if text and text not in ids:
                        ids[text] = t
            texts = sorted(ids, key=len, reverse=True)
            self._control = (re.compile("|".join(map(re.escape, texts))) if texts else None, ids)
        return self._control

    @property
    def longest_piece(self) -> int:
        """The most bytes of text one token stands for (a text of B bytes is at least B / this
        many tokens long)."""
        if self._longest is None:
            self._longest = max(1, max(len(self.piece(t)) for t in range(self.n_vocab)))
        return self._longest

    def has_control_text(self, text: str) -> bool:
        """Whether special parsing would read a control token in `text`."""
        pattern = self.control_tokens[0]
        return pattern is not None and pattern.search(text) is not None

    def tokenize_parts(self, parts: list[tuple[str, bool]]) -> list[int]:
        """Tokens of a prompt given as parts `(text, trusted)`: control tokens are read only in
        trusted text (a chat template's own); the rest is text, whatever it holds. Text between
        two control tokens is tokenized as one piece, as llama.cpp's special parsing does, so a
        prompt whose control tokens all come from trusted parts gets the same tokens as
        `tokenize(whole, parse_special=True)`."""
        pattern, ids = self.control_tokens
        frags: list[str | int] = [""]
        for text, trusted in parts:
            pos = 0
            if trusted and pattern is not None:
                for m in pattern.finditer(text):
                    frags[-1] += text[pos:m.start()]
                    frags += [ids[m.group()], ""]
                    pos = m.end()
            frags[-1] += text[pos:]
        out: list[int] = []
        for f in frags:
            if isinstance(f, int):
                out.append(f)
            elif f:
                out += self.tokenize(f, add_special=False, parse_special=False)
        return out

    def piece(self, token: int, special: bool = False) -> bytes:
        key = token if not special else -1 - token
        cached = self._pieces.get(key)
        if cached is not None:
            return cached
        buf = ctypes.create_string_buffer(64)
        n = lc.llama_token_to_piece(self.vocab, token, buf, 64, 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = lc.llama_token_to_piece(self.vocab, token, buf, -n, 0, special)
        out = buf.raw[:n]
        self._pieces[key] = out
        return out

    def detokenize(self, tokens: list[int], special: bool = False) -> str:
        return b"".join(self.piece(t, special) for t in tokens).decode("utf-8", "replace")

    def token_text(self, token: int) -> str:
        raw = lc.llama_vocab_get_text(self.vocab, token)
        return raw.decode("utf-8", "replace") if raw else ""

    def is_eog(self, token: int) -> bool:
        v = self._eog.get(token)
        if v is None:
            v = self._eog[token] = bool(lc.llama_vocab_is_eog(self.vocab, token))
        return v

    def close(self) -> None:
        if getattr(self, "ptr", None):
            lc.llama_model_free(self.ptr)
            self.ptr = None

    def __del__(self) -> None:  # pragma: no cover - interpreter shutdown order varies
        try:
            self.close()
        except Exception:
            pass


@dataclass(frozen=True)
class ContextConfig:
    n_ctx: int = 4096
    n_batch: int = 512
    n_threads: int = 0  # 0: all cores
    n_seq_max: int = 16  # tree drafts use one sequence id per branch
    kv_type: str = "q8_0/f16"  # K type, or K/V types (see KV_TYPES, kv_types)
    # One cache shared by all sequence ids (tree branches need it), or one stream of n_ctx/n_seq_max
    # cells per sequence (batch decoding: a sequence's cells then stay in position order, which
    # keeps its logits bit-identical to decoding it alone). None: unified when n_seq_max > 1.
    unified: bool | None = None
    ctx_type: int = 0  # llama_context_type: 0 the model's own graph, LLAMA_CONTEXT_TYPE_MTP its nextn layers
    other: int | None = None  # llama_context* a draft context reads (EAGLE-3: the target's), as an address


def default_threads() -> int:
    return max(1, min(os.cpu_count() or 1, 8))


class Context:
    """One llama.cpp context with one reusable batch. Used by one thread at a time."""

    def __init__(self, model: Model, cfg: ContextConfig):
        self.model = model
        self.cfg = cfg
        p = lc.llama_context_default_params()
        n_ctx = min(cfg.n_ctx, model.n_ctx_train) if model.n_ctx_train > 0 else cfg.n_ctx
        p.n_ctx = n_ctx
        p.n_batch = cfg.n_batch
        p.n_ubatch = cfg.n_batch
        p.n_seq_max = cfg.n_seq_max
        threads = cfg.n_threads or default_threads()
        p.n_threads = threads
        p.n_threads_batch = threads
        p.no_perf = True
        k_type, v_type = kv_types(cfg.kv_type)
        p.type_k, p.type_v = KV_TYPES[k_type], KV_TYPES[v_type]
        # Rollback needs the whole sliding-window cache (Gemma 3): a pruned window cannot be undone.
        p.swa_full = True
        # Tree branches share the prompt's cells; one unified cache makes that a metadata copy.
        p.kv_unified = cfg.n_seq_max > 1 if cfg.unified is None else cfg.unified
        p.ctx_type = cfg.ctx_type
        if cfg.other is not None:
            p.ctx_other = ctypes.c_void_p(cfg.other)
        ctx = lc.llama_init_from_model(model.ptr, p)
        if not ctx:
            raise ModelError(f"cannot create a llama.cpp context for {model.path}: {last_log_error()}")
        self.ptr = ctx
        self.n_ctx = int(lc.llama_n_ctx(ctx))
        # cells one sequence can use: all of them in a unified cache, its own stream's otherwise
        self.n_ctx_seq = self.n_ctx if p.kv_unified else self.n_ctx // max(1, cfg.n_seq_max)
        self.n_batch = int(lc.llama_n_batch(ctx))  # llama.cpp clamps it to the context size
        self.n_threads = threads
        self.mem = lc.llama_get_memory(ctx)
        self._batch = lc.llama_batch_init(self.n_batch, 0, cfg.n_seq_max)
        self._row_type = ctypes.c_float * model.n_vocab
        self._views: dict[int, np.ndarray] = {}  # logits row address -> a view of it

    def decode(
        self,
        tokens: list[int],
        positions: list[int],
        seq_ids: list[tuple[int, ...]] | None,
        outputs: list[bool],
    ) -> None:
        """One llama_decode. `seq_ids=None` puts every row in sequence 0."""
        n = len(tokens)
        if n == 0:
            return
        if n > self.n_batch:
            raise ValueError(f"batch of {n} rows exceeds n_batch={self.n_batch}")
        b = self._batch
        b.n_tokens = n
        tok, pos, nseq, sid, lg = b.token, b.pos, b.n_seq_id, b.seq_id, b.logits
        for i in range(n):
            tok[i] = tokens[i]
            pos[i] = positions[i]
            lg[i] = outputs[i]
            if seq_ids is None:
                nseq[i] = 1
                sid[i][0] = 0
            else:
                ids = seq_ids[i]
                nseq[i] = len(ids)
                row = sid[i]
                for j, s in enumerate(ids):
                    row[j] = s
        rc = lc.llama_decode(self.ptr, b)
        if rc == 1:
            raise ContextFullError(
                f"context full: no room for {n} more tokens in a context of {self.n_ctx} (raise -c)"
            )
        if rc != 0:
            raise EdgespecError(f"llama_decode failed with code {rc}: {last_log_error()}")
        # On asynchronous backends (a GPU, llama.cpp's RPC) llama_decode returns once the graph
        # is queued; wait for it here, so that every decode's time is its own (the cost curve,
        # its online correction, the stats) and not charged to whatever reads the outputs next.
        # A no-op on the CPU, where the compute is done when llama_decode returns.
        lc.llama_synchronize(self.ptr)

    def logits(self, i: int) -> np.ndarray:
        """A view of the logits of output row `i` of the last decode (valid until the next one)."""
        addr = _logits_addr(self.ptr, i)
        if not addr:
            raise EdgespecError(f"internal: no logits for batch row {i}")
        # The rows live in one buffer that llama.cpp reallocates only to hold more outputs, so the
        # same few addresses come back step after step: their views are kept (an address it
        # returns is a whole row of the current buffer, so a kept view of it is valid now too).
        v = self._views.get(addr)
        if v is None:
            if len(self._views) >= 4096:
                self._views.clear()
            v = self._views[addr] = np.frombuffer(self._row_type.from_address(addr), dtype=np.float32)
        return v

    def set_embeddings(self, on: bool) -> None:
        """Also output the post-norm hidden state of every output row (heads draft from it);
        the logits are unchanged."""
        if on != getattr(self, "_embeddings", False):
            lc.llama_set_embeddings(self.ptr, on)
            self._embeddings = on

    @property
    def embeddings(self) -> bool:
        """Whether hidden states are output beside the logits (set_embeddings)."""
        return getattr(self, "_embeddings", False)

    def set_hidden_taps(self, layers: tuple[int, ...] | None) -> None:
        """With `layers`, `hidden` gives the inputs of those layers (EAGLE-3's taps), concatenated,
        instead of the post-norm output; None goes back to the output. Set before decoding."""
        from . import llama_ext

        old = getattr(self, "_taps", None)
        if layers == old:
            return
        for lid in old or ():
            llama_ext.fn("set_embeddings_layer_inp")(self.ptr, lid, False)
        for lid in layers or ():
            if not 0 <= lid < self.model.n_layer:
                raise EdgespecError(f"layer {lid} is not a layer of {self.model.path.name} ({self.model.n_layer} layers)")
            llama_ext.fn("set_embeddings_layer_inp")(self.ptr, lid, True)
        self._taps = layers

    @property
    def taps(self) -> tuple[int, ...] | None:
        """The layers whose inputs `hidden` gives (set_hidden_taps), or None."""
        return getattr(self, "_taps", None)

    def hidden(self, rows: list[int]) -> np.ndarray:
        """Copies of the hidden states of batch rows `rows` of the last decode: the post-norm
        output [len(rows), n_embd] (rows must be output rows), or with taps set the inputs of
        those layers, concatenated [len(rows), n_taps * n_embd]."""
        d = self.model.n_embd
        taps = getattr(self, "_taps", None)
        if taps:
            from . import llama_ext

            get = llama_ext.fn("get_embeddings_layer_inp")
            out = np.empty((len(rows), len(taps) * d), np.float32)
            idx = np.asarray(rows, dtype=np.int64)
            n = int(idx.max()) + 1 if len(rows) else 0
            for k, lid in enumerate(taps):
                ptr = get(self.ptr, lid)
                out[:, k * d : (k + 1) * d] = np.ctypeslib.as_array(ptr, shape=(n, d))[idx]
            return out
        out = np.empty((len(rows), d), np.float32)
        for j, i in enumerate(rows):
            ptr = lc.llama_get_embeddings_ith(self.ptr, i)
            if not ptr:
                raise EdgespecError(f"internal: no hidden state for batch row {i} (embeddings off?)")
            out[j] = np.ctypeslib.as_array(ptr, shape=(d,))
        return out

    # -- memory: called only by kv.py (KVSeq, SideKV) ------------------------------------

    def mem_seq_rm(self, seq: int, p0: int, p1: int) -> bool:
        return bool(lc.llama_memory_seq_rm(self.mem, seq, p0, p1))

    def mem_seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        lc.llama_memory_seq_cp(self.mem, src, dst, p0, p1)

    def mem_seq_pos_max(self, seq: int) -> int:
        return int(lc.llama_memory_seq_pos_max(self.mem, seq))

    def mem_clear(self) -> None:
        lc.llama_memory_clear(self.mem, True)

    def state_seq_get(self, seq: int) -> bytearray:
        """A copy of sequence `seq`'s KV state (its cells and their positions; no logits)."""
        n = int(lc.llama_state_seq_get_size(self.ptr, seq))
        buf = bytearray(n)
        if n == 0:
            return buf
        got = int(lc.llama_state_seq_get_data(self.ptr, (ctypes.c_ubyte * n).from_buffer(buf), n, seq))
        if got <= 0:
            raise ModelError(f"llama.cpp could not copy sequence {seq}'s state: {last_log_error()}")
        del buf[got:]
        return buf

    def state_seq_set(self, data: bytearray, seq: int) -> bool:
        """Load a state from `state_seq_get` into sequence `seq` (which should be empty)."""
        n = len(data)
        if n == 0:
            return False
        return int(lc.llama_state_seq_set_data(self.ptr, (ctypes.c_ubyte * n).from_buffer(data), n, seq)) > 0

    def close(self) -> None:
        if getattr(self, "ptr", None):
            lc.llama_batch_free(self._batch)
            lc.llama_free(self.ptr)
            self.ptr = None

    def __del__(self) -> None:  # pragma: no cover
        try:
            self.close()
        except Exception:
            pass


def quantize(src: str | os.PathLike, dst: str | os.PathLike, qtype: str, threads: int = 0) -> None:
    """Write `dst` as `src` requantized to `qtype` (llama.cpp's quantize API)."""
    backend_init()
    if qtype not in QUANT_TYPES:
        raise EdgespecError(f"unknown quantization {qtype!r}; choose one of {', '.join(QUANT_TYPES)}")
    inspect(src)
    params = lc.llama_model_quantize_default_params()
    params.ftype = QUANT_TYPES[qtype]
    params.nthread = threads or default_threads()
    params.allow_requantize = True
    _LOG.clear()
    rc = lc.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise ModelError(f"quantize {src} -> {qtype} failed: {last_log_error()}")
