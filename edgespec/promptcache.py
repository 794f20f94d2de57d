"""KV reuse between requests: sequence slots that keep what they last held, and a host-RAM prompt
cache of sequences' KV state (`--cache-ram`).

A `SlotTable` places each request in a free slot of the scheduler: preferably the one whose
cache shares the longest prefix with its prompt, among the slots last used under the same
`share` key (an API key: no state crosses keys; a request without one reuses nothing). When a
`PromptCache` holds a longer prefix (an earlier conversation of the same key whose slot was
taken since), its state is copied into the slot (llama.cpp's per-sequence state restore) and
the request reads only the rest. A slot's content is copied to the cache before another
conversation takes most of it. The cache is bounded in bytes and drops its least recently used
entries first; an entry larger than the bound is not kept.

Everything here runs on the engine's thread (the state copies are as slow as memcpy of the
sequence's KV cells); counters are read by the metrics scrape under a lock.
"""

from __future__ import annotations

import logging
import os
import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

from .kv import KVSeq, common_prefix

log = logging.getLogger(__name__)

DEFAULT_MAX = 8 << 30  # the default --cache-ram is a quarter of the available memory, at most this
SAVE_WHEN_LOSING = 0.5  # a slot's content is copied to the cache when a new prompt keeps less than this share of it
MIN_SAVE = 16  # shorter contents are not worth an entry (their prompt reads in one decode)


