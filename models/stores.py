"""The GGUF files other tools already keep: the Hugging Face cache, llama.cpp's old flat cache,
Ollama's store, LM Studio's folder. Each model is loaded where it lies, never copied.

A spec names a model in one of them (`parse`):

- `org/repo[:quant]`: the Hugging Face cache (`hub`), then llama.cpp's old flat files
  (`org_repo_file.gguf`), then LM Studio's `org/repo` folder, else a download (`hub.download`);
- `ollama:name[:tag]`: Ollama's manifest `manifests/<registry>/<namespace>/<name>/<tag>` (tag
  default `latest`, registry `registry.ollama.ai`, namespace `library`), whose layer of type
  `application/vnd.ollama.image.model` is the GGUF file `blobs/sha256-<hex>`;
- `lmstudio:publisher/model[:quant]`, `lmstudio:publisher/model/file.gguf`, `lmstudio:file.gguf`:
  LM Studio's `~/.lmstudio/models/<publisher>/<model>/<file>.gguf`.

A store's data is not trusted: an Ollama layer digest must be `sha256:<64 hex digits>` (as in
Ollama's fix for CVE-2024-37032) and its blob, links followed, a regular file inside the store's
`blobs` folder; names given on the command line may not climb (`..`).

`scan` walks every store for `edgespec models`; what it cannot read is a one-line note.
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..errors import CatalogError
from . import hub
from .files import is_first_part, is_model_file, pick, quant_of, split_names
from .paths import MISSING, existing_dirs, read_small, store_problem

OLLAMA_REGISTRY, OLLAMA_NAMESPACE = "registry.ollama.ai", "library"
OLLAMA_MODEL_TYPE = "application/vnd.ollama.image.model"
SYSTEM_OLLAMA = Path("/usr/share/ollama/.ollama/models")  # the Linux service's store
DIGEST_RE = re.compile(r"sha256[:-]([0-9a-f]{64})")  # a layer digest; the blob's name uses '-' (old: ':')
_PART_RE = re.compile(r"\w[\w.:-]*")  # one component of an Ollama name (a host may have a port): never '..'
_CLIMBS = ("", ".", "..")
MANIFEST_MAX = 1 << 20  # bytes: a manifest is a few hundred


@dataclass(frozen=True)
class Spec:
    kind: str  # hf | ollama | lmstudio
    name: str  # hf: org/repo; ollama: registry/namespace/model; lmstudio: publisher/model, or a file name
    want: str | None  # quant, file name or Ollama tag as given


def parse(spec: str) -> Spec | None:
    """The store a spec names, or None (a catalog name or a path)."""
    if spec.startswith("ollama:"):
        rest = spec[len("ollama:"):]
        name, tag = rest, "latest"
        if ":" in rest.rsplit("/", 1)[-1]:
            name, tag = rest.rsplit(":", 1)
        parts = [p for p in name.split("/") if p]
        if not parts or not tag:
            raise CatalogError(f"{spec!r}: name an Ollama model as ollama:NAME[:TAG], e.g. ollama:qwen2.5-coder:1.5b")
        if not all(_PART_RE.fullmatch(p) for p in (*parts, tag)):
            raise CatalogError(f"{spec!r}: not an Ollama model name (letters, digits, '.', '_', '-'; "
                               "ollama:[HOST/][NAMESPACE/]NAME[:TAG])")
        if len(parts) == 1:
            parts = [OLLAMA_REGISTRY, OLLAMA_NAMESPACE, *parts]
        elif len(parts) == 2:
            parts = [OLLAMA_REGISTRY, *parts]
        return Spec("ollama", "/".join(parts), tag)
    if spec.startswith("lmstudio:"):
        rest = spec[len("lmstudio:"):]
        name, _, want = rest.partition(":") if ":" in rest.rsplit("/", 1)[-1] else (rest, "", "")
        if name.lower().endswith(".gguf") and name.count("/") == 2:  # publisher/model/file.gguf
            name, want = name.rsplit("/", 1)
        if not name or any(p in _CLIMBS or "\\" in p for p in name.split("/")):
            raise CatalogError(f"{spec!r}: name an LM Studio model as lmstudio:PUBLISHER/MODEL[:QUANT] or "
                               "lmstudio:FILE.gguf")
        return Spec("lmstudio", name, want or None)
    m = hub.REPO_RE.match(spec)
    if m and (m.group(3) or not spec.lower().endswith(".gguf")) and not Path(spec).expanduser().exists():
        return Spec("hf", f"{m.group(1)}/{m.group(2)}", m.group(3))
    return None


def find(spec: Spec) -> Path | None:
    """The spec's file on disk (a split GGUF's first part), or None where no store has it.
    A store that has it but cannot serve it (a manifest pointing nowhere) raises one line."""
    if spec.kind == "ollama":
        return ollama_model(spec)
    if spec.kind == "lmstudio":
        return lmstudio_model(spec.name, spec.want)
    return (hub.find_cached(spec.name, spec.want) or llamacpp_flat(spec.name, spec.want)
            or lmstudio_model(spec.name, spec.want, quiet=True))


def resolve(spec: Spec, text: str, fetch: bool = True, quiet: bool = False) -> Path:
    """A store's model (`text` as the user gave it) -> its GGUF on disk, downloading a Hugging
    Face repo's file when asked."""
    path = find(spec)
    if path is not None:
        return path
    if spec.kind == "ollama":
        raise CatalogError(f"{text}: no Ollama manifest {spec.name}:{spec.want} in "
                           f"{', '.join(map(str, ollama_dirs())) or 'any Ollama store'} (`ollama pull` it first)")
    if spec.kind == "lmstudio":
        raise CatalogError(f"{text}: not in LM Studio's models folder "
                           f"({', '.join(map(str, lmstudio_dirs())) or '~/.lmstudio/models: not there'})")
    if not fetch:
        raise CatalogError(f"{text} is not on disk; run `edgespec pull {text}`")
    return hub.download(spec.name, spec.want, quiet)


