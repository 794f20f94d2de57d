"""The verifier on toy distributions: greedy walks, and sampling that must follow the target."""

import numpy as np
import pytest
from scipy import stats

from edgespec.draft import Draft
from edgespec.verify import verify_greedy, verify_rejection_chain, verify_sampled_tree


def test_greedy_chain_accepts_longest_matching_prefix():
    d = Draft.chain([5, 6, 7, 8])
    target = {-1: 5, 0: 6, 1: 9, 2: 8, 3: 1}  # mismatch at node 2
    acc, nxt = verify_greedy(d, target.__getitem__)
    assert acc == [0, 1] and nxt == 9


def test_greedy_chain_all_accepted_gives_bonus():
    d = Draft.chain([5, 6])
    acc, nxt = verify_greedy(d, {-1: 5, 0: 6, 1: 42}.__getitem__)
    assert acc == [0, 1] and nxt == 42


def test_greedy_empty_draft_is_plain_step():
    acc, nxt = verify_greedy(Draft(), {-1: 3}.__getitem__)
    assert acc == [] and nxt == 3


def test_greedy_tree_follows_matching_branch():
    # root -> 1 -> 2 ; root -> 3 -> 4 -> 5 ; 3 -> 6
    d = Draft([1, 2, 3, 4, 5, 6], [-1, 0, -1, 2, 3, 2])
    target = {-1: 3, 2: 6, 5: 11}
    acc, nxt = verify_greedy(d, target.__getitem__)
    assert acc == [2, 5] and nxt == 11


def _tv(counts: np.ndarray, p: np.ndarray) -> float:
    return 0.5 * np.abs(counts / counts.sum() - p).sum()


P0 = np.array([0.5, 0.2, 0.2, 0.1])
P1 = np.array([0.1, 0.6, 0.1, 0.2])
P2 = np.array([0.25, 0.25, 0.25, 0.25])
Q0 = np.array([0.1, 0.7, 0.1, 0.1])
Q1 = np.array([0.4, 0.2, 0.3, 0.1])


def _chisq_ok(counts: np.ndarray, p: np.ndarray) -> bool:
    mask = p > 0
    assert counts[~mask].sum() == 0, "a token with target probability 0 was emitted"
    res = stats.chisquare(counts[mask], p[mask] / p[mask].sum() * counts.sum())
    return res.pvalue > 1e-3


@pytest.mark.parametrize("seed", [0, 1])
def test_rejection_chain_first_token_follows_target(seed):
    """Draft tokens sampled from q; the first committed token must be distributed as p, covering
    acceptance, the residual draw (rejection) and the bonus draw (all accepted)."""
    rng = np.random.default_rng(seed)
    n = 20000
    first = np.zeros(4)
    second = np.zeros(4)
    target = {-1: P0, 0: P1, 1: P2}
    n_rej = n_bonus = 0
    for _ in range(n):
        x0 = rng.choice(4, p=Q0)
        x1 = rng.choice(4, p=Q1)
        d = Draft.chain([int(x0), int(x1)], probs=[Q0, Q1])
        acc, nxt = verify_rejection_chain(d, target.__getitem__, rng)
        out = [d.tokens[i] for i in acc] + [nxt]
        first[out[0]] += 1
        if len(out) > 1 and out[0] == 1:
            second[out[1]] += 1  # conditional on the first token being 1, as p at row 0 says
        n_rej += len(acc) < 2
        n_bonus += len(acc) == 2
    assert n_rej > 1000 and n_bonus > 1000  # both paths exercised
    assert _chisq_ok(first, P0)
    assert _chisq_ok(second, P1)
    assert _tv(first, P0) < 0.02


def test_rejection_chain_with_identical_distributions_accepts_all():
    rng = np.random.default_rng(3)
    d = Draft.chain([1, 1], probs=[P1, P1])
    acc, _ = verify_rejection_chain(d, {-1: P1, 0: P1, 1: P1}.__getitem__, rng)
    assert acc == [0, 1]


def test_sampled_tree_follows_target_and_uses_branches():
    """Draft-free trees carry no probabilities: the walk samples from p at each node."""
    rng = np.random.default_rng(7)
    d = Draft([0, 2, 1, 3], [-1, 0, -1, 2])  # two branches: 0->2 and 1->3
    target = {-1: P0, 0: P2, 1: P0, 2: P1, 3: P0}  # keyed by node: node 2 holds token 1
    first = np.zeros(4)
    second_after_1 = np.zeros(4)
    used_branch = {0: 0, 2: 0}
    for _ in range(20000):
        acc, nxt = verify_sampled_tree(d, target.__getitem__, rng)
        out = [d.tokens[i] for i in acc] + [nxt]
        first[out[0]] += 1
        if acc:
            used_branch.setdefault(acc[0], 0)
            used_branch[acc[0]] += 1
        if out[0] == 1:
            second_after_1[out[1]] += 1
    assert _chisq_ok(first, P0)
    assert _chisq_ok(second_after_1, P1)
    assert used_branch[0] > 0 and used_branch[2] > 0


def test_without_bonus_a_fully_accepted_chain_returns_none():
    """PEARL carries the last verdict instead of drawing a bonus token."""
    d = Draft.chain([5, 6])
    assert verify_greedy(d, {-1: 5, 0: 6}.__getitem__, bonus=False) == ([0, 1], None)
    assert verify_greedy(d, {-1: 5, 0: 7}.__getitem__, bonus=False) == ([0], 7)
    rng = np.random.default_rng(0)
    same = Draft.chain([1, 1], probs=[P1, P1])
    assert verify_rejection_chain(same, {-1: P1, 0: P1}.__getitem__, rng, bonus=False) == ([0, 1], None)
