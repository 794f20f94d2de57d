"""EAGLE-3 drafting with llama.cpp's own `eagle3` graph (`--spec eagle3 --heads DRAFT.gguf`).

The draft is llama.cpp's eagle3 GGUF (`edgespec convert eagle3`, or llama.cpp's own converter),
loaded as a model of its own, with a context that borrows the target's token embeddings and LM
head through `ctx_other` (llama.cpp keeps it only when the file lacks them). It is driven the way
`common/speculative.cpp` drives `draft-eagle3`:

* The target records the inputs of three of its layers (`taps`, the file's
  `target_layers`) for every decoded row; the scheduler hands them to `observe`.
* `observe` runs the draft's ENCODER over those rows: g[P] = fc(taps at position P).
* The draft's decoder reads (token, g) pairs, the pair at draft position P being
  (token[P+1], g[P]). The pair at the last observed position waits for the token after it, which
  is the committed token `propose` sees (the doc calls it deferred); `propose` decodes every pair
  still missing in one batch, and that row's logits propose the first draft token.
* Each further draft token is decoded with the decoder's own pre-norm output of its parent as g.

The draft's logits come over the full target vocabulary with -inf outside the draft vocabulary
(d2t), so nothing is mapped here. Draft rows never stay in the draft's KV cache: every proposal
first drops everything after the committed pairs (llama_memory_seq_rm).

Trees (EAGLE-2 style): each depth decodes the `beam` likeliest frontier nodes in one batch, each
in a sequence id of its own whose cells are the committed pairs plus its ancestors (a metadata
copy in the unified cache); the whole tree is then reranked (`tree.select`), and the scheduler
cuts it by the cost curve. The
verifier walks the tree by sampling the target (`probs=None`), so any tree keeps sampling exact:
the drafter only proposes.
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

import llama_cpp as lc

from .. import llama_ext
from ..draft import Draft
from ..errors import EdgespecError, VocabMismatchError
from ..heads.format import HeadsError
from ..kv import SideKV, common_prefix
from ..llama import DEFAULT_KV, Context, ContextConfig, Model, last_log_error
from .base import LAYER_TAPS, Budget, Calibration, Proposal, TokenTimed
from .tree import beam, select, softmax_top

# GGUF architectures whose llama.cpp graph records layer inputs (`res->t_layer_inp[il]`, grep
# `t_layer_inp\[` in src/models/ of llama.cpp 0.3.36): only these can feed an EAGLE-3 draft. On
# any other, enabling a tap aborts the process ("layer input tensor is null").
LAYER_INPUT_ARCHS = frozenset({
    "llama", "qwen3", "qwen3moe", "qwen35", "qwen35moe", "qwen3next", "qwen4exp", "gpt-oss", "lfm2",
    "minimax-01", "minimax-m2", "nanbeige", "hunyuan_vl", "mimo2", "gemma4", "bailingmoe3", "nemotron_h",
    "deepseek4", "muse-glimmer",
})

_F = ctypes.POINTER(ctypes.c_float)
_ENCODE, _DECODE = lc.LLAMA_PROCESS_TYPE_ENCODE, lc.LLAMA_PROCESS_TYPE_DECODE
_ALL_OUTPUT_FLOATS = 1 << 20  # logits a catch-up may copy out rather than decode its last pair alone


class Eagle3Runtime:
    """The draft model, its context (partnered with one target context) and a reusable
    llama_batch_ext: made once per engine target context, shared by its generations. A side
    context bound to the target's context (`edgespec.side`): its draft context reads the target's
    through ctx_other, so it is closed before that context is swapped or freed."""

    bound = True

    def __init__(self, target: Model, target_ctx: Context, path: str | Path, n_gpu_layers: int = 0,
                 threads: int = 0, kv_type: str = DEFAULT_KV, n_seq_max: int = 9):
        self.path = Path(path)
        if target.arch not in LAYER_INPUT_ARCHS:
            raise HeadsError(f"EAGLE-3 needs the target's layer inputs, which llama.cpp records only for "
                             f"{', '.join(sorted(LAYER_INPUT_ARCHS))}; {target.path.name} is {target.arch}")
        self.target, self.target_ctx = target, target_ctx
        model = Model(self.path, n_gpu_layers)
        try:
            self._check(model, target)
            # common/speculative.cpp sizes the draft context as the target's; Context would cap
            # it at the draft's training length (EAGLE-3 configs often say 2048).
            saved, model.n_ctx_train = model.n_ctx_train, 0
            try:
                self.ctx = Context(model, ContextConfig(target_ctx.n_ctx, target_ctx.n_batch, threads, n_seq_max,
                                                        kv_type, other=int(target_ctx.ptr)))
            finally:
                model.n_ctx_train = saved
        except Exception:
            model.close()
            raise
        self.model = model
        self.kv = SideKV(self.ctx)
        self.H = model.n_embd
        self.n_enc = 3 * target.n_embd
        self.n_seq_max = n_seq_max
        llama_ext.fn("set_embeddings_nextn")(self.ctx.ptr, True, True)
        self.batch = lc.llama_batch_ext_init(self.ctx.ptr)
        if not self.batch:
            self.close()
            raise EdgespecError("cannot allocate a llama_batch_ext for the EAGLE-3 draft")
        self._ids: np.ndarray | None = None  # target ids the draft can propose (finite logits)
        # the committed text (a generation's context list) whose first n_dec pairs the cache holds
        self.committed: list[int] | None = None
        self.n_dec = 0
        self._pos = lc.llama_pos(0)
        self._pos_ref = ctypes.byref(self._pos)

    def _check(self, model: Model, target: Model) -> None:
        name = self.path.name
        if model.arch != "eagle3":
            raise HeadsError(f"{name} is not an EAGLE-3 draft (architecture {model.arch}); convert a checkpoint "
                             f"with `edgespec convert eagle3`")
        n = int(llama_ext.fn("model_target_layer_ids_n")(model.ptr))
        ptr = llama_ext.fn("model_target_layer_ids")(model.ptr)
        taps = tuple(int(ptr[i]) for i in range(n))
        if n != 3 or not all(0 <= t < target.n_layer for t in taps):
            raise HeadsError(f"{name} taps target layers {list(taps)}, which {target.path.name} "
                             f"({target.n_layer} layers) does not record")
        self.taps = taps
        ht = model.meta("eagle3.target_hidden_size")
        made_for = model.meta("edgespec.heads.target") or "another model"
        if ht is None or int(ht) != target.n_embd:
            raise HeadsError(f"{name} was made for {made_for} (hidden size {ht}), not for {target.path.name} "
                             f"(hidden size {target.n_embd})")
        if model.n_vocab != target.n_vocab:
            raise HeadsError(f"{name} was made for {made_for} (vocabulary size {model.n_vocab}), not for "
                             f"{target.path.name} (vocabulary size {target.n_vocab})")
        from ..gguf_check import compare_vocab, tensor_location

        try:
            compare_vocab(target.info, model.info)
        except VocabMismatchError as e:
            raise HeadsError(f"{name} was made for {made_for}, not for {target.path.name}: {e}") from None
        # What llama.cpp would otherwise abort on (a ggml shape assertion) when it borrows the
        # target's tensors: embeddings of another width, an LM head over another vocabulary.
        has = lambda t: tensor_location(self.path, t) is not None  # noqa: E731
        if model.n_embd != target.n_embd and not has("token_embd.weight"):
            raise HeadsError(f"{name}: draft hidden size {model.n_embd} differs from {target.path.name}'s "
                             f"{target.n_embd}, and the draft has no token embeddings of its own")
        if has("d2t") and not has("output.weight"):
            raise HeadsError(f"{name} has a draft vocabulary (d2t) but no LM head of its own")

    # -- llama_batch_ext ------------------------------------------------------------------

    def _add(self, seq: int, pos: int, token: int | None, row_addr: int, width: int, output: bool) -> int:
        b = self.batch
        e = lc.llama_embd(ctypes.cast(row_addr, _F), 1, width)
        if token is None:
            i = lc.llama_batch_ext_add_embd(b, seq, e)
        else:
            i = lc.llama_batch_ext_add_token(b, seq, token)
            if i >= 0 and not lc.llama_batch_ext_set_embd_token(b, i, e):
                i = -2
        if i < 0:
            lc.llama_batch_ext_clear(b)
            raise EdgespecError(f"internal: EAGLE-3 batch refused a row (code {i}): {last_log_error()}")
        self._pos.value = pos
        lc.llama_batch_ext_set_pos(b, i, self._pos_ref)
        if output:
            lc.llama_batch_ext_set_output_logits(b, i, True)
        return i

    def _process(self, kind: int) -> bool:
        """One llama_process; False when the draft's cache is full (no draft this step)."""
        rc = lc.llama_process(self.ctx.ptr, kind, self.batch)
        lc.llama_batch_ext_clear(self.batch)
        if rc == 1:
            return False
        if rc != 0:
            raise EdgespecError(f"EAGLE-3 draft: llama_process failed with code {rc}: {last_log_error()}")
        return True

    # -- the graph ------------------------------------------------------------------------

    def encode(self, feats: np.ndarray) -> np.ndarray:
        """g = fc(taps) for rows `feats` [n, 3*Ht] (the encoder keeps no state)."""
        feats = np.ascontiguousarray(feats, np.float32)
        if feats.shape[1] != self.n_enc:
            raise EdgespecError(f"internal: EAGLE-3 features of width {feats.shape[1]}, expected {self.n_enc}")
        out = np.empty((len(feats), self.H), np.float32)
        step = self.ctx.n_batch  # the encoder needs the whole batch in one ubatch (n_ubatch = n_batch)
        base = feats.ctypes.data
        row_bytes = self.n_enc * 4
        get = llama_ext.fn("get_embeddings_nextn")
        for s in range(0, len(feats), step):
            n = min(step, len(feats) - s)
            # The encoder is per token and ignores positions, but the batch check still wants
            # them to continue sequence 0's cache (Y = X + 1): placeholders, as speculative.cpp.
            p0 = self.kv.end(0)
            for j in range(n):
                self._add(0, p0 + j, None, base + (s + j) * row_bytes, self.n_enc, True)
            if not self._process(_ENCODE):
                raise EdgespecError(f"EAGLE-3 draft: the encoder failed: {last_log_error()}")
            out[s : s + n] = np.ctypeslib.as_array(get(self.ctx.ptr), shape=(n, self.H))
        return out

    def decode(self, rows: list[tuple[int, int, int, int]]) -> bool:
        """One decoder batch of (seq, pos, token, address of its g row); every row gives
        logits and its pre-norm output. False when the cache is full."""
        for seq, pos, tok, addr in rows:
            self._add(seq, pos, tok, addr, self.H, True)
        return self._process(_DECODE)

    def catch_up(self, pairs: list[int], g: np.ndarray, pos0: int) -> bool:
        """Decode committed pairs (pairs[i], g[i]) at positions pos0.. into sequence 0; the
        last pair's logits and pre-norm output are then at batch row `last_row`.

        llama.cpp 0.3.36's eagle3 decoder graph does not select the output rows (no
        inp_out_ids): with k rows marked it hands back the first k rows of the batch, whichever
        were marked (common/speculative.cpp never meets this: it decodes that pair alone). So a
        short last batch marks every row (the graph computes them all anyway; only the copy of
        their logits is extra: up to 4 MB, much less than a decode), and a long one leaves the
        last pair to a batch of its own."""
        g = np.ascontiguousarray(g, np.float32)
        base, row_bytes = g.ctypes.data, self.H * 4
        n_all = len(pairs)
        step = self.ctx.n_batch
        s = 0
        while s < n_all:
            n = min(step, n_all - s)
            final = s + n == n_all
            if final and n > 1 and n * self.model.n_vocab > _ALL_OUTPUT_FLOATS:
                n -= 1  # this batch without outputs, the last pair alone next
                final = False
            for j in range(s, s + n):
                self._add(0, pos0 + j, pairs[j], base + j * row_bytes, self.H, final)
            if not self._process(_DECODE):
                return False
            s += n
            self.last_row = n - 1
        return True

    def logits(self, row: int) -> np.ndarray:
        return self.ctx.logits(row)

    def prenorm_addr(self, row: int) -> int:
        """Address of the decoder's pre-norm output of batch row `row` (the next step's g);
        valid until the next llama_process, and copied by the batch when added."""
        ptr = llama_ext.fn("get_embeddings_nextn_ith")(self.ctx.ptr, row)
        if not ptr:
            raise EdgespecError(f"internal: no EAGLE-3 pre-norm output for row {row}")
        return ctypes.cast(ptr, ctypes.c_void_p).value

    def prenorm(self, row: int) -> np.ndarray:
        return np.ctypeslib.as_array(ctypes.cast(self.prenorm_addr(row), _F), shape=(self.H,)).copy()

    def draft_ids(self, logits: np.ndarray) -> np.ndarray:
        """The target ids with finite draft logits (d2t): found once, the same for every row."""
        if self._ids is None:
            self._ids = np.flatnonzero(np.isfinite(logits))
        return self._ids

    def reset(self) -> None:
        self.kv.clear()

    def drop_after(self, n: int) -> None:
        """Keep the committed pairs 0..n-1 of sequence 0; forget every draft row and branch."""
        for s in range(1, self.n_seq_max):
            self.kv.drop(s)
        self.kv.keep(n)

    def close(self) -> None:
        if getattr(self, "batch", None):
            lc.llama_batch_ext_free(self.batch)
            self.batch = None
        for obj in (getattr(self, "ctx", None), getattr(self, "model", None)):
            if obj is not None:
                obj.close()

    def __del__(self) -> None:  # pragma: no cover
        try:
            self.close()
        except Exception:
            pass


