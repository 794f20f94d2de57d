"""Paths read from other tools' stores, kept safe: folders that exist, and files that are regular
files inside their store once every link is followed.

A store's own data names some of its paths (an Ollama manifest's layer digest, a Hugging Face
cache's `refs/main` and snapshot links): those are never trusted to stay inside the store. A
path is followed to its end (`resolve`, a symlink loop caught) and kept only if it lies in the
folder it belongs to and is a regular file (a FIFO named `*.gguf` would block its reader).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from ..gguf_check import file_problem

MISSING = "not found"


def existing_dirs(cands) -> list[Path]:
    """The candidate folders (str or None) that exist, expanded, once each, in order."""
    out: list[Path] = []
    for c in cands:
        if not c:
            continue
        p = Path(c).expanduser()
        try:
            ok = p.is_dir()
        except OSError:
            ok = False
        if ok and p not in out:
            out.append(p)
    return out


def real(p: Path) -> Path | None:
    """`p` with every link followed, or None where it cannot be (nothing there, a symlink loop)."""
    try:
        return p.resolve(strict=True)
    except (OSError, RuntimeError):  # RuntimeError: a symlink loop, before Python 3.13
        return None


def store_problem(p: Path, root: Path) -> str | None:
    """What keeps file `p` of the store folder `root` from being read, in a few words: MISSING
    (nothing there: an interrupted download, not an error), a symlink loop, a link out of the
    store, not a regular file, empty; None for a regular file inside `root`."""
    problem = file_problem(p)
    if problem is not None:
        return problem
    target, top = real(p), real(root)
    if target is None or top is None:
        return "a symlink loop"
    if not target.is_relative_to(top):
        return f"points out of its store (to {target})"
    return None


def within(root: Path, *names: str) -> Path | None:
    """`root / names...` where that path, before links are followed, stays inside `root`
    (none of `names` is absolute or climbs with `..`), else None."""
    p = root.joinpath(*names)
    if any(Path(n).is_absolute() or ".." in Path(n).parts for n in names):
        return None
    return p


def read_small(p: Path, limit: int) -> bytes:
    """The bytes of a small regular file (a manifest, a ref), opened without blocking and checked
    to be a regular file once open; raises OSError, or ValueError past `limit` bytes."""
    fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError("not a regular file")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise ValueError(f"larger than {limit} bytes")
    return data