# -- llama.cpp's old flat cache ---------------------------------------------------------------

def llamacpp_dirs() -> list[Path]:
    """Where older llama.cpp builds put `-hf` files, flat: LLAMA_CACHE, else the user cache's
    llama.cpp folder (XDG_CACHE_HOME, ~/.cache; ~/Library/Caches on macOS)."""
    env = os.environ.get
    cands = [env("LLAMA_CACHE"), env("XDG_CACHE_HOME") and os.path.join(env("XDG_CACHE_HOME"), "llama.cpp"),
             str(Path.home() / ".cache" / "llama.cpp")]
    if sys.platform == "darwin":
        cands.append(str(Path.home() / "Library" / "Caches" / "llama.cpp"))
    return existing_dirs(cands)


def llamacpp_flat(repo: str, want: str | None) -> Path | None:
    """`org_repo_file.gguf` (llama.cpp's flat name for `-hf org/repo`) for this quant, if present."""
    prefix = repo.replace("/", "_").lower() + "_"
    for d in llamacpp_dirs():
        names = {p.name[len(prefix):]: p for p in d.glob("*.gguf") if p.name.lower().startswith(prefix)}
        try:
            parts = pick(list(names), want, repo)
        except CatalogError:
            continue
        return names[parts[0]]
    return None


# -- Ollama -----------------------------------------------------------------------------------

def ollama_dirs() -> list[Path]:
    """OLLAMA_MODELS, ~/.ollama/models, the Linux service's /usr/share/ollama/.ollama/models."""
    return existing_dirs([os.environ.get("OLLAMA_MODELS"), str(Path.home() / ".ollama" / "models"), str(SYSTEM_OLLAMA)])


def _read_manifest(manifest: Path) -> dict:
    doc = json.loads(read_small(manifest, MANIFEST_MAX))
    if not isinstance(doc, dict):
        raise ValueError("not a JSON object")
    return doc


