"""GGUF file names: which quant a name says, which files are models, the parts of a split GGUF
(the one place their names are made), and which files a quant or file name picks from a list.

Pure functions over names: no store, no disk. Every store reader (`hub`, `stores`, the `--dir`
scan) picks and groups files through these.
"""

from __future__ import annotations

import re
from pathlib import Path

from ..errors import CatalogError

DEFAULT_QUANT = "Q4_K_M"  # what llama.cpp's -hf takes when no quant is named
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.I)
_QUANT = re.compile(r"(?:^|[-._])((?:i?q\d+(?:_[a-z0-9]+)*)|bf16|f16|f32|mxfp4(?:_[a-z0-9]+)*)$")


class SplitError(CatalogError):
    """A split GGUF with parts missing."""


def split_part(name: str) -> tuple[int, int] | None:
    """(part, parts) of a split GGUF's file name (`-00002-of-00003.gguf`), else None."""
    m = _SPLIT.search(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def split_names(name: str) -> list[str]:
    """Every part's name of the split GGUF `name` is one of (a relative name keeps its folder),
    in order; `[name]` for a file that is not split."""
    sp = split_part(name)
    if sp is None:
        return [name]
    return [_SPLIT.sub(f"-{i:05d}-of-{sp[1]:05d}.gguf", name) for i in range(1, sp[1] + 1)]


def is_first_part(name: str) -> bool:
    """A file loaded by its own name: not split, or a split GGUF's first part."""
    return (split_part(name) or (1, 1))[0] == 1


def quant_of(name: str) -> str | None:
    """The quant a GGUF's file name says (`...-Q4_K_M.gguf`, `model.q8_0.gguf`), upper case, or None."""
    stem = _SPLIT.sub(".gguf", Path(name).name)
    stem = stem[:-5] if stem.lower().endswith(".gguf") else stem
    m = _QUANT.search(stem.lower())
    return m.group(1).upper() if m else None


def is_model_file(name: str) -> bool:
    """A GGUF that may hold a language model: not a vision projector (mmproj) or an imatrix."""
    base = Path(name).name.lower()
    return base.endswith(".gguf") and not base.startswith(("mmproj", "imatrix"))


def quants(files: list[str]) -> list[str]:
    """The quants named by these GGUF files, in a stable order."""
    return sorted({quant_of(f) or Path(f).name for f in files if is_model_file(f)})


def pick(files: list[str], want: str | None, repo: str, where: str = "") -> list[str]:
    """The files (relative names) to load for quant or file name `want` (None: the default,
    Q4_K_M, else the only quant there is): a split GGUF's parts in order, else one file. Raises a
    one-line error listing the quants `files` hold when none matches or several do."""
    models = sorted(f for f in files if is_model_file(f))
    if want is not None and want.lower().endswith(".gguf"):
        hits = [f for f in models if Path(f).name.lower() == want.lower()]
    else:
        q = (want or DEFAULT_QUANT).upper()
        hits = [f for f in models if quant_of(f) == q]
        if not hits and want is None and len(quants(models)) == 1:
            hits = models  # no Q4_K_M, one quant: that one (a repo of a single file)
    firsts = [f for f in hits if is_first_part(f)]
    if len(firsts) == 1:
        parts = split_names(firsts[0])
        missing = [p for p in parts if p not in files]
        if missing:
            raise SplitError(f"{repo}{where}: split GGUF {Path(firsts[0]).name} lacks {len(missing)} of its "
                             f"{len(parts)} parts ({Path(missing[0]).name} ...)")
        return parts
    label = want or DEFAULT_QUANT
    if firsts:
        raise CatalogError(f"{repo}{where} has several GGUF files for {label}: "
                           f"{', '.join(Path(f).name for f in firsts)}; name one: -m {repo}:FILE.gguf")
    have = quants(models)
    listed = ", ".join(have) if have else "no GGUF files"
    hint = f" (name one: -m {repo}:{have[0]})" if have else ""
    raise CatalogError(f"{repo}{where} has no {label} GGUF; it has: {listed}{hint}")
