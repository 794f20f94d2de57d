"""edgespec's heads file: Medusa heads or an EAGLE head as one GGUF, written with the `gguf` package.

One file holds what the runtime needs and what it was made for, so that heads meant for another
target fail with one clear line instead of drafting garbage:

    general.architecture        "edgespec-heads"
    edgespec.heads.kind         "medusa" | "eagle" | "mtp"
    edgespec.heads.n_embd       hidden size of the target
    edgespec.heads.n_vocab      vocabulary size of the target
    edgespec.heads.vocab_hash   fingerprint of the target's token list (gguf_check.vocab_fingerprint)
    edgespec.heads.target       the target's file name (for messages)
    edgespec.heads.source       where the weights came from (a checkpoint folder, `edgespec train`)
    medusa: edgespec.medusa.n_heads, edgespec.medusa.n_layers
    eagle:  edgespec.eagle.{n_head, n_head_kv, head_dim, n_ff, rope_theta, rms_eps}

Tensors (numpy shapes, [out, in] like PyTorch's Linear):

    draft_vocab                        int32 [K]  target token ids the heads may propose (absent: all)
    medusa.{h}.res.{l}.weight / .bias  [d, d] / [d]   ResBlock l of head h: x + SiLU(W x + b)
    medusa.{h}.output.weight           [V, d]  head h's own LM head (absent: the target's, tied)
    eagle.fc.weight / .bias            [d, 2d] / [d]  fc(cat(embedding of the token, feature))
    eagle.attn_{q,k,v}.weight (.bias)  [n_head*head_dim or n_head_kv*head_dim, d]
    eagle.attn_output.weight           [d, n_head*head_dim]
    eagle.ffn_norm.weight              [d]  (post-attention RMSNorm; EAGLE's layer 0 has no input norm)
    eagle.ffn_{gate,up}.weight, eagle.ffn_down.weight   [n_ff, d], [d, n_ff]
    eagle.token_embd.weight            [V, d]  (absent: the target's embeddings)
    eagle.output.weight                [V, d]  (absent: the target's LM head)
    mtp.*                              as eagle.*, plus mtp.enorm / mtp.hnorm (RMSNorms of the
                                       embedding and the feature before fc = eh_proj, no bias),
                                       mtp.attn_norm (pre-attention) and mtp.output_norm (before
                                       the shared LM head); edgespec.mtp.* as edgespec.eagle.*
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import ModelError

ARCH = "edgespec-heads"
KINDS = ("medusa", "eagle", "mtp")


class HeadsError(ModelError):
    """Heads that cannot be used (missing, damaged, or made for another target)."""


@dataclass
class HeadsFile:
    kind: str
    meta: dict  # the edgespec.* keys without their prefix: "heads.n_embd", "eagle.n_head", ...
    tensors: dict[str, np.ndarray] = field(default_factory=dict)
    path: Path | None = None

    def get(self, key: str, default=None):
        return self.meta.get(key, default)

    @property
    def draft_vocab(self) -> np.ndarray | None:
        v = self.tensors.get("draft_vocab")
        return None if v is None else v.astype(np.int64)


def write_heads(path: str | os.PathLike, heads: HeadsFile) -> Path:
    """Write `heads` (matrices as f16, vectors and vocabulary ids as stored) and return the path."""
    import gguf

    if heads.kind not in KINDS:
        raise HeadsError(f"unknown heads kind {heads.kind!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".part")
    w = gguf.GGUFWriter(str(tmp), ARCH)
    w.add_string("edgespec.heads.kind", heads.kind)
    for k, v in sorted(heads.meta.items()):
        key = "edgespec." + k
        if isinstance(v, bool) or isinstance(v, (int, np.integer)):
            w.add_uint32(key, int(v))
        elif isinstance(v, (float, np.floating)):
            w.add_float32(key, float(v))
        else:
            w.add_string(key, str(v))
    for name, t in heads.tensors.items():
        a = np.asarray(t)
        if a.dtype.kind in "iu":
            a = a.astype(np.int32)
        elif a.ndim >= 2:
            a = a.astype(np.float16)
        else:
            a = a.astype(np.float32)
        w.add_tensor(name, np.ascontiguousarray(a))
    return finish_gguf(w, tmp, path)


def finish_gguf(w, tmp: Path, path: Path) -> Path:
    """Write a gguf.GGUFWriter's file under its temporary name and move it into place whole."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, path)
    return path


def read_heads(path: str | os.PathLike) -> HeadsFile:
    """Read a heads file (one clear line when it is not one)."""
    import gguf

    p = Path(path)
    if not p.is_file():
        raise HeadsError(f"heads file not found: {p}")
    try:
        r = gguf.GGUFReader(str(p))
    except Exception as e:  # noqa: BLE001 - the reader raises many kinds on damaged files
        raise HeadsError(f"cannot read heads file {p}: {e}") from None
    meta: dict = {}
    arch = None
    for f in r.fields.values():
        if f.name == "general.architecture":
            arch = _value(f)
        elif f.name.startswith("edgespec."):
            meta[f.name[len("edgespec."):]] = _value(f)
    if arch != ARCH:
        hint = " (an EAGLE-3 or llama.cpp model file? use it with --spec eagle3 or -md)" if arch else ""
        raise HeadsError(f"{p} is not an edgespec heads file (architecture {arch!r}){hint}")
    kind = meta.pop("heads.kind", None)
    if kind not in KINDS:
        raise HeadsError(f"{p}: unknown heads kind {kind!r}")
    tensors = {t.name: np.array(t.data).reshape([int(x) for x in reversed(t.shape)]) for t in r.tensors}
    return HeadsFile(kind, meta, tensors, p)


def _value(f):
    import gguf

    t = f.types[0] if f.types else None
    if t == gguf.GGUFValueType.STRING:
        return bytes(f.parts[f.data[0]]).decode("utf-8")
    v = f.parts[f.data[0]][0]
    return float(v) if t in (gguf.GGUFValueType.FLOAT32, gguf.GGUFValueType.FLOAT64) else int(v)


def target_meta(model) -> dict:
    """What a heads file records about the target `model` (an llama.Model); computed once per model."""
    from ..gguf_check import vocab_fingerprint

    cached = getattr(model, "_heads_meta", None)
    if cached is not None:
        return dict(cached)
    meta = {
        "heads.n_embd": int(model.n_embd),
        "heads.n_vocab": model.n_vocab,
        "heads.vocab_hash": vocab_fingerprint(model.info),
        "heads.target": Path(model.path).name,
    }
    try:
        model._heads_meta = dict(meta)
    except AttributeError:  # a read-only stand-in
        pass
    return meta


def check_target(heads: HeadsFile, model) -> None:
    """Refuse heads made for another target: hidden size, vocabulary size, tokenizer."""
    want = target_meta(model)
    name = heads.path.name if heads.path else "heads"
    made_for = heads.get("heads.target", "another model")
    for key, what in (("heads.n_embd", "hidden size"), ("heads.n_vocab", "vocabulary size"),
                      ("heads.vocab_hash", "tokenizer")):
        if heads.get(key) != want[key]:
            raise HeadsError(f"{name} was made for {made_for} ({what} {heads.get(key)}), not for "
                             f"{want['heads.target']} ({what} {want[key]})")
