"""The Lookahead trie on hand-written token lists."""

import pytest

from edgespec.drafters.lookahead import _as_tree
from edgespec.trie import OUTPUT, PROMPT, Cursor, TokenTrie, TrieNode


def branches(trie, node):
    return {t: c.count for t, c in node.children.items()}


def test_insertion_counts_every_window_once():
    t = TokenTrie(window=3)
    t.extend([1, 2, 3, 1, 2, 4], PROMPT)
    assert branches(t, t.root) == {1: 2, 2: 2, 3: 1, 4: 1}
    assert branches(t, t.walk([1, 2])) == {3: 1, 4: 1}
    # growing the sequence completes tail windows without counting their prefixes twice
    t.extend([1, 2, 3, 1, 2, 4, 5], OUTPUT)
    assert t.walk([2, 4, 5]).fo == 1 and t.walk([2, 4]).count == 1
    assert t.walk([4]).count == 1 and t.walk([5]).fo == 1


def _dump(trie):
    out, stack = {}, [((), trie.root)]
    while stack:
        path, node = stack.pop()
        for tok, child in node.children.items():
            out[path + (tok,)] = (child.fp, child.fo)
            stack.append((path + (tok,), child))
    return out


def test_growing_token_by_token_counts_as_inserting_every_window():
    import random

    rng = random.Random(7)
    seq = [rng.randrange(6) for _ in range(200)]
    grown, cursor = TokenTrie(window=5), Cursor()
    grown.extend(seq[:40], PROMPT, cursor)
    for n in range(41, len(seq) + 1, rng.choice([1, 1, 2, 3])):
        grown.extend(seq[:n], OUTPUT, cursor)
    grown.extend(seq, OUTPUT, cursor)
    brute = TokenTrie(window=5)
    for i in range(len(seq)):
        # a window's tokens count as prompt up to the prompt's end, as output after it
        for d in range(min(5, len(seq) - i)):
            node = brute.walk(seq[i:i + d]) if d else brute.root
            child = node.children.setdefault(seq[i + d], TrieNode())
            if i + d < 40:
                child.fp += 1
            else:
                child.fo += 1
    assert _dump(grown) == _dump(brute)
    assert grown.n_nodes == len(_dump(brute))


def test_insertion_resumes_after_nodes_were_pruned():
    t, cursor = TokenTrie(window=4), Cursor()
    t.extend([1, 2, 3, 4, 5, 6], PROMPT, cursor)
    t.release_prompt()  # every node goes, the cursor's tail windows with them
    assert t.n_nodes == 0
    t.extend([1, 2, 3, 4, 5, 6, 7], OUTPUT, cursor)
    # the tail windows were found again from the root; only the new token is counted on them
    assert t.walk([4, 5, 6, 7]).fo == 1 and t.walk([4, 5, 6]).fo == 0 and t.walk([7]).fo == 1
    assert t.n_nodes == len(_dump(t))


def test_match_longest_suffix_with_continuation():
    t = TokenTrie(window=4)
    t.extend([7, 8, 9, 7, 8, 5], PROMPT)
    node, s = t.match([1, 7, 8], max_match=3)
    assert s == 2 and branches(t, node) == {9: 1, 5: 1}
    node, s = t.match([42], max_match=3)
    assert node is None and s == 0


def test_multi_branch_retrieval_frequency_ordered_within_budget():
    t = TokenTrie(window=4)
    for seq in ([1, 2, 3], [1, 2, 3], [1, 2, 3], [1, 5, 6], [1, 7]):
        t.insert(seq, PROMPT)
    node = t.walk([1])
    cands = t.candidates(node, max_nodes=4, max_branches=8)
    assert len(cands) == 4
    assert cands[0].token == 2 and cands[0].parent == -1  # most frequent first
    assert [c.path for c in cands] == sorted((c.path for c in cands), reverse=True)
    for i, c in enumerate(cands):
        assert c.parent < i  # parents precede children: any prefix is a tree
    roots = {c.token for c in cands if c.parent == -1}
    assert len(roots) >= 2  # several branches, not only the best chain
    # a tight branch budget keeps one chain
    chain = t.candidates(node, max_nodes=4, max_branches=1)
    assert [c.token for c in chain] == [2, 3]


def test_branches_stop_at_the_end_of_generation():
    """Nothing after an end-of-generation token can be kept, and the token itself needs no row
    (the row before yields it where the target ends), so a branch is drafted up to it, without
    it: a chat prompt's branches run on into the template (end of turn, the next turn's header)."""
    t = TokenTrie(window=6)
    for _ in range(3):
        t.insert([1, 2, 99, 7, 8, 9], PROMPT)
    node = t.walk([1])
    assert [c.token for c in t.candidates(node, 8, 8)] == [2, 99, 7, 8, 9]
    stopped = t.candidates(node, 8, 8, is_stop=lambda tok: tok == 99)
    assert [c.token for c in stopped] == [2]


