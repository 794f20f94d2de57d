"""Drafters that read the target's hidden states: Medusa heads and an EAGLE head.

Both build a tree of candidates with the chance that each path is accepted (the product of the
heads' probabilities along it, calibrated against what the target really accepted), keep the
best nodes (a parent always ranks above its children, so any best-first prefix is a tree:
`tree.select`), and the scheduler sizes them on the cost curve (or `--spec-draft-n-min`). The trees are the same
whatever the target will sample, so the verifier's tree walk keeps sampling exact.

Medusa: head k of the feature that produced the pending token proposes the token k+1 places
after it; a node's children are the next head's top tokens (independent of the node), so the
tree is enumerated best-first over products. EAGLE-2: the head runs autoregressively over its own
predicted features; each depth expands the `beam` most likely nodes into their top tokens, then
the whole tree is reranked.
"""

from __future__ import annotations

import time

import numpy as np

from ..draft import Draft
from ..heads.runtime import EagleHead, MedusaHeads
from ..kv import common_prefix
from .base import ALL_ROWS, LAST_ROW, Budget, Calibration, Candidates, Proposal
from .tree import beam, best_first, select, top


class _HeadsDrafter:
    reads = LAST_ROW
    taps = None

    def __init__(self, top_k: int, is_stop=None):
        self.top_k = top_k
        self.is_stop = is_stop  # is_stop(token): the token ends a generation (no children; `select` leaves it out)
        self.calib = Calibration(prior=0.6)
        self.t_draft = 0.0  # seconds spent drafting in this generation
        self.n_draft = 0  # draft steps

    def begin(self, prompt: list[int]) -> None:
        self.t_draft, self.n_draft = 0.0, 0

    def accept(self, draft: Draft, accepted: list[int], committed: list[int]) -> None:
        self.calib.update(draft, accepted)

    def end(self) -> None:
        pass

    def _cond(self, p: float) -> float:
        return min(1.0, p * self.calib.factor(1))


class MedusaDrafter(_HeadsDrafter):
    name = "medusa"

    def __init__(self, heads: MedusaHeads, top_k: int = 4, max_nodes: int = 64, is_stop=None):
        super().__init__(top_k, is_stop)
        self.heads = heads
        self.max_nodes = max_nodes
        self._last: np.ndarray | None = None

    def observe(self, pos: int, rows: list[int], hidden: np.ndarray | None) -> None:
        self._last = hidden[-1]

    def propose(self, context: list[int], budget: Budget) -> Proposal:
        if self._last is None or budget.max_nodes <= 0:
            return Draft()
        t0 = time.perf_counter()
        probs = self.heads.probs(self._last)  # [n_heads, K]
        choices = []
        for d in range(len(probs)):
            best = top(probs[d], self.top_k)
            choices.append([(int(self.heads.vocab[d].ids[j]), self._cond(float(probs[d][j]))) for j in best])
        nodes = best_first(choices, min(self.max_nodes, budget.max_nodes * 2), self.is_stop)
        cands = select(nodes, budget, self.name, is_stop=self.is_stop)
        self.t_draft += time.perf_counter() - t0
        self.n_draft += 1
        return cands