def default_cache_bytes() -> int:
    """A quarter of the memory available now (MemAvailable), at most 8 GiB."""
    avail = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if not avail:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            avail = 2 << 30
    return min(DEFAULT_MAX, avail // 4)


def cache_bytes(mib: int | None) -> int:
    """`--cache-ram N` (MiB) in bytes; None: the default; 0: off."""
    if mib is None:
        return default_cache_bytes()
    return max(0, int(mib)) << 20


@dataclass
class Entry:
    share: str
    tokens: array  # 'i': 4 bytes a token
    data: bytearray

    @property
    def size(self) -> int:
        return len(self.data) + 4 * len(self.tokens)


class PromptCache:
    """Sequences' KV states in host RAM, by (share key, tokens); LRU within `limit` bytes."""

    def __init__(self, limit: int):
        self.limit = max(0, int(limit))
        self._entries: OrderedDict[int, Entry] = OrderedDict()  # least recently used first
        self._next = 0
        self._lock = threading.Lock()
        self.bytes = 0
        self.hits = 0  # requests restored from here
        self.misses = 0  # requests of a key that found no prefix of their prompt here nor in a slot
        self.evictions = 0  # entries dropped for room
        self.saves = 0

    def __len__(self) -> int:
        return len(self._entries)

    def snapshot(self) -> dict:
        with self._lock:
            return {"limit": self.limit, "bytes": self.bytes, "entries": len(self._entries), "hits": self.hits,
                    "misses": self.misses, "evictions": self.evictions, "saves": self.saves}

    def best(self, share: str, tokens: list[int], limit: int) -> tuple[int | None, int]:
        """The entry of `share` sharing the longest prefix with `tokens` (at most `limit`
        tokens): (its key, the prefix's length), or (None, 0)."""
        want = array("i", tokens)
        best, best_n = None, 0
        for key, e in self._entries.items():
            if e.share != share or not e.tokens or not want or e.tokens[0] != want[0]:
                continue
            n = min(common_prefix(e.tokens, want), limit)
            if n > best_n:
                best, best_n = key, n
        return best, best_n

    def get(self, key: int) -> Entry:
        with self._lock:
            self._entries.move_to_end(key)
            return self._entries[key]

    def covers(self, share: str, tokens: list[int]) -> bool:
        """Does an entry of `share` hold all of `tokens` (and perhaps more)?"""
        want = array("i", tokens)
        for e in self._entries.values():
            if e.share == share and len(e.tokens) >= len(want) and e.tokens[: len(want)] == want:
                return True
        return False

    def put(self, share: str, tokens: list[int], data: bytearray) -> bool:
        """Keep a state; entries of the same key whose tokens it extends are dropped (it holds
        them). False when it is larger than the whole bound."""
        e = Entry(share, array("i", tokens), data)
        if e.size > self.limit:
            return False
        with self._lock:
            for key in [k for k, old in self._entries.items() if old.share == share
                        and len(old.tokens) <= len(e.tokens) and e.tokens[: len(old.tokens)] == old.tokens]:
                self.bytes -= self._entries.pop(key).size
            while self._entries and self.bytes + e.size > self.limit:
                self.bytes -= self._entries.popitem(last=False)[1].size
                self.evictions += 1
            self._entries[self._next] = e
            self._next += 1
            self.bytes += e.size
            self.saves += 1
        return True

    def count(self, hit: bool) -> None:
        with self._lock:
            if hit:
                self.hits += 1
            else:
                self.misses += 1


_NOBODY = object()  # a slot's `share` when its content may not be reused (empty, or keyless)


@dataclass
class _Slot:
    kv: KVSeq
    share: object = _NOBODY
    used: int = 0


@dataclass
class Placement:
    slot: int
    keep: int  # prompt tokens in the slot's cache now (read no more)
    source: str = ""  # "slot", "ram" or "" (nothing reused)


@dataclass
class SlotTable:
    """The scheduler's sequence slots and what each holds. `reuse` off: every request starts
    from an empty cache (as before)."""

    kvs: list[KVSeq]
    reuse: bool = True
    cache: PromptCache | None = None
    slots: list[_Slot] = field(default_factory=list)
    _tick: int = 0

    def __post_init__(self) -> None:
        self.slots = [_Slot(kv) for kv in self.kvs]

    def place(self, free: list[int], share: str | None, prompt: list[int]) -> Placement:
        """Choose a free slot for `prompt` and make its cache hold the longest prefix of it that
        a slot or the RAM cache has (at most all but the last token, which is read again for
        its logits); the rest of the slot's cells are dropped, copied to the RAM cache first
        when they were mostly another conversation's.

        A slot of the same key continues there when the prompt keeps at least half of what it
        holds (a conversation's next turn); a prompt that shares less with every slot (only a
        system prompt, say) takes an empty slot when there is one, else the best of those
        slots (the least recently used among equals)."""
        self._tick += 1
        limit = len(prompt) - 1
        if not self.reuse or share is None:
            i = self._victim(free)
            self._evict(i, share, prompt)
            self.slots[i].kv.reset()
            self.slots[i].share = _NOBODY
            return Placement(i, 0)
        best, best_n = None, 0
        for i in free:
            s = self.slots[i]
            if s.share == share and s.kv.n:
                n = min(s.kv.common_prefix(prompt), limit)
                if n > best_n or (n == best_n and n and s.used < self.slots[best].used):
                    best, best_n = i, n
        empty = [i for i in free if not self._held(i)]
        good = best is not None and best_n >= SAVE_WHEN_LOSING * self.slots[best].kv.n
        key, ram_n = (None, 0)
        if self.cache is not None:
            key, ram_n = self.cache.best(share, prompt, limit)
        if key is not None and ram_n > best_n:
            i = empty[0] if empty else best if best is not None else self._victim(free)
            self._evict(i, share, prompt)
            e = self.cache.get(key)
            s = self.slots[i]
            if s.kv.restore_state(list(e.tokens), e.data):
                s.share, s.used = share, self._tick
                kept = s.kv.keep_prefix(prompt, limit)
                self.cache.count(True)
                return Placement(i, kept, "ram")
            log.warning("llama.cpp refused a cached state: the prompt is read in full")
            s.share = _NOBODY
            self.cache.count(False)
            return Placement(i, 0)
        if self.cache is not None and best_n == 0:
            self.cache.count(False)
        if best is None or best_n == 0 or (not good and empty):
            i = self._victim(free)
            self._evict(i, share, prompt)
            self.slots[i].kv.reset()
            self.slots[i].share, self.slots[i].used = share, self._tick
            return Placement(i, 0)
        s = self.slots[best]
        self._evict(best, share, prompt)
        kept = s.kv.keep_prefix(prompt, limit)
        s.share, s.used = share, self._tick
        return Placement(best, kept, "slot" if kept else "")

    def release(self, i: int, share: str | None, reusable: bool) -> None:
        """A generation in slot `i` ended; `reusable`: its cache holds exactly its committed text
        but the last token (settled); else it was emptied."""
        self._tick += 1
        s = self.slots[i]
        s.used = self._tick
        s.share = share if (reusable and self.reuse and share is not None and s.kv.n) else _NOBODY

    def _held(self, i: int) -> bool:
        """Does slot `i` hold something a later request may reuse?"""
        s = self.slots[i]
        return s.kv.n > 0 and s.share is not _NOBODY

    def _victim(self, free: list[int]) -> int:
        """The free slot to take for another conversation: the first one that holds nothing
        reusable, else the least recently used."""
        return min(free, key=lambda i: (self._held(i), self.slots[i].used if self._held(i) else 0, i))

    def _evict(self, i: int, share: str | None, prompt: list[int]) -> None:
        """Before slot `i` takes `prompt` (of `share`): copy its content to the RAM cache unless
        the prompt continues it (same key, at least half of it kept) or the cache holds it
        already."""
        s = self.slots[i]
        if self.cache is None or not self._held(i) or s.kv.n < MIN_SAVE:
            return
        if s.share == share and s.kv.common_prefix(prompt) >= SAVE_WHEN_LOSING * s.kv.n:
            return
        if self.cache.covers(s.share, s.kv.tokens):
            return
        try:
            data = s.kv.save_state()
        except Exception as e:  # the content is lost, not the request
            log.warning("could not copy a sequence's state to the cache: %s", e)
            return
        self.cache.put(s.share, s.kv.tokens, data)