def ollama_blob(root: Path, manifest: Path, label: str) -> Path:
    """The model layer's blob of one manifest, checked to be there whole and inside the store's
    `blobs` folder; raises one line (a digest that is no sha256 is never made a path)."""
    try:
        layers = _read_manifest(manifest).get("layers") or []
        layer = next(layer for layer in layers if layer.get("mediaType") == OLLAMA_MODEL_TYPE)
        digest, size = layer.get("digest", ""), layer.get("size")
    except StopIteration:
        raise CatalogError(f"{label}: its Ollama manifest has no model layer ({OLLAMA_MODEL_TYPE})") from None
    except (OSError, ValueError, AttributeError, TypeError) as e:
        raise CatalogError(f"{label}: unreadable Ollama manifest {manifest} ({type(e).__name__})") from None
    if not digest:
        raise CatalogError(f"{label}: its Ollama manifest names no digest for the model layer")
    m = DIGEST_RE.fullmatch(digest) if isinstance(digest, str) else None
    if m is None:
        raise CatalogError(f"{label}: its Ollama manifest's model digest {str(digest)[:80]!r} is not "
                           "sha256:<64 hex digits>; not followed")
    blobs = root / "blobs"
    for name in (f"sha256-{m.group(1)}", f"sha256:{m.group(1)}"):  # Ollama's names, then its first releases'
        blob = blobs / name
        problem = store_problem(blob, blobs)
        if problem == MISSING:
            continue
        if problem is not None:
            raise CatalogError(f"{label}: Ollama blob {name}: {problem}; not used")
        if isinstance(size, int) and blob.stat().st_size != size:
            raise CatalogError(f"{label}: Ollama blob {blob.name} has {blob.stat().st_size} bytes, its manifest "
                               f"says {size} (an interrupted pull? `ollama pull` it again)")
        return blob
    raise CatalogError(f"{label}: its Ollama manifest points at blobs/sha256-{m.group(1)}, which is not there")


def ollama_label(name: str, tag: str) -> str:
    """The shortest spec for a manifest: ollama:qwen2.5-coder:1.5b for the default registry."""
    short = name.removeprefix(f"{OLLAMA_REGISTRY}/").removeprefix(f"{OLLAMA_NAMESPACE}/")
    return f"ollama:{short}:{tag}"


def ollama_model(spec: Spec) -> Path | None:
    for root in ollama_dirs():
        manifest = root / "manifests" / spec.name / spec.want
        if manifest.is_file():
            return ollama_blob(root, manifest, ollama_label(spec.name, spec.want))
    return None


# -- LM Studio --------------------------------------------------------------------------------

def lmstudio_dirs() -> list[Path]:
    """~/.lmstudio/models, and ~/.cache/lm-studio/models where older versions kept them."""
    home = Path.home()
    return existing_dirs([str(home / ".lmstudio" / "models"), str(home / ".cache" / "lm-studio" / "models")])


def lmstudio_model(name: str, want: str | None, quiet: bool = False) -> Path | None:
    """`publisher/model` with a quant or file name, or a file name alone, in LM Studio's folder."""
    for root in lmstudio_dirs():
        if name.lower().endswith(".gguf") and "/" not in name:
            hits = sorted(root.glob(f"*/*/{name}")) or sorted(p for p in root.glob("*/*/*.gguf")
                                                                  if p.name.lower() == name.lower())
            if hits:
                return hits[0]
            continue
        folder = root / name
        if not folder.is_dir():
            continue
        files = _ggufs(folder)
        try:
            return files[pick(list(files), want, name, " (LM Studio)")[0]]
        except CatalogError:
            if quiet:
                continue
            raise
    return None


# -- every store, for `edgespec models` -------------------------------------------------------

@dataclass(frozen=True)
class Found:
    name: str  # the spec that loads it with -m
    store: str  # catalog | hf | llama.cpp | ollama | lmstudio | dir
    path: Path | None  # None: a note (what is wrong) instead of a file
    note: str = ""
    parts: tuple[Path, ...] = ()  # a split GGUF's other parts (their sizes count)


