"""Where heads live and how `--spec medusa|eagle|eagle3|mtp` finds them.

Two places are searched for a heads file made for the target (same hidden size, vocabulary size
and tokenizer fingerprint, so `smollm2-135m-instruct:q4_0` and `:q8_0` share heads): the heads
cache (`<cache>/heads/`, where `edgespec train` writes and checkpoint folders are converted) and the
heads shipped inside the package (`edgespec/data/heads/`). `--heads PATH` overrides the search.
"""

from __future__ import annotations

import hashlib
import json
from importlib import resources
from pathlib import Path

from .format import HeadsError

KIND_KEY = "edgespec.heads.kind"


def heads_dir() -> Path:
    from ..models import cache_root

    return cache_root() / "heads"


def shipped_dir() -> Path:
    return Path(str(resources.files("edgespec").joinpath("data/heads")))


def describe(path: Path) -> dict | None:
    """kind, target fingerprint keys and source of a heads file (None when it is not one).

    Read with ggml's parser: GGUFReader walks every tokenizer entry in Python, 4 s on an EAGLE-3
    file (which carries the target's whole tokenizer), on every generation's heads lookup."""
    from ..errors import ModelError
    from ..gguf_check import read_meta

    try:
        meta = read_meta(path, ("general.architecture", "edgespec."))
    except ModelError:  # not a GGUF, or damaged: not a candidate
        return None
    out: dict = {"path": path, **meta}
    arch = out.get("general.architecture")
    if arch == "eagle3":
        out["kind"] = "eagle3"
    elif arch == "edgespec-heads":
        out["kind"] = out.get(KIND_KEY)
    else:
        return None
    return out


# The heads shipped in the package, by file name and sha256 (catalog entries: a shipped file that
# does not match is not used).
SHIPPED = {
    "smollm2-135m-instruct.medusa.gguf": "2263b8b84782c3f64217d2db74b71a460e2118153bebc9f04abc42686d161ff5",
    "smollm2-135m-instruct.eagle.gguf": "7c853684a9398f114652103ca2c106e6e139ad0a5634f08f1613e1ecef7a417d",
    "smollm2-135m-instruct.mtp.gguf": "17f447b7d92266b06b296a4ca94b55fd36766d60b4a11344cfedcb48c325dc8c",
    "smollm2-135m-instruct.eagle3.gguf": "d686212a67dc165133a7932b158cc837c048212d60f46d4fd594d59fcfdd6b03",
}
_verified: dict[tuple, bool] = {}


def _shipped_ok(f: Path) -> bool:
    want = SHIPPED.get(f.name)
    if want is None:
        return False
    st = f.stat()
    key = (str(f), st.st_size, st.st_mtime_ns)
    if key not in _verified:
        h = hashlib.sha256(f.read_bytes()).hexdigest()
        _verified[key] = h == want
        if h != want:
            import logging

            logging.getLogger(__name__).warning("shipped heads %s do not match their sha256: not used", f.name)
    return _verified[key]


def _candidates() -> list[Path]:
    files: list[Path] = []
    if heads_dir().is_dir():
        files.extend(sorted(heads_dir().glob("*.gguf")))
    if shipped_dir().is_dir():
        files.extend(f for f in sorted(shipped_dir().glob("*.gguf")) if _shipped_ok(f))
    return files


def find_heads(kind: str, model) -> Path | None:
    """The first heads file of `kind` made for `model` (cache first, then shipped)."""
    from .format import target_meta

    want = target_meta(model)
    for f in _candidates():
        d = describe(f)
        if d and d.get("kind") == kind and all(d.get("edgespec." + k) == want[k] for k in
                                               ("heads.n_embd", "heads.n_vocab", "heads.vocab_hash")):
            return f
    return None


def kinds_for(model) -> set[str]:
    """Every kind of heads found for `model`."""
    return {k for k in ("medusa", "eagle", "eagle3", "mtp") if find_heads(k, model)}


def checkpoint_kind(folder: Path) -> str:
    """Medusa, EAGLE or EAGLE-3, from a checkpoint folder's config.json."""
    from .checkpoint import load_config

    cfg = load_config(folder)
    if "medusa_num_heads" in cfg or any(folder.glob("medusa_lm_head.*")):
        return "medusa"
    if "draft_vocab_size" in cfg:
        return "eagle3"
    if cfg.get("mtp_module") or cfg.get("num_nextn_predict_layers"):
        return "mtp"
    return "eagle"


