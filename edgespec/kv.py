"""The one place that moves KV positions: token count and KV position change together.

`KVSeq.tokens[i]` sits at position i of its sequence (0 unless the context holds several).
Tokens that are committed but not yet in the cache (the last sampled token, or verified tree
tokens that must be re-laid) are `pending`: the next decode carries them first. Tree branches
borrow sequence ids 1..B-1 for one decode only. `decode_chains` scores several sequences, each
with its own chain draft, in one decode (batch mode).
"""

from __future__ import annotations

from dataclasses import dataclass

from .draft import Draft
from .errors import ContextFullError, EdgespecError
from .llama import Context


def common_prefix(mine: list[int], tokens: list[int]) -> int:
    """Length of the longest common prefix of two token lists (slice compares run in C)."""
    lo, hi = 0, min(len(tokens), len(mine))
    if mine[:hi] == tokens[:hi]:
        return hi
    hi -= 1  # the answer is the largest matching length in [lo, hi]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if mine[:mid] == tokens[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass
class TreeLayout:
    """Row bookkeeping of one tree decode."""

    n_pending: int
    base: int  # KV length before the decode
    in_seq0: list[bool]  # per draft node: does it lie on branch 0 (the first path)?
    n_branches: int

    def row(self, node: int) -> int:
        """Output row of a draft node; node -1 is the root (the last pending token)."""
        return self.n_pending + node