def test_a_token_that_closes_a_prompt_message_takes_its_own_calibration():
    """A token after which a prompt's message ended (its path went on into the end of turn, 99)
    is priced by `end_calib` and marked; one after which an earlier answer ended is not."""
    t = TokenTrie(window=6)
    t.insert([1, 2, 99], PROMPT)
    t.insert([1, 3, 99], OUTPUT)
    stop = lambda tok: tok == 99  # noqa: E731
    cands = t.candidates(t.walk([1]), 8, 8, lambda d: 1.0, is_stop=stop, ends=(99,), end_calib=lambda d: 0.25)
    by_tok = {c.token: c for c in cands}
    assert by_tok[2].closing and by_tok[2].cond == pytest.approx(0.25 * by_tok[2].raw)
    assert not by_tok[3].closing and by_tok[3].cond == pytest.approx(by_tok[3].raw)
    assert cands[0].token == 3  # the answer's ending, now likelier than the message's
    d, closing = _as_tree(cands, "lookahead")
    assert [d.tokens[i] for i in closing] == [2]


def test_tree_assembly_puts_likeliest_branch_first():
    t = TokenTrie(window=4)
    for seq in ([1, 2, 3], [1, 2, 3], [1, 5, 6]):
        t.insert(seq, PROMPT)
    d, closing = _as_tree(t.candidates(t.walk([1]), 8, 8), "lookahead")
    assert d.tokens[:2] == [2, 3] and d.parents[:2] == [-1, 0]
    assert sorted(d.tokens) == [2, 3, 5, 6] and len(d.leaves()) == 2


def test_release_prompt_keeps_output_branches():
    t = TokenTrie(window=3)
    t.insert([1, 2, 3], PROMPT)
    t.insert([1, 2, 9], OUTPUT)
    t.insert([4, 5], PROMPT)
    before = t.n_nodes
    t.release_prompt()
    assert t.walk([4]) is None and t.walk([1, 2, 3]) is None
    assert t.walk([1, 2, 9]).fo == 1 and t.walk([1]).fp == 0
    assert t.n_nodes == before - 3


def test_prune_at_capacity_drops_least_frequent():
    t = TokenTrie(window=3, capacity=6)
    for _ in range(5):
        t.insert([1, 2, 3], OUTPUT)
    t.insert([7, 8, 9], OUTPUT)
    t.insert([4, 5, 6], OUTPUT)
    assert t.n_nodes == 9
    t.prune(4)
    assert t.n_nodes <= 4
    assert t.walk([1, 2, 3]) is not None and t.walk([7]) is None
    # the automatic path: inserting past capacity prunes
    t2 = TokenTrie(window=4, capacity=20)
    t2.extend(list(range(100)), OUTPUT)
    assert t2.n_nodes <= 20


def test_save_load_round_trip(tmp_path):
    t = TokenTrie(window=5)
    t.extend([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], PROMPT)
    t.insert([1, 4, 1, 8], OUTPUT)
    p = tmp_path / "trie.npz"
    t.save(p)
    u = TokenTrie.load(p)
    assert u.window == 5 and u.n_nodes == t.n_nodes

    def dump(node, prefix=()):
        out = {}
        for tok, c in node.children.items():
            out[prefix + (tok,)] = (c.fp, c.fo)
            out.update(dump(c, prefix + (tok,)))
        return out

    assert dump(u.root) == dump(t.root)


def test_lookahead_probes_only_a_match_length_that_may_recover():
    """Where no draft pays (here verifying k rows costs k plain steps), lookahead drafts nothing,
    and probes with one token after 16 such steps only for a match length whose learned factor
    fell below its prior and whose prior expects the token: never after a one-token match."""
    from conftest import GREEDY
    from edgespec.costmodel import KS, CostModel
    from edgespec.drafters.base import Budget, Calibration, sized
    from edgespec.drafters.lookahead import LookaheadDrafter

    steep = CostModel(KS, tuple(0.01 * k for k in KS), online=False)
    budget = Budget(max_nodes=8, max_branches=1, fixed_rows=1, cost=steep, sampling=GREEDY)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]

    def drafts(context, calib=None):
        d = LookaheadDrafter(window=8, calib=calib)
        d.begin(prompt)
        return [len(sized(d.propose(context, budget), budget)) for _ in range(40)]

    assert drafts(prompt + [40, 5]) == [0] * 40  # one matched token: the prior expects 20%
    assert drafts(prompt + [1, 2, 3, 4, 5]) == [0] * 40  # five, but nothing learned against them
    depressed = {s: Calibration(prior=0.5) for s in range(1, 9)}
    sizes = drafts(prompt + [1, 2, 3, 4, 5], depressed)
    assert sizes[:15] == [0] * 15 and sizes[15] == 1 and sum(sizes) == 2  # every 16th step