def resolve_heads(spec: str, kind: str, model) -> Path:
    """`--heads`: a heads GGUF as is, or a checkpoint folder converted into the cache once."""
    p = Path(spec).expanduser()
    if p.is_file():
        return p
    if not p.is_dir():
        raise HeadsError(f"heads not found: {p}")
    found = checkpoint_kind(p)
    if found != kind:
        raise HeadsError(f"{p} holds a {found} checkpoint, not {kind}: use --spec {found}")
    key = hashlib.sha256(json.dumps([str(p.resolve()), Path(model.path).name,
                                     sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in p.iterdir())]).encode())
    out = heads_dir() / f"{p.name}-{kind}-{key.hexdigest()[:10]}.gguf"
    if not out.exists():
        convert_any(kind, p, model, out)
    return out


def convert_any(kind: str, src: Path, model, out: Path, source_note: str = "") -> Path:
    """Checkpoint `src` of `kind` into a GGUF for `model`: llama.cpp's eagle3 file, else a heads file."""
    if kind == "eagle3":
        from .eagle3 import convert_eagle3

        return convert_eagle3(src, model, out, source_note=source_note)
    from .convert import convert

    return convert(kind, src, model, out, source_note=source_note)


def list_heads() -> list[dict]:
    """Every heads file in the cache and shipped, described (`edgespec models`)."""
    rows = []
    for f in _candidates():
        d = describe(f)
        if d:
            rows.append({"path": f, "kind": d.get("kind"), "target": d.get("edgespec.heads.target", "?"),
                         "source": d.get("edgespec.heads.source", ""), "size": f.stat().st_size,
                         "shipped": f.parent == shipped_dir()})
    return rows


# -- for an engine's target: which heads it has, which file a method reads, the loaded runtime --


def heads_kinds(spec: str | None, model) -> set[str]:
    """The kinds of heads `model` has: the --heads file's (`spec`), else those found in the heads
    cache and shipped with edgespec; "mtp" too when the model has nextn layers."""
    if spec:
        p = Path(spec)
        d = describe(p) if p.is_file() else None
        if d:
            kinds = {d["kind"]}
        else:
            kinds = {checkpoint_kind(p)} if p.is_dir() else set()
    else:
        kinds = kinds_for(model)
    if model.n_layer_nextn > 0:
        kinds.add("mtp")
    return kinds


def heads_path(spec: str | None, kind: str, model) -> Path:
    """The heads file for method `kind`: --heads (`spec`; a checkpoint folder is converted into the
    cache once), else the one cached or shipped for `model`; one clear line otherwise."""
    if spec:
        p = resolve_heads(spec, kind, model)
        d = describe(p)
        if d is None:
            raise HeadsError(f"{p} is not a heads file (made by `edgespec convert` or `edgespec train`)")
        if d["kind"] != kind:
            raise HeadsError(f"{p} holds {d['kind']} heads, not {kind}: use --spec {d['kind']}")
        return p
    p = find_heads(kind, model)
    if p is None:
        raise HeadsError(f"--spec {kind} needs heads for {model.path.name}: none cached or shipped; pass "
                         f"--heads FILE, or make them with `edgespec train {kind} -m MODEL`"
                         + (" or `edgespec convert`" if kind != "mtp" else ""))
    return p


class HeadsRuntime:
    """The numpy runtime of one heads file (Medusa heads, or an EAGLE head / trained MTP module
    with its own KV cache over the committed text), checked against the target: a side context of
    the engine (`edgespec.side`), kept across generations, not bound to the target's context."""

    bound = False

    def __init__(self, path: Path, kind: str, model, n_ctx: int):
        from threadpoolctl import threadpool_limits

        from .format import check_target, read_heads
        from .runtime import EagleHead, MedusaHeads
        from .target import TargetWeights

        # numpy's BLAS threads spin after each call and would take the cores llama.cpp's
        # threads need in the next decode; the heads' few rows gain nothing from them.
        threadpool_limits(1, user_api="blas")
        hf = read_heads(path)
        check_target(hf, model)
        tw = TargetWeights(model.path, model.n_vocab, hf.get("heads.n_embd"))
        self.path = path
        self.runtime = MedusaHeads(hf, tw) if kind == "medusa" else EagleHead(hf, tw, n_ctx)

    def close(self) -> None:
        pass
