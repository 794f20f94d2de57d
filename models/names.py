"""What a model name is, decided once: a model in a store (`org/repo[:quant]`, `ollama:`,
`lmstudio:`), a path to a GGUF file, or a catalog name (`NAME[:QUANT]`).

`classify` is the one place that decides it; everything else (`resolve`, `is_cached`,
`paired_draft`, `display_name`) reads the `ModelName` it gives. A name that is malformed for the
kind it is (`ollama:` alone, an unknown catalog name) keeps its one-line error in `problem`,
raised when the name is used, never when it is only looked at.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import CatalogError
from . import stores
from .catalog import CatalogEntry, parse_spec


@dataclass(frozen=True)
class ModelName:
    text: str  # as given
    kind: str  # store | path | catalog
    store: stores.Spec | None = None  # store: which model in which store
    entry: CatalogEntry | None = None  # catalog: the entry (None: an unknown name, see problem)
    quant: str | None = None  # catalog: the local variant, None for the entry's own file
    problem: str | None = None  # the one-line error using this name raises

    def check(self) -> ModelName:
        """Itself, or its one-line error raised."""
        if self.problem is not None:
            raise CatalogError(self.problem)
        return self

    @property
    def path(self) -> Path:
        """kind path: the file it names."""
        return Path(self.text).expanduser()


def looks_like_path(spec: str) -> bool:
    return spec.endswith(".gguf") or os.sep in spec or spec.startswith(".") or Path(spec).exists()


def classify(spec: str) -> ModelName:
    """A store's name first (an `org/repo` that is also a folder on disk is a path), then a
    path, then the catalog."""
    try:
        st = stores.parse(spec)
    except CatalogError as e:
        return ModelName(spec, "store", problem=str(e))
    if st is not None:
        return ModelName(spec, "store", store=st)
    if looks_like_path(spec):
        return ModelName(spec, "path")
    try:
        entry, quant = parse_spec(spec)
    except CatalogError as e:
        return ModelName(spec, "catalog", problem=str(e))
    return ModelName(spec, "catalog", entry=entry, quant=quant)


def display_name(spec: str) -> str:
    """A model spec as a person reads it: a file's name, else the spec."""
    return Path(spec).name if classify(spec).kind == "path" else spec
