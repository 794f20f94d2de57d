"""Checksums: a file's sha256, checked once and recorded so that it is not hashed again.

Two records. A file edgespec made (the catalog's, a local variant) has a marker beside it,
`NAME.verified`: its sha256, size and mtime. A file in another tool's store (the Hugging Face
cache) is never written beside: its verification is recorded in edgespec's cache,
`verified.json`, by the hash and the file's real path. Either way a file whose size or mtime changed since is
hashed again, so a file changed on disk is never trusted on its old word.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

from ..errors import ChecksumError

_HEX64, _HEX40 = re.compile(r"[0-9a-f]{64}"), re.compile(r"[0-9a-f]{40}")
RECORDS = "verified.json"


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def git_blob_sha1(path: Path) -> str:
    """git's object id of a file's bytes: the Hub's `oid` of a file kept in git, not in LFS."""
    h = hashlib.sha1(f"blob {path.stat().st_size}\0".encode())
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _stamp(path: Path) -> str:
    st = path.stat()
    return f"{st.st_size} {st.st_mtime_ns}"


def _marker(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def is_verified(path: Path, sha: str | None) -> bool:
    """True when `path` matches `sha` (or the sha recorded when it was made), by its marker
    while the file's size and mtime are those recorded, else by a full hash (then recorded)."""
    if not path.is_file():
        return False
    m = _marker(path)
    if m.exists():
        try:
            rec_sha, rec_stamp = m.read_text().split("\n", 1)
        except ValueError:
            rec_sha, rec_stamp = "", ""
        if rec_stamp.strip() == _stamp(path) and (sha is None or rec_sha == sha):
            return True
    actual = sha256_of(path)
    if sha is not None and actual != sha:
        return False
    if sha is None and m.exists() and m.read_text().split("\n", 1)[0] != actual:
        return False
    write_marker(path, actual)
    return True


def write_marker(path: Path, sha: str) -> None:
    _marker(path).write_text(f"{sha}\n{_stamp(path)}")


# -- files in other tools' stores, recorded in edgespec's cache -----------------------------------

def _records_file() -> Path:
    from .catalog import cache_root

    return cache_root() / RECORDS


def _records() -> dict:
    try:
        rec = json.loads(_records_file().read_text())
        return rec if isinstance(rec, dict) else {}
    except (OSError, ValueError):
        return {}


def verify_once(path: Path, expected: str, label: str) -> None:
    """Check `path` against the Hub's hash of it (`expected`: an LFS file's sha256, or git's
    sha1 of a file kept in git), once: a match is recorded in edgespec's cache and not hashed
    again while the file's size and mtime stay. Raises a one-line ChecksumError on a mismatch."""
    expected = expected.lower()
    if _HEX64.fullmatch(expected):
        algo, digest = "sha256", sha256_of
    elif _HEX40.fullmatch(expected):
        algo, digest = "git sha1", git_blob_sha1
    else:
        raise ChecksumError(f"{label}: the Hub gave no usable hash for it ({expected[:80]!r}); not used")
    key = f"{expected} {path.resolve()}"
    stamp = _stamp(path)
    if _records().get(key) == stamp:
        return
    actual = digest(path)
    if actual != expected:
        raise ChecksumError(f"{label}: {path} has {algo} {actual}, the Hub says {expected}; not used "
                            "(delete it and download it again)")
    records = _records()  # another process may have added its own since
    records[key] = stamp
    dst = _records_file()
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(records, indent=0, sort_keys=True))
        os.replace(tmp, dst)
    except OSError:  # a read-only cache: verified now, hashed again next time
        pass

