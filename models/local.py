"""Every GGUF on this machine, described from its header, and drafts paired by vocabulary.

`list_local` is `edgespec models`' table: the catalog's cache and every store (`stores.scan`),
each file's header read with ggml's parser (`gguf_check`: no weights loaded, every value's type
checked before it is read, only regular files opened), a file that is not a readable GGUF a
one-line note: these are files the user never named, and none of them may stop the scan.
`vocab_pair` is the draft model `auto` (and `draft`, `pearl` without -md) takes for a target with
no catalog pair: the smallest local model whose vocabulary is the target's (token for token, as
`-md` is checked: `gguf_check.compare_vocab`, and the same tokenizer type, BOS and EOS) and that
has at most DRAFT_SHARE of the target's parameters. It is never downloaded: only what is on disk
is considered.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import EdgespecError, VocabMismatchError
from . import hub, stores
from .catalog import CATALOG, QUANTS, models_dir
from .files import quant_of

# a draft must be clearly smaller: at most this share of the target's parameters (Qwen2.5 0.5B
# for its 1.5B: 0.35 counting every tensor; Llama 3.2 1B for its 3B: 0.39)
DRAFT_SHARE = 0.4
# llama_ftype -> the quant's name (general.file_type), where the file name does not say it
FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S",
              12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K",
              19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL",
              26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16",
              36: "TQ1_0", 37: "TQ2_0", 38: "MXFP4_MOE"}
_SPECIAL = ("tokenizer.ggml.model", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id")


def catalog_files() -> list:
    """The GGUF files in edgespec's own cache (`stores.Found`), by catalog name where they are one."""
    d = models_dir()
    if not d.is_dir():
        return []
    names = {e.filename: e.name for e in CATALOG.values()}
    names.update({f"{e.name}.{q}.gguf": f"{e.name}:{q}" for e in CATALOG.values() for q in QUANTS})
    return [stores.Found(names.get(p.name, str(p)), "catalog", p) for p in sorted(d.glob("*.gguf"))
            if not p.name.startswith(".")]


def all_files(dirs: tuple[str, ...] = ()) -> list[stores.Found]:
    return catalog_files() + stores.scan(dirs)


class Local:
    """One GGUF on disk and what its header says (`row` for `edgespec models`)."""

    def __init__(self, found: stores.Found):
        from ..gguf_check import inspect, read_meta

        self.found, self.name, self.path = found, found.name, found.path
        self.note = found.note
        self.info = self.meta = None
        if self.path is None:
            return
        try:
            self.info = inspect(self.path)
            arch = self.info.arch
            self.meta = read_meta(self.path, ("general.file_type", f"{arch}.context_length", *_SPECIAL))
        except (EdgespecError, OSError, RuntimeError) as e:  # RuntimeError: a link loop met meanwhile
            self.note = str(e) if isinstance(e, EdgespecError) else f"cannot read {self.path}: {e}"
            self.info = None

    @property
    def ok(self) -> bool:
        return self.info is not None

    @property
    def size(self) -> int:
        try:
            return sum(p.stat().st_size for p in (self.path, *self.found.parts)) if self.path else 0
        except OSError:
            return 0

    @property
    def quant(self) -> str:
        ft = self.meta.get("general.file_type") if self.meta else None
        return FILE_TYPES.get(ft) or quant_of(self.path.name) or "?"

    def fingerprint(self) -> str:
        from ..gguf_check import vocab_fingerprint

        return vocab_fingerprint(self.info)[:8]

    def can_draft_for(self, target: Local) -> bool:
        """Same vocabulary as `target` (checked as -md is) and at most DRAFT_SHARE of its parameters."""
        from ..gguf_check import compare_vocab

        if not (self.ok and target.ok) or self.info.n_tokens != target.info.n_tokens:
            return False
        if self.info.n_params > DRAFT_SHARE * target.info.n_params:
            return False
        if any(self.meta.get(k) != target.meta.get(k) for k in _SPECIAL):
            return False
        try:
            compare_vocab(target.info, self.info)
        except (VocabMismatchError, EdgespecError, OSError):  # another vocabulary, or a file changed since
            return False
        return True

    def row(self) -> dict:
        r = {"name": self.name, "store": self.found.store, "path": str(self.path) if self.path else None}
        if not self.ok:
            return {**r, "note": self.note}
        return {**r, "arch": self.info.arch, "params": self.info.n_params, "quant": self.quant, "size": self.size,
                "context_length": self.meta.get(f"{self.info.arch}.context_length"),
                "n_vocab": self.info.n_tokens, "vocab": self.fingerprint()}


def list_local(dirs: tuple[str, ...] = ()) -> list[dict]:
    """Every GGUF found (catalog cache, Hugging Face cache, llama.cpp, Ollama, LM Studio, `dirs`),
    with its header's facts and `drafts`: the models that can draft for it, smallest first (the
    first is the one `auto` takes), or `note` for one that cannot be read."""
    models = [Local(f) for f in all_files(dirs)]
    rows = []
    for m in models:
        r = m.row()
        if m.ok:
            drafts = sorted((d for d in models if d is not m and d.can_draft_for(m)), key=lambda d: d.info.n_params)
            r["drafts"] = [d.name for d in drafts]
        rows.append(r)
    return rows


_pairs: dict[tuple, str | None] = {}


def vocab_pair(spec: str, target_path: Path) -> str | None:
    """The name of the smallest local model that can draft for the target at `target_path`
    (see the module's docstring), or None. Files larger than the target are not read."""
    dirs = (hub.hub_dirs(), stores.llamacpp_dirs(), stores.ollama_dirs(), stores.lmstudio_dirs())
    key = (spec, str(target_path), repr(dirs), str(models_dir()))
    if key not in _pairs:
        target = Local(stores.Found(spec, "", target_path))
        best = None
        if target.ok:
            size = target.size
            for f in all_files():
                try:
                    if f.path is None or f.path.stat().st_size > size:
                        continue
                except OSError:
                    continue
                d = Local(f)
                if d.can_draft_for(target) and (best is None or d.info.n_params < best.info.n_params):
                    best = d
        _pairs[key] = best.name if best else None
    return _pairs[key]