class Eagle3Drafter(TokenTimed):
    """Proposes a chain (or an EAGLE-2 tree) with llama.cpp's eagle3 graph; see the module doc."""

    name = "eagle3"
    reads = LAYER_TAPS

    def __init__(self, rt: Eagle3Runtime, n_max: int = 16, n_min: int = 0, p_min: float = 0.0,
                 tree: bool = False, top_k: int = 4, beam: int = 4, p_stop: float = 0.02, is_stop=None):
        """`is_stop(token)`: the token ends a generation: a chain ends before it, a tree leaves it
        out (where the target ends there, the row before yields it as the step's own token)."""
        self.rt = rt
        self.is_stop = is_stop
        self.taps = rt.taps
        self.n_max, self.n_min, self.p_min = n_max, n_min, p_min
        self.tree = tree and rt.n_seq_max >= 1 + 2 * beam
        self.top_k, self.beam, self.p_stop = top_k, beam, p_stop
        self.calib = Calibration(prior=1.0)
        self.t_token = 0.0  # seconds per draft decode (EMA)
        self.t_draft = 0.0  # seconds spent drafting in this generation
        self.n_draft = 0
        self.n_gap = 0  # positions whose features never came (see observe; 0 in practice)
        self._g: list[np.ndarray] = []  # g rows of positions n_dec.. not yet in the draft cache
        self._n_dec = 0  # the draft cache holds the committed pairs of positions 0..n_dec-1

    def begin(self, prompt: list[int]) -> None:
        # The draft cache is kept from the engine's last generation where it still holds: pair P
        # (token P+1, g[P]) depends on the tokens up to P+1 only (a conversation's earlier turns).
        rt = self.rt
        j = common_prefix(rt.committed, prompt) if rt.committed is not None else 0
        keep = max(0, min(rt.n_dec, j - 1))
        if keep:
            rt.drop_after(keep)
        else:
            rt.reset()
        rt.committed, rt.n_dec = prompt, keep
        self._g, self._n_dec = [], keep
        self.t_draft, self.n_draft, self.n_gap = 0.0, 0, 0

    def _n_g(self) -> int:
        return self._n_dec + sum(len(g) for g in self._g)

    def observe(self, pos: int, rows: list[int], hidden: np.ndarray | None) -> None:
        g = self.rt.encode(hidden)
        have = self._n_g()
        if pos > have:
            # Positions the scheduler gave no features for. The sequential loop never leaves
            # any (it reports the root and every accepted node, even those it re-lays), but a
            # zero g there would only weaken later drafts, never the output.
            self._g.append(np.zeros((pos - have, self.rt.H), np.float32))
            self.n_gap += pos - have
        elif pos < have:
            if pos < self._n_dec:  # already in the draft cache; keep what is new
                g = g[self._n_dec - pos :]
                pos = self._n_dec
            kept = np.concatenate(self._g)[: pos - self._n_dec] if self._g else np.zeros((0, self.rt.H), np.float32)
            self._g = [kept]
        self._g.append(g)

    def propose(self, context: list[int], budget: Budget) -> Proposal:
        rt = self.rt
        n_ctx = len(context)
        limit = min(self.n_max, budget.max_nodes, rt.ctx.n_ctx - n_ctx)
        if limit <= 0 or limit < self.n_min:
            return Draft()
        if self.n_min == 0 and self.t_token > 0 and budget.gate([1.0] * limit, self.t_token) == 0:
            return Draft()  # even a perfect draft would not pay for its drafting: catch up later
        if self._n_g() < n_ctx - 1:
            return Draft()  # no features for the last committed positions (not observed)
        t0 = time.perf_counter()
        # The committed pairs (context[P+1], g[P]) still missing, up to the one the newest token
        # completes, whose row proposes the first draft token. That last pair is decoded again
        # next time (as common/speculative.cpp does), so it stays in the buffer: a proposal
        # always has a row to start from. Drafts of the last step are dropped first.
        g = np.concatenate(self._g)[: n_ctx - 1 - self._n_dec]
        rt.drop_after(self._n_dec)
        if not rt.catch_up(context[self._n_dec + 1 : n_ctx], g, self._n_dec):
            rt.drop_after(self._n_dec)
            return Draft()
        self._n_dec = n_ctx - 2
        self._g = [g[-1:].copy()]
        rt.committed, rt.n_dec = context, self._n_dec  # grown in place: the pairs' tokens stay valid
        if len(g) <= 2:
            self._time_token(time.perf_counter() - t0)
        if self.tree and budget.max_branches > 1:
            draft = self._tree(rt.last_row, n_ctx - 1, limit, budget)
        else:
            draft = self._chain(rt.last_row, n_ctx - 1, limit, budget)
        self.t_draft += time.perf_counter() - t0
        self.n_draft += 1
        return draft

    def _chain(self, row: int, pos: int, limit: int, budget: Budget) -> Draft:
        """Top-1 tokens one after the other while one more pays (`TokenTimed.gated_chain`)."""
        rt, stop = self.rt, self.is_stop
        x0 = 0

        def top() -> float:
            nonlocal x0
            logits = rt.logits(row)
            ids, p = softmax_top(logits, rt.draft_ids(logits), 1)
            x0 = int(ids[0])
            return float(p[0])

        def draw() -> int | None:
            # an end token needs no row: the row before yields it where the target ends
            return None if stop is not None and stop(x0) else x0

        def advance(x: int, n: int) -> bool:
            nonlocal row
            t0 = time.perf_counter()
            if not rt.decode([(0, pos + n - 1, x, rt.prenorm_addr(row))]):
                return False
            self._time_token(time.perf_counter() - t0)
            row = 0
            return True

        tokens, est, _ = self.gated_chain(budget, limit, self.n_min, self.p_min, top, draw, advance)
        if len(tokens) < max(1, self.n_min):
            return Draft()
        return Draft.chain(tokens, source=self.name, est=est)

    def _tree(self, row: int, pos: int, limit: int, budget: Budget) -> Proposal:
        """EAGLE-2's dynamic tree: expand the `beam` likeliest nodes of each depth in one batch
        (one sequence id per node: the committed pairs plus its ancestors), then rerank."""
        rt = self.rt
        k = self.top_k
        nodes: list[tuple[float, int, int, float]] = []  # (path prob, parent, token, conditional)
        g_of: dict[int, np.ndarray] = {}  # node -> its parent's pre-norm output (its g)
        seq_of: dict[int, int] = {}  # expanded node -> its sequence id
        logits = rt.logits(row)
        ids, p = softmax_top(logits, rt.draft_ids(logits), k)
        g_root = rt.prenorm(row)
        for t, q in zip(ids, p):
            c = min(1.0, float(q) * self.calib.factor(1))
            nodes.append((c, -1, int(t), float(q)))
            g_of[len(nodes) - 1] = g_root
        frontier = list(range(len(nodes)))
        need = max(self.n_min, 1)
        cur: list[int] = []  # sequence ids of the last expanded depth (at most `beam`)
        free = list(range(1, 1 + 2 * self.beam))
        depth = 1
        stop = self.is_stop
        while depth < limit:
            frontier = beam(nodes, frontier, self.beam, stop)
            if not frontier:
                break
            if len(nodes) >= need:
                best = nodes[frontier[0]][0]  # no child of the frontier is likelier than this
                if best < self.p_stop:
                    break
                ranked = sorted((n[0] for n in nodes), reverse=True)
                n_keep = budget.gate(ranked, self.t_token)
                if n_keep == 0 or best < ranked[n_keep - 1]:
                    break  # children would rank below what the cost curve verifies anyway
            # each frontier node gets a fresh sequence: its parent's cells plus itself
            rows = []
            seqs = free[: len(frontier)]
            for s, i in zip(seqs, frontier):
                parent = nodes[i][1]
                rt.kv.fork(0 if parent < 0 else seq_of[parent], s)
                seq_of[i] = s
                rows.append((s, pos + depth - 1, nodes[i][2], g_of[i].ctypes.data))
            t0 = time.perf_counter()
            ok = rt.decode(rows)
            if ok:
                self._time_token(time.perf_counter() - t0)
            for s in cur:  # the previous depth's sequences are no longer needed
                rt.kv.drop(s)
            cur = seqs
            free = [s for s in range(1, 1 + 2 * self.beam) if s not in cur]
            if not ok:
                break
            new = []
            for r, i in enumerate(frontier):
                logits = rt.logits(r)
                ids, p = softmax_top(logits, rt.draft_ids(logits), k)
                g_child = rt.prenorm(r)
                for t, q in zip(ids, p):
                    c = min(1.0, float(q) * self.calib.factor(1))
                    nodes.append((nodes[i][0] * c, i, int(t), float(q)))
                    g_of[len(nodes) - 1] = g_child
                    new.append(len(nodes) - 1)
            frontier = new
            depth += 1
        cands = select(nodes, budget, self.name, self.t_token, is_stop=self.is_stop)
        if not self.n_min:
            return cands
        take = cands.take  # a tree smaller than --spec-draft-n-min is not drafted
        return replace(cands, take=lambda n: d if len(d := take(n)) >= self.n_min else Draft())

    def end(self) -> None:
        pass


def build(engine, heads_path: str | Path, tree: bool | None = None) -> Eagle3Drafter:
    """A drafter for one generation on `engine`'s target context. The draft model and context
    are made once per target context (kept among the engine's side contexts as
    `engine.side["eagle3"]`) and made again when the engine swapped its context (batch streams):
    the draft context points at the target's."""
    c = engine.cfg
    path = Path(heads_path)
    beam = 4
    # f16 cache whatever the target's: the draft's one layer costs little memory, and its
    # exactness does not matter (q8_0 there flips the draft's near-ties a little more often)
    rt = engine.side.keep(
        "eagle3", lambda: Eagle3Runtime(engine.target, engine.ctx, path, c.n_gpu_layers, c.threads_draft or c.threads,
                                        "f16", n_seq_max=1 + 2 * beam),
        fits=lambda rt: rt.target_ctx is engine.ctx and rt.path == path and bool(rt.ctx.ptr) and bool(engine.ctx.ptr))
    if tree is None:
        tree = c.max_branches > 1
    return Eagle3Drafter(rt, n_max=max(1, c.draft_n_max), n_min=c.draft_n_min, p_min=c.draft_p_min, tree=tree,
                         is_stop=engine.target.is_eog)