class EagleDrafter(_HeadsDrafter):
    name = "eagle"
    reads = ALL_ROWS

    def __init__(self, head: EagleHead, top_k: int = 4, beam: int = 4, depth: int = 6, p_stop: float = 0.02,
                 name: str = "eagle", is_stop=None):
        super().__init__(top_k, is_stop)
        self.name = name  # "mtp": the same loop over an MTP module (depth 1: the token after next)
        self.head = head
        self.beam, self.depth, self.p_stop = beam, depth, p_stop
        self._feats: list[np.ndarray] = []
        self._pos0 = 0
        self._kv_order: list[int] = []

    def begin(self, prompt: list[int]) -> None:
        super().begin(prompt)
        # The head's cache is kept from the engine's last generation where it still holds:
        # entry i (token i+1, feature i) depends on the tokens up to i+1 only.
        head = self.head
        j = common_prefix(head.committed, prompt) if head.committed is not None else 0
        head.truncate(j - 1)
        head.committed = prompt
        self._feats, self._pos0 = [], 0

    def observe(self, pos: int, rows: list[int], hidden: np.ndarray | None) -> None:
        if not self._feats:
            self._pos0 = pos
        self._feats.append(hidden)

    def propose(self, context: list[int], budget: Budget) -> Proposal:
        if not self._feats:
            return Draft()
        t0 = time.perf_counter()
        head = self.head
        feats = np.concatenate(self._feats)
        pos0, n = self._pos0, len(feats)
        self._feats = []
        if pos0 < head.n:  # rows the cache has from an earlier generation (reuse)
            feats, pos0 = feats[head.n - pos0 :], head.n
            n = len(feats)
            if not n:
                return Draft()
        if pos0 + n > head.capacity:
            return Draft()
        if pos0 > head.n:
            # Positions the target did not read again (a reused prompt prefix) and this cache
            # lacks (it followed another generation): zero features only weaken the drafts.
            head.commit(context[head.n + 1 : pos0 + 1], np.zeros((pos0 - head.n, feats.shape[1]), np.float32), head.n)
        out = head.commit(context[pos0 + 1 : pos0 + 1 + n], feats, pos0)
        head.committed = context  # grown in place: the entries' tokens stay valid
        if budget.max_nodes <= 0:
            return Draft()
        cands = self._tree(out[-1], pos0 + n, budget)
        self.t_draft += time.perf_counter() - t0
        self.n_draft += 1
        return cands

    def _tree(self, root_feat: np.ndarray, root_pos: int, budget: Budget) -> Candidates:
        """EAGLE-2's dynamic tree from the predicted feature after the last committed token."""
        head, vocab = self.head, self.head.vocab
        self._kv_order = []  # node index of each temporary k/v row
        nodes: list[tuple[float, int, int, float]] = []
        feats: list[np.ndarray] = []  # predicted feature of each node
        ks: list[np.ndarray] = []
        vs: list[np.ndarray] = []
        anc: list[list[int]] = []  # each node's ancestors (node indices), itself excluded
        p = head.probs(root_feat[None])[0]
        for j in top(p, self.top_k):
            c = self._cond(float(p[j]))
            nodes.append((c, -1, int(vocab.ids[j]), c))
            anc.append([])
        frontier = list(range(len(nodes)))
        need = max(budget.n_min, 1)
        stop = self.is_stop
        for depth in range(1, self.depth):
            frontier = beam(nodes, frontier, self.beam, stop)
            if not frontier or (nodes[frontier[0]][0] < self.p_stop and len(nodes) >= need):
                break
            # run the head on the frontier: each row attends to the cache, its ancestors and itself
            toks = [nodes[i][2] for i in frontier]
            parent_feat = np.stack([root_feat if nodes[i][1] < 0 else feats[nodes[i][1]] for i in frontier])
            done = len(ks)  # nodes with k/v so far (all earlier frontiers)
            k_extra = np.stack(ks) if ks else np.zeros((0, head.n_kv, head.hd), np.float32)
            v_extra = np.stack(vs) if vs else np.zeros((0, head.n_kv, head.hd), np.float32)
            kv_index = {i: r for r, i in enumerate(self._kv_order)} if ks else {}
            mask = np.zeros((len(frontier), done + len(frontier)), bool)
            for r, i in enumerate(frontier):
                for a in anc[i]:
                    mask[r, kv_index[a]] = True
                mask[r, done + r] = True
            pos = np.array([root_pos + depth - 1] * len(frontier))
            out, k, v = head.layer(toks, parent_feat, pos, k_extra, v_extra, mask)
            while len(feats) < len(nodes):
                feats.append(None)  # type: ignore[arg-type]
            for r, i in enumerate(frontier):
                feats[i] = out[r]
                ks.append(k[r])
                vs.append(v[r])
                self._kv_order.append(i)
            probs = head.probs(out)
            new = []
            for r, i in enumerate(frontier):
                for j in top(probs[r], self.top_k):
                    c = self._cond(float(probs[r][j]))
                    nodes.append((nodes[i][0] * c, i, int(vocab.ids[j]), c))
                    anc.append(anc[i] + [i])
                    new.append(len(nodes) - 1)
            frontier = new
        return select(nodes, budget, self.name, is_stop=self.is_stop)
