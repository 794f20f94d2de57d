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

`scan` walks every store for `edgespec models`; what it cannot read is a one-line note.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from ..errors import CatalogError
from . import hub

OLLAMA_REGISTRY, OLLAMA_NAMESPACE = "registry.ollama.ai", "library"
OLLAMA_MODEL_TYPE = "application/vnd.ollama.image.model"
SYSTEM_OLLAMA = Path("/usr/share/ollama/.ollama/models")  # the Linux service's store


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
        if not name:
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


def resolve(text: str, fetch: bool = True, quiet: bool = False) -> Path:
    """A store spec -> its GGUF on disk, downloading a Hugging Face repo's file when asked."""
    spec = parse(text)
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
    return hub._existing(cands)


def llamacpp_flat(repo: str, want: str | None) -> Path | None:
    """`org_repo_file.gguf` (llama.cpp's flat name for `-hf org/repo`) for this quant, if present."""
    prefix = repo.replace("/", "_").lower() + "_"
    for d in llamacpp_dirs():
        names = {p.name[len(prefix):]: p for p in d.glob("*.gguf") if p.name.lower().startswith(prefix)}
        try:
            parts = hub.pick(list(names), want, repo)
        except CatalogError:
            continue
        return names[parts[0]]
    return None


# -- Ollama -----------------------------------------------------------------------------------

def ollama_dirs() -> list[Path]:
    """OLLAMA_MODELS, ~/.ollama/models, the Linux service's /usr/share/ollama/.ollama/models."""
    return hub._existing([os.environ.get("OLLAMA_MODELS"), str(Path.home() / ".ollama" / "models"), str(SYSTEM_OLLAMA)])


def ollama_blob(root: Path, manifest: Path, label: str) -> Path:
    """The model layer's blob of one manifest, checked to be there whole; raises one line."""
    try:
        doc = json.loads(manifest.read_text())
        layers = doc.get("layers") or []
        digest = next(layer.get("digest", "") for layer in layers if layer.get("mediaType") == OLLAMA_MODEL_TYPE)
        size = next(layer.get("size") for layer in layers if layer.get("mediaType") == OLLAMA_MODEL_TYPE)
    except StopIteration:
        raise CatalogError(f"{label}: its Ollama manifest has no model layer ({OLLAMA_MODEL_TYPE})") from None
    except (OSError, ValueError, AttributeError, TypeError) as e:
        raise CatalogError(f"{label}: unreadable Ollama manifest {manifest} ({type(e).__name__})") from None
    algo, _, hexd = str(digest).partition(":")
    if not hexd:
        raise CatalogError(f"{label}: its Ollama manifest names no digest for the model layer")
    for name in (f"{algo}-{hexd}", f"{algo}:{hexd}"):  # Ollama's names, then its first releases'
        blob = root / "blobs" / name
        if blob.is_file():
            if isinstance(size, int) and blob.stat().st_size != size:
                raise CatalogError(f"{label}: Ollama blob {blob.name} has {blob.stat().st_size} bytes, its manifest "
                                   f"says {size} (an interrupted pull? `ollama pull` it again)")
            return blob
    raise CatalogError(f"{label}: its Ollama manifest points at blobs/{algo}-{hexd}, which is not there")


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
    return hub._existing([str(home / ".lmstudio" / "models"), str(home / ".cache" / "lm-studio" / "models")])


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
        files = {p.relative_to(folder).as_posix(): p for p in sorted(folder.rglob("*.gguf"))}
        try:
            return files[hub.pick(list(files), want, name, " (LM Studio)")[0]]
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
    q = hub.quant_of(rel)
    try:
        if q and hub.pick(list(files), q, prefix) == _parts_of(rel, files):
            return f"{prefix}:{q}"
    except CatalogError:
        pass
    return f"{prefix}:{Path(rel).name}"


def _parts_of(rel: str, files: dict[str, Path]) -> list[str]:
    sp = hub.split_part(rel)
    if sp is None:
        return [rel]
    return [hub._SPLIT.sub(f"-{i:05d}-of-{sp[1]:05d}.gguf", rel) for i in range(1, sp[1] + 1)]


def _from_files(files: dict[str, Path], prefix: str, store: str) -> list[Found]:
    out = []
    for rel, p in files.items():
        sp = hub.split_part(rel)
        if not hub.is_model_file(rel) or (sp and sp[0] != 1):
            continue
        others = tuple(files[r] for r in _parts_of(rel, files)[1:] if r in files)
        if sp and len(others) != sp[1] - 1:
            out.append(Found(f"{prefix}:{Path(rel).name}", store, None,
                             f"split GGUF with {len(others) + 1} of its {sp[1]} parts"))
            continue
        out.append(Found(_files_label(files, rel, prefix), store, p, parts=others))
    return out


def scan(dirs: tuple[str, ...] = ()) -> list[Found]:
    """Every GGUF in the Hugging Face caches, llama.cpp's flat cache, Ollama, LM Studio and the
    folders `dirs` (searched through), in that order; a manifest or split that cannot be
    served is a Found with a note. (The catalog's own cache is listed by the caller.)"""
    out: list[Found] = []
    for d in hub.hub_dirs():
        for folder in sorted(d.glob("models--*")):
            repo, snap = hub.repo_of(folder), hub.snapshot(folder)
            if repo and snap:
                out += _from_files(snap[1], repo, "hf")
    for d in llamacpp_dirs():
        out += [Found(str(p), "llama.cpp", p) for p in sorted(d.glob("*.gguf")) if hub.is_model_file(p.name)]
    for root in ollama_dirs():
        for manifest in sorted(p for p in (root / "manifests").rglob("*") if p.is_file() and p.name[0] != "."):
            rel = manifest.relative_to(root / "manifests").parts
            label = ollama_label("/".join(rel[:-1]), rel[-1])
            try:
                out.append(Found(label, "ollama", ollama_blob(root, manifest, label)))
            except CatalogError as e:
                out.append(Found(label, "ollama", None, str(e).removeprefix(f"{label}: ")))
    for root in lmstudio_dirs():
        for folder in sorted(p for p in root.glob("*/*") if p.is_dir()):
            files = {p.relative_to(folder).as_posix(): p for p in sorted(folder.rglob("*.gguf"))}
            out += _from_files(files, f"lmstudio:{folder.relative_to(root).as_posix()}", "lmstudio")
    for d in dirs:
        folder = Path(d).expanduser()
        if not folder.is_dir():
            out.append(Found(str(folder), "dir", None, "not a folder"))
            continue
        out += [Found(str(p), "dir", p) for p in sorted(folder.rglob("*.gguf")) if hub.is_model_file(p.name)
                and (hub.split_part(p.name) or (1, 1))[0] == 1]
    return out