class KVSeq:
    def __init__(self, ctx: Context, seq: int = 0):
        """`seq`: this sequence's id; other than 0 only in a context of one stream per sequence,
        where several KVSeqs share the context and each may clear only its own cells."""
        self.ctx = ctx
        self.seq = seq
        self.capacity = ctx.n_ctx_seq
        self.tokens: list[int] = []

    @property
    def n(self) -> int:
        return len(self.tokens)

    def room(self) -> int:
        return self.capacity - len(self.tokens)

    def reset(self) -> None:
        if self.ctx.n_ctx_seq == self.ctx.n_ctx:
            self.ctx.mem_clear()
        else:
            self.ctx.mem_seq_rm(self.seq, -1, -1)
        self.tokens = []

    def save_state(self) -> bytearray:
        """A copy of this sequence's cells (`restore_state` loads it back, in any sequence of a
        context of the same model and KV type)."""
        return self.ctx.state_seq_get(self.seq)

    def restore_state(self, tokens: list[int], data: bytearray) -> bool:
        """Make the cache hold `tokens`, from a copy `save_state` made when it held them. The
        cells land at the start of this sequence's cells, in position order, as reading the
        tokens would lay them. False (the cache then empty) when llama.cpp refuses the copy."""
        self.reset()
        if not tokens:
            return True
        if not self.ctx.state_seq_set(data, self.seq) or self.ctx.mem_seq_pos_max(self.seq) != len(tokens) - 1:
            self.reset()
            return False
        self.tokens = list(tokens)
        return True

    def truncate(self, n: int) -> None:
        if n >= len(self.tokens):
            return
        if not self.ctx.mem_seq_rm(self.seq, n, -1):
            # A cache that cannot drop a tail (recurrent state) starts again from empty.
            keep = self.tokens[:n]
            self.reset()
            self.extend(keep, want_logits=False)
            return
        del self.tokens[n:]

    def common_prefix(self, tokens: list[int]) -> int:
        """Length of the longest common prefix of the cache and `tokens`."""
        return common_prefix(self.tokens, tokens)

    def keep_prefix(self, tokens: list[int], limit: int | None = None) -> int:
        """Keep the cells of the longest common prefix of the cache and `tokens` (at most
        `limit` of them), drop the rest: a prompt then reads only what follows. Returns the
        cells kept."""
        n = self.common_prefix(tokens)
        if limit is not None:
            n = max(0, min(n, limit))
        if n == 0:
            self.reset()
        else:
            self.truncate(n)
        return n

    def settle(self, tokens: list[int], max_rows: int) -> int:
        """Make the cache hold exactly `tokens` (a finished generation's committed text but its
        last token), whatever the drafter left: cells past them are dropped, committed tokens
        not yet in the cache (re-laid tree nodes) are decoded, at most `max_rows` per decode
        (rows the exactness probe found bit-identical to one-row decodes). The cache then ends
        where plain decoding's would, so the next prompt's read does not depend on the drafter.
        Returns the tokens decoded."""
        keep = self.keep_prefix(tokens)
        step = max(1, max_rows)
        for s in range(keep, len(tokens), step):
            self.extend(tokens[s : s + step], want_logits=False)
        return len(tokens) - keep

    def sync(self, tokens: list[int]) -> tuple[int, int]:
        """Make the cache hold exactly `tokens` (a drafter's own cache following the committed
        text): keep the common prefix, drop the rest, decode what is new. The last token is
        always decoded again, for its logits. Returns (its output row, tokens decoded)."""
        if not tokens:
            raise EdgespecError("internal: sync needs at least one token")
        keep = min(self.common_prefix(tokens), len(tokens) - 1)
        self.truncate(keep)
        return self.extend(tokens[keep:]), len(tokens) - keep

    def extend(self, new: list[int], want_logits: bool = True, all_rows: bool = False,
               on_hidden=None, on_rows=None) -> int | None:
        """Decode `new` after the cache in chunks; return the output row of the last token.

        `all_rows` asks logits for every row (one chunk only: used by the cost probes).
        `on_hidden(hidden, pos)` receives the hidden states of every row, chunk by chunk (heads
        that read the whole prompt's features; the context's embeddings must be on).
        `on_rows(pos, rows)` receives each chunk's batch rows right after its decode, without
        asking outputs for them (MTP reads the target's nextn states, kept for every row)."""
        if len(self.tokens) + len(new) > self.capacity:
            raise ContextFullError(
                f"{len(self.tokens) + len(new)} tokens do not fit in a context of {self.capacity} (raise -c)"
            )
        step = self.ctx.n_batch
        if all_rows and len(new) > step:
            raise EdgespecError("internal: all_rows needs a batch that fits in one decode")
        row = None
        for s in range(0, len(new), step):
            chunk = new[s : s + step]
            last = s + step >= len(new)
            base = len(self.tokens)
            # layer-input taps (EAGLE-3) exist for every row of a decode; the post-norm hidden
            # state only for output rows, which also cost a row of logits each
            outputs = [all_rows or (on_hidden is not None and not self.ctx.taps)] * len(chunk)
            if last and want_logits:
                outputs[-1] = True
                row = len(chunk) - 1
            ids = None if self.seq == 0 else [(self.seq,)] * len(chunk)
            self.ctx.decode(chunk, list(range(base, base + len(chunk))), ids, outputs)
            self.tokens.extend(chunk)
            if on_hidden is not None:
                on_hidden(self.ctx.hidden(list(range(len(chunk)))), base)
            if on_rows is not None:
                on_rows(base, list(range(len(chunk))))
        return row

    def decode_tree(self, pending: list[int], draft: Draft) -> TreeLayout:
        """Score pending tokens plus a draft tree in ONE decode.

        Every leaf is a branch with its own sequence id (leaf 0 keeps id 0); a node carries the ids
        of all branches through it, and llama.cpp masks each row to the cells of its first id, so
        each token attends to the prompt, the pending tokens and its own ancestors only.
        """
        if not pending:
            raise EdgespecError("internal: a decode needs at least one pending token")
        n_nodes = len(draft.tokens)
        base = len(self.tokens)
        if base + len(pending) + n_nodes > self.ctx.n_ctx:
            raise ContextFullError(f"context full ({self.ctx.n_ctx} tokens)")
        if not n_nodes:  # a plain step (most steps where nothing is drafted)
            n = len(pending)
            self.ctx.decode(pending, list(range(base, base + n)), None, [False] * (n - 1) + [True])
            return TreeLayout(n, base, [], 1)
        leaves = draft.leaves() if n_nodes else []
        n_br = max(1, len(leaves))
        if n_br > self.ctx.cfg.n_seq_max:
            raise EdgespecError(f"internal: {n_br} branches exceed n_seq_max={self.ctx.cfg.n_seq_max}")
        node_ids: list[list[int]] = [[] for _ in range(n_nodes)]
        for b, leaf in enumerate(leaves):
            node = leaf
            while node >= 0:
                node_ids[node].append(b)
                node = draft.parents[node]
        all_ids = tuple(range(n_br))
        for b in range(1, n_br):
            self.ctx.mem_seq_cp(0, b, -1, -1)
        depths = draft.depths()
        root_pos = base + len(pending) - 1
        tokens = list(pending) + list(draft.tokens)
        positions = list(range(base, base + len(pending))) + [root_pos + d for d in depths]
        seq_ids = [all_ids] * len(pending) + [tuple(ids) for ids in node_ids]
        outputs = [False] * (len(pending) - 1) + [True] * (1 + n_nodes)
        try:
            self.ctx.decode(tokens, positions, None if n_br == 1 else seq_ids, outputs)
        except Exception:
            for b in range(1, n_br):
                self.ctx.mem_seq_rm(b, -1, -1)
            raise
        return TreeLayout(len(pending), base, [0 in ids for ids in node_ids], n_br)

    def commit_tree(self, layout: TreeLayout, pending: list[int], draft: Draft, accepted: list[int]) -> list[int]:
        """Keep pending tokens and the accepted path; return the tokens that are committed but
        not in the cache (to be carried by the next decode, before the new draft).

        Accepted nodes on branch 0 sit in consecutive cells right after the pending tokens and
        are kept. Accepted nodes of another branch are dropped from the cache and re-laid next
        step: keeping them would leave holes, and cells out of position order change the
        floating-point summation order of attention, which breaks bit-exact equality.
        """
        for b in range(1, layout.n_branches):
            self.ctx.mem_seq_rm(b, -1, -1)
        j = 0
        while j < len(accepted) and layout.in_seq0[accepted[j]]:
            j += 1
        keep = layout.base + layout.n_pending + j
        if j < sum(layout.in_seq0):  # cells of branch 0 past the accepted prefix
            self.ctx.mem_seq_rm(0, keep, -1)
        self.tokens.extend(pending)
        self.tokens.extend(draft.tokens[a] for a in accepted[:j])
        return [draft.tokens[a] for a in accepted[j:]]

    def commit_chain(self, pending: list[int], accepted: list[int]) -> None:
        """After `decode_chains`: keep the pending tokens and the accepted draft prefix (the
        first `len(accepted)` draft cells), drop the rest of the draft's cells."""
        keep = len(self.tokens) + len(pending) + len(accepted)
        self.ctx.mem_seq_rm(self.seq, keep, -1)
        self.tokens.extend(pending)
        self.tokens.extend(accepted)