def _files_label(files: dict[str, Path], rel: str, prefix: str) -> str:
    """`prefix:QUANT` where that quant picks this one file, else `prefix:file.gguf`."""
    q = quant_of(rel)
    try:
        if q and pick(list(files), q, prefix) == split_names(rel):
            return f"{prefix}:{q}"
    except CatalogError:
        pass
    return f"{prefix}:{Path(rel).name}"


def _from_files(files: dict[str, Path], store: str, label: Callable[[str], str]) -> list[Found]:
    """One Found per model in `files` (relative name -> path): a split GGUF by its first part,
    with its other parts, or a note where parts are missing."""
    out = []
    for rel, p in files.items():
        if not is_model_file(rel) or not is_first_part(rel):
            continue
        names = split_names(rel)
        others = tuple(files[r] for r in names[1:] if r in files)
        if len(others) != len(names) - 1:
            out.append(Found(label(rel), store, None, f"split GGUF with {len(others) + 1} of its {len(names)} parts"))
            continue
        out.append(Found(label(rel), store, p, parts=others))
    return out


def _ggufs(folder: Path) -> dict[str, Path]:
    """Every `*.gguf` under `folder` (links to folders not followed), by relative name."""
    try:
        return {p.relative_to(folder).as_posix(): p for p in sorted(folder.rglob("*.gguf"))}
    except OSError:
        return {}


def _scan_hub() -> list[Found]:
    out: list[Found] = []
    for d in hub.hub_dirs():
        for folder in sorted(d.glob("models--*")):
            repo = hub.repo_of(folder)
            if repo is None:
                continue
            try:
                snap = hub.snapshot(folder)
            except CatalogError as e:
                out.append(Found(repo, "hf", None, str(e)))
                continue
            if snap is not None:
                out += _from_files(snap.files, "hf", lambda rel: _files_label(snap.files, rel, repo))
                out += [Found(f"{repo}:{rel}", "hf", None, why) for rel, why in snap.broken.items()]
    return out


def _scan_ollama() -> list[Found]:
    out: list[Found] = []
    for root in ollama_dirs():
        for manifest in sorted(p for p in (root / "manifests").rglob("*") if p.is_file() and p.name[0] != "."):
            rel = manifest.relative_to(root / "manifests").parts
            label = ollama_label("/".join(rel[:-1]), rel[-1])
            try:
                out.append(Found(label, "ollama", ollama_blob(root, manifest, label)))
            except CatalogError as e:
                out.append(Found(label, "ollama", None, str(e).removeprefix(f"{label}: ")))
    return out


def scan(dirs: tuple[str, ...] = ()) -> list[Found]:
    """Every GGUF in the Hugging Face caches, llama.cpp's flat cache, Ollama, LM Studio and the
    folders `dirs` (searched through), in that order; a manifest, ref, link or split that cannot
    be served is a Found with a note. Headers are not read here (`local`); nothing is opened but
    manifests and refs. (The catalog's own cache is listed by the caller.)"""
    out = _scan_hub()
    for d in llamacpp_dirs():
        out += [Found(str(p), "llama.cpp", p) for p in sorted(d.glob("*.gguf")) if is_model_file(p.name)]
    out += _scan_ollama()
    for root in lmstudio_dirs():
        for folder in sorted(p for p in root.glob("*/*") if p.is_dir()):
            files = _ggufs(folder)
            prefix = f"lmstudio:{folder.relative_to(root).as_posix()}"
            out += _from_files(files, "lmstudio", lambda rel: _files_label(files, rel, prefix))
    for d in dirs:
        folder = Path(d).expanduser()
        if not folder.is_dir():
            out.append(Found(str(folder), "dir", None, "not a folder"))
            continue
        files = _ggufs(folder)
        out += _from_files(files, "dir", lambda rel: str(files[rel]))
    return out
