"""The output file of `edgespec batch`: the locked writer of its records (edgespec.serving.records),
and what a resumed run finds already done."""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from dataclasses import dataclass, field

from ...errors import EdgespecError
from ...serving.requests import Request
from .requests import DUPLICATE


class Writer:
    """Appends one JSON line per result with a single write, then flushes it to disk. The file is
    locked before anything in it changes: `--overwrite` never truncates a file that another live
    batch is writing."""

    def __init__(self, path: str, overwrite: bool = False):
        self.path = path
        if path == "-":
            self.fd = sys.stdout.fileno()
            self.sync = False
            return
        try:
            self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError as e:
            raise EdgespecError(f"cannot open output {path}: {e.strerror}") from None
        self.sync = True
        try:  # two runs appending to one file would run requests twice
            import fcntl

            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except ImportError:  # pragma: no cover - no flock on this platform
            pass
        except OSError:
            os.close(self.fd)
            raise EdgespecError(
                f"another edgespec batch is writing {path}; wait for it or choose another -o") from None
        if overwrite:
            os.ftruncate(self.fd, 0)

    def write(self, rec: dict) -> None:
        try:
            data = (json.dumps(rec, ensure_ascii=False) + "\n").encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate from the input (a custom_id): keep it escaped
            data = (json.dumps(rec) + "\n").encode("ascii")
        view = memoryview(data)
        while view:
            n = os.write(self.fd, view)
            view = view[n:]
        if self.sync:
            os.fsync(self.fd)

    def close(self) -> None:
        if self.path != "-":
            os.close(self.fd)


@dataclass
class Done:
    """What an existing output file already holds."""

    ids: set = field(default_factory=set)  # custom_ids with a result (ok or failed)
    duplicates: Counter = field(default_factory=Counter)  # duplicate-id error lines per custom_id
    lines: int = 0
    repaired: int = 0  # bytes of a torn last line removed
    failed: int = 0  # lines of requests that failed in serving (5xx), kept or removed for a retry
    restored: bool = False  # an interrupted --retry-failed rewrite was undone from its backup


def scan_output(path: str, retry_failed: bool = False) -> Done:
    """Read what an earlier run wrote; cut a last line torn by a kill so appends stay valid.

    Requests that failed in serving (status 5xx: `failed`) count as done, as every other line,
    unless `retry_failed`: then their lines are removed from the file, so that their new results
    take their place and every request keeps exactly one line. The rewrite keeps a backup until
    it is on disk; a run that finds a backup (the rewrite was interrupted) restores it first.
    Call it with the output locked (`Writer`)."""
    done = Done()
    backup = f"{path}.retry-backup"
    try:
        if os.path.exists(backup):
            _copy_over(backup, path)
            os.unlink(backup)
            done.restored = True
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return done
    except OSError as e:
        raise EdgespecError(f"cannot read output {path}: {e.strerror}") from None
    end = data.rfind(b"\n") + 1
    if end < len(data):
        done.repaired = len(data) - end
        with open(path, "r+b") as f:
            f.truncate(end)
    kept: list[bytes] = []
    for n, raw in enumerate(data[:end].splitlines(keepends=True), start=1):
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw)
            cid = rec["custom_id"]
            err = rec.get("error") or {}
            status = (rec.get("response") or {}).get("status_code")
        except (ValueError, KeyError, TypeError, AttributeError):
            raise EdgespecError(f"{path} line {n} is not a batch result; give another -o or --overwrite") from None
        if isinstance(err, dict) and err.get("code") == DUPLICATE:
            done.duplicates[cid] += 1
        elif isinstance(status, int) and status >= 500:
            done.failed += 1
            if retry_failed:
                continue
            done.ids.add(cid)
        else:
            done.ids.add(cid)
        kept.append(raw)
        done.lines += 1
    if retry_failed and done.failed:
        _rewrite(path, backup, b"".join(kept))
    return done


def _copy_over(src: str, dst: str) -> None:
    with open(src, "rb") as f:
        _write_in_place(dst, f.read())


def _write_in_place(path: str, data: bytes) -> None:
    """Replace the file's content through the same inode (the lock is on it, not on the name)."""
    with open(path, "r+b") as f:
        f.write(data)
        f.truncate(len(data))
        f.flush()
        os.fsync(f.fileno())


def _rewrite(path: str, backup: str, data: bytes) -> None:
    with open(path, "rb") as f, open(backup, "wb") as b:
        b.write(f.read())
        b.flush()
        os.fsync(b.fileno())
    _write_in_place(path, data)
    os.unlink(backup)


def pending_requests(reqs: list[Request], done: Done) -> list[Request]:
    """The requests an earlier run did not finish (each custom_id at most once, duplicates by count)."""
    dup_seen: Counter = Counter()
    todo = []
    for r in reqs:
        if r.duplicate_of is not None:
            dup_seen[r.custom_id] += 1
            if dup_seen[r.custom_id] <= done.duplicates[r.custom_id]:
                continue
        elif r.custom_id in done.ids:
            continue
        todo.append(r)
    return todo