def decode_chains(ctx: Context, items: list[tuple[KVSeq, list[int], list[int]]]) -> list[int]:
    """Score several sequences in ONE decode: for each (kv, pending, chain) the rows are the
    pending tokens then the chain, in the sequence's own id; logits for the last pending token
    and every chain token. Returns each item's root row (its last pending token); chain node i
    is row root + 1 + i.

    In a context with one stream per sequence, llama.cpp computes a decode in one pass only when
    every sequence brings the same number of rows and their ids are consecutive, else in several
    (see `multi.split_passes`): the caller weighs padding against extra passes.
    """
    tokens: list[int] = []
    positions: list[int] = []
    seq_ids: list[tuple[int, ...]] = []
    outputs: list[bool] = []
    roots: list[int] = []
    for kv, pending, chain in items:
        if not pending:
            raise EdgespecError("internal: a decode needs at least one pending token")
        if kv.n + len(pending) + len(chain) > kv.capacity:
            raise ContextFullError(f"context full ({kv.capacity} tokens per sequence)")
        base = kv.n
        roots.append(len(tokens) + len(pending) - 1)
        rows = list(pending) + list(chain)
        tokens.extend(rows)
        positions.extend(range(base, base + len(rows)))
        seq_ids.extend([(kv.seq,)] * len(rows))
        outputs.extend([False] * (len(pending) - 1) + [True] * (1 + len(chain)))
    ctx.decode(tokens, positions, seq_ids, outputs)
    return roots


class SideKV:
    """The KV cache of a drafter's side context that decodes through llama_batch_ext (the MTP
    context, the EAGLE-3 draft): its positions move here, as the target's and the draft model's
    move in `KVSeq`. The drafter lays its own rows (each carries an h row or a feature, which a
    plain batch cannot); what the cache holds past that is cut, copied and cleared only here."""

    def __init__(self, ctx: Context):
        self.ctx = ctx

    def clear(self) -> None:
        """Every sequence emptied."""
        self.ctx.mem_clear()

    def keep(self, n: int, seq: int = 0) -> None:
        """Keep positions 0..n-1 of `seq`: what lies past them goes."""
        self.ctx.mem_seq_rm(seq, n, -1)

    def drop(self, seq: int) -> None:
        """Sequence `seq` emptied (a draft branch no longer needed)."""
        self.ctx.mem_seq_rm(seq, -1, -1)

    def fork(self, src: int, dst: int) -> None:
        """Sequence `dst` also holds every cell of `src` (a branch grows from its parent)."""
        self.ctx.mem_seq_cp(src, dst, -1, -1)

    def end(self, seq: int = 0) -> int:
        """The position after the last one `seq` holds (0 when empty)."""
        return self.ctx.mem_seq_pos_max(seq) + 1
