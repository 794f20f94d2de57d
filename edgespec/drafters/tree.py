"""Draft trees from ranked candidates: top-k expansion, best-first enumeration, and the selection of
the nodes a step may verify (Medusa, the EAGLE head and trained MTP in heads.py, EAGLE-3's tree).

A tree is built as a flat list of nodes `(path probability, parent index or -1, token, estimate)`,
parents listed before their children: the path probability is the calibrated chance that the
path to the node is accepted (a parent's times the node's conditional), so a parent always ranks
above its children and any best-first prefix of the nodes is a tree. The selection keeps such a
prefix within the step's rows and branches; the scheduler then sizes it on the cost curve
(`base.sized`) and the kept nodes are laid out in preorder.
"""

from __future__ import annotations

import heapq

import numpy as np

from ..draft import Draft
from .base import Budget, Candidates

Node = tuple[float, int, int, float]  # (path probability, parent index or -1, token, estimate)


def top(p: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest entries of `p`, largest first."""
    k = min(k, len(p))
    idx = np.argpartition(-p, k - 1)[:k]
    return idx[np.argsort(-p[idx])]


def softmax_top(logits: np.ndarray, ids: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k likeliest of `ids` and their probabilities, softmax over `logits[ids]` only (a
    draft vocabulary within the target's)."""
    sub = logits[ids]
    m = float(sub.max())
    e = np.exp(sub - m)
    z = float(e.sum())
    best = top(sub, k)
    return ids[best], e[best] / z


def beam(nodes: list[Node], frontier: list[int], width: int, is_stop=None) -> list[int]:
    """The `width` likeliest nodes of `frontier` to expand next (EAGLE-2's dynamic tree); an end
    of generation is a leaf: nothing after it could be kept."""
    if is_stop is not None:
        frontier = [i for i in frontier if not is_stop(nodes[i][2])]
    return sorted(frontier, key=lambda i: -nodes[i][0])[:width]


def best_first(choices: list[list[tuple[int, float]]], limit: int, is_stop=None) -> list[Node]:
    """Paths through per-depth choice lists in decreasing product order (each node's parent comes
    first): the sparse tree of Medusa, built from the heads' own probabilities. A node whose
    token `is_stop` (an end of generation) gets no children."""
    out: list[Node] = []
    heap = [(-choices[0][0][1], (0,), -1)]  # (-path prob, choice indices, parent node index)
    while heap and len(out) < limit:
        negp, path, parent = heapq.heappop(heap)
        d, j = len(path) - 1, path[-1]
        tok, cond = choices[d][j]
        me = len(out)
        out.append((-negp, parent, tok, cond))
        if j + 1 < len(choices[d]):  # the next sibling
            sib = choices[d][j + 1][1]
            parent_p = -negp / cond if cond > 0 else 0.0
            heapq.heappush(heap, (-parent_p * sib, path[:-1] + (j + 1,), parent))
        if d + 1 < len(choices) and not (is_stop is not None and is_stop(tok)):  # the best child
            heapq.heappush(heap, (negp * choices[d + 1][0][1], path + (0,), me))
    return out


def select(nodes: list[Node], budget: Budget, name: str, per_node: float = 0.0, is_stop=None) -> Candidates:
    """The most likely nodes within the budget's rows and branches, best first, for the
    scheduler to size. A node whose token `is_stop` (an end of generation) is left out: where
    the target ends there, the row of its parent yields the end token as the step's own, so its
    row would buy nothing."""
    order = sorted(range(len(nodes)), key=lambda i: (-nodes[i][0], i))
    kept: list[int] = []
    index: dict[int, int] = {}
    has_child: set[int] = set()
    leaves = 0
    for i in order:
        if len(kept) >= budget.max_nodes:
            break
        parent = nodes[i][1]
        if parent >= 0 and parent not in index:
            continue  # its parent was cut: it cannot be verified
        if is_stop is not None and is_stop(nodes[i][2]):
            continue
        new_leaf = parent < 0 or parent in has_child
        if new_leaf and leaves >= budget.max_branches:
            continue
        leaves += new_leaf
        if parent >= 0:
            has_child.add(parent)
        index[i] = len(kept)
        kept.append(i)
    return Candidates([nodes[i][0] for i in kept], lambda n: layout(nodes, kept[:n], name), per_node)


def layout(nodes: list[Node], kept: list[int], name: str) -> Draft:
    """Nodes `kept` (a best-first prefix) as a Draft in depth-first preorder, likelier children
    first: the KV cache keeps the accepted nodes of the first branch in place only when that
    branch's nodes come first."""
    if not kept:
        return Draft()
    keep = set(kept)
    kids: dict[int, list[int]] = {}
    for i in kept:
        kids.setdefault(nodes[i][1] if nodes[i][1] in keep else -1, []).append(i)
    order_out: list[int] = []
    stack = list(reversed(kids.get(-1, [])))
    while stack:
        i = stack.pop()
        order_out.append(i)
        stack.extend(reversed(kids.get(i, [])))
    pos = {i: n for n, i in enumerate(order_out)}
    return Draft([nodes[i][2] for i in order_out], [pos.get(nodes[i][1], -1) for i in order_out], source=name,
                 est=[nodes[i][3] for i in order_out])
