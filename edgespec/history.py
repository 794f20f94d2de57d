"""The replies a user has received, kept as a drafting source: a bounded token trie of past
outputs, one file per user, kept across conversations and restarts.

What a user asks next often repeats what they were told before: a revision of the last reply
("rewrite it", "number every item", "shorten it") copies long runs of it, and a user's own
questions come back in their own words. SuffixDecoding (vLLM / Arctic Inference) drafts from a
tree of earlier outputs; here the tree is lookahead's token trie (`trie.TokenTrie`), holding only
replies (never the user's prompts), pruned to `CAPACITY` nodes (the least seen branches first).
`chat` keeps one for the local user (`--no-history`: none); `serve` one per API key, never
shared between keys (`path_for`). The lookahead drafter reads it as a source of its own, with
its own calibration (drafters/lookahead.py).
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from pathlib import Path

from .trie import OUTPUT, Cursor, TokenTrie

log = logging.getLogger(__name__)

FOLDER = "history"  # under the model cache's folder (edgespec.models.cache_root)
LOCAL = "local.npz"  # the local user's (chat)
# Trie nodes kept at most: a reply of n tokens adds up to n * WINDOW nodes where nothing repeats
# (a few hundred thousand nodes: tens of MB in memory, a few MB on disk).
CAPACITY = 300_000
WINDOW = 24  # the branches' length, as lookahead's own trie (drafters.lookahead.WINDOW)
# Between replies the file is written at most this often (a full trie takes about a second to
# write); closing (the engine's, at exit) always writes.
SAVE_EVERY_S = 60.0


def folder(cache_root: Path) -> Path:
    return cache_root / FOLDER


def path_for(cache_root: Path, key: str | None = None) -> Path:
    """The history file of the local user (`key` None) or of one API key (by its hash: the key
    itself is never written)."""
    if key is None:
        return folder(cache_root) / LOCAL
    return folder(cache_root) / f"key-{hashlib.sha256(key.encode()).hexdigest()[:24]}.npz"


class History:
    """One user's past replies. A side context of the engine (`Engine.side`): `close` saves."""

    bound = False

    def __init__(self, path: Path | None, trie: TokenTrie | None = None):
        self.path = path
        self.trie = trie or TokenTrie(window=WINDOW, capacity=CAPACITY)
        self._dirty = False
        self._saved_at = -SAVE_EVERY_S  # the first reply is written at once

    @classmethod
    def open(cls, path: str | os.PathLike | None) -> "History":
        """The history saved at `path`, or an empty one (also where the file is unreadable: it
        is rewritten at the next save)."""
        p = Path(path) if path else None
        if p is not None and p.exists():
            try:
                return cls(p, TokenTrie.load(p, capacity=CAPACITY))
            except (OSError, ValueError, KeyError) as e:
                log.warning("starting a new reply history: %s is unreadable (%s)", p, e)
        return cls(p)

    def add(self, reply: list[int]) -> None:
        """Keep a reply's tokens (every window of them, as output)."""
        if reply:
            self.trie.extend(reply, OUTPUT, Cursor())
            self._dirty = True

    def save(self, soon: bool = False) -> None:
        """Write the trie if anything was added (atomically; the folder is the user's alone);
        `soon`: only where SAVE_EVERY_S passed since it was last written."""
        if not self._dirty or self.path is None or (soon and time.monotonic() - self._saved_at < SAVE_EVERY_S):
            return
        self._saved_at = time.monotonic()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            self.trie.save(self.path)
            os.chmod(self.path, 0o600)
            self._dirty = False
        except OSError as e:
            log.warning("cannot save the reply history %s: %s", self.path, e.strerror)

    def close(self) -> None:
        self.save()


def describe(path: Path) -> dict:
    """What `doctor` shows of a history file: where, how large (bytes, trie nodes)."""
    out = {"path": str(path), "exists": path.exists(), "bytes": 0, "nodes": 0}
    if out["exists"]:
        out["bytes"] = path.stat().st_size
        try:
            out["nodes"] = TokenTrie.load(path, capacity=CAPACITY).n_nodes
        except (OSError, ValueError, KeyError):
            out["nodes"] = -1
    return out