def test_match_from_the_cursor_is_the_match_from_the_root():
    """The cursor's window ends are the context's suffix nodes: matching from them finds what
    walking every suffix from the root finds, also after nodes were released."""
    import random

    rng = random.Random(11)
    for trial in range(30):
        t, cur = TokenTrie(window=6), Cursor()
        seq = [rng.randrange(5) for _ in range(120)]
        t.extend(seq[:30], PROMPT, cur)
        n = 30
        while n < len(seq):
            n += rng.choice([1, 1, 2, 4])
            t.extend(seq[:n], OUTPUT, cur)
            for m in (1, 3, 8):
                assert t.match(seq[:n], m, cur) == t.match(seq[:n], m)
            if rng.random() < 0.05:
                t.release_prompt()  # the cursor is stale until the next extend
                assert t.match(seq[:n], 8, cur) == t.match(seq[:n], 8)


def test_lookahead_skips_the_expansion_only_where_no_draft_would_pay():
    """Every path below a match is at most as likely as its best first token, so where `limit`
    nodes that likely would not pay, the full candidate list does not either."""
    import random

    from conftest import GREEDY
    from edgespec.costmodel import KS, CostModel
    from edgespec.drafters.base import Budget

    rng = random.Random(5)
    cm = CostModel(KS, tuple(0.01 * (1 + 0.4 * (k - 1) ** 0.9) for k in KS), online=False)
    skipped = 0
    for trial in range(300):
        t = TokenTrie(window=8)
        t.extend([rng.randrange(rng.choice([3, 6, 20])) for _ in range(200)], PROMPT)
        node = rng.choice(list(t.root.children.values()))
        while node.children and rng.random() < 0.6:
            node = rng.choice(list(node.children.values()))
        if not node.children:
            continue
        f = rng.uniform(0.2, 1.5)
        b = Budget(max_nodes=32, max_branches=rng.choice([1, 4, 8]), fixed_rows=1, cost=cm, sampling=GREEDY,
                   n_past=rng.randrange(1000))
        bound = b.size([min(1.0, f * t.best_share(node))] * b.max_nodes)
        cands = t.candidates(node, b.max_nodes, b.max_branches, lambda d: f)
        assert cands[0].raw == t.best_share(node)
        if bound == 0:
            skipped += 1
            assert b.size([c.path for c in cands]) == 0
    assert 20 < skipped < 280  # both sides were exercised


def test_lookahead_prices_a_message_end_apart_and_learns_it_apart():
    """A prompt whose message ends after token 6 (99: end of turn): after a 5-token match the
    trie's 6 is priced by the calibration of message ends (prior 0.3) and not drafted where the
    same match elsewhere is; when it is drafted, what the target did teaches that calibration,
    not the match length's."""
    from conftest import GREEDY
    from edgespec.costmodel import KS, CostModel
    from edgespec.drafters.base import Budget, sized
    from edgespec.drafters.lookahead import CLOSING, LookaheadDrafter

    cheap = CostModel(KS, tuple(0.01 * (1 + 0.3 * (k - 1)) for k in KS), online=False)
    budget = Budget(max_nodes=8, max_branches=1, fixed_rows=1, cost=cheap, sampling=GREEDY)
    stop = lambda tok: tok == 99  # noqa: E731
    prompt = [1, 2, 3, 4, 5, 6, 99, 50, 1, 2, 3, 4, 5, 7, 8]
    d = LookaheadDrafter(window=8, is_stop=stop)
    d.begin(prompt)
    mid = sized(d.propose(prompt + [1, 2, 3, 4, 5], budget), budget)  # 6 (the message's end) or 7: seen once each
    assert mid.tokens[:1] == [7] and 6 not in mid.tokens
    lone = LookaheadDrafter(window=8, is_stop=stop)
    lone.begin([1, 2, 3, 4, 5, 6, 99])
    assert sized(lone.propose([1, 2, 3, 4, 5, 6, 99, 30, 1, 2, 3, 4, 5], budget), budget).tokens == []
    # forced: the node is drafted and rejected; only the calibration of message ends learns it
    before = {s: c.factor(1) for s, c in lone.calib.items()}
    forced = Budget(max_nodes=8, max_branches=1, fixed_rows=1, cost=cheap, sampling=GREEDY, n_min=1)
    draft = sized(lone.propose([1, 2, 3, 4, 5, 6, 99, 30, 1, 2, 3, 4, 5], forced), forced)
    assert draft.tokens == [6] and lone._closing == [0]
    lone.accept(draft, [], [31])
    after = {s: c.factor(1) for s, c in lone.calib.items()}
    assert after[CLOSING] < before[CLOSING]
    assert all(after[s] == pytest.approx(before[s]) for s in before if s != CLOSING)
