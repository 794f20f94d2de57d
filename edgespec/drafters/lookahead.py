"""Draft-free Lookahead (Zhao et al., KDD 2024): multi-branch drafts from a token trie.

The trie holds n-gram branches of the prompt and of everything generated; each step matches the
longest suffix of the context and proposes a tree of the most frequent continuations, which the
scheduler sizes on the machine's verification cost curve. With `cache_path` the trie lives across
runs: prompt branches are released when a request ends, output branches are saved.

With a `history` (the replies this user received before: edgespec.history) the drafter has a
second source: each step it matches the context in both tries and drafts from the one whose
likeliest next token is the more likely once calibrated, each source with calibrations of its
own, per match length, learned from what the target accepted (`Sources`; kept beside the cost
curve across processes). The reply is added to the history when it ends.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

from ..costcache import load_extra, store_extra
from ..costmodel import CostModel
from ..draft import Draft
from ..history import History
from ..trie import OUTPUT, PROMPT, Cursor, TokenTrie
from .base import NOTHING, Budget, Calibration, Candidates, Proposal

log = logging.getLogger(__name__)

# Branch length in the trie: a match of up to 8 tokens leaves 16 to draft (llama-lookup drafts up
# to 16 too); measured on the rag prompts, 16 gave a mean accepted length of 2.9, 24 of 3.5.
WINDOW = 24


class LookaheadDrafter:
    name = "lookahead"
    reads = NOTHING
    taps = None

    def __init__(
        self,
        window: int = WINDOW,
        max_match: int = 8,
        max_nodes: int = 32,
        max_branches: int = 8,
        cache_path: str | Path | None = None,
        trie: TokenTrie | None = None,
        shared: bool = False,
        calib: dict[int, Calibration] | None = None,
        is_stop: Callable[[int], bool] | None = None,
        history: History | None = None,
        history_calib: dict[int, Calibration] | None = None,
    ):
        """`shared`: the trie is fed by several requests at once (batch mode); each drafter keeps
        its own insertion cursor, and prompt branches stay until the owner releases them.
        `is_stop(token)`: the token ends a generation (the target's end-of-generation tokens), so
        a branch is drafted up to it, without it: a chat prompt's branches run on into the
        template's `<|im_end|>`, `<|im_start|>assistant`, which an answer never continues into,
        and the end token itself needs no row (where the target ends there, the row before it
        yields it as the step's own token). `history`: the user's past replies, a second source
        (calibrated by `history_calib`)."""
        self.cache_path = Path(cache_path) if cache_path else None
        self.trie = trie or load_trie(self.cache_path, window)
        self.shared = shared
        self._cursor = Cursor()
        self.max_match = max_match
        self.max_nodes = max_nodes
        self.max_branches = max_branches
        self.calib = calib if calib is not None else new_calibration(max_match)
        self.is_stop = is_stop
        self._skipped = 0
        self._s = 1
        self._closing: list[int] = []  # nodes of the last draft that close a prompt's message
        self._ends: tuple[int, ...] = ()
        self.history = history
        self.history_calib = history_calib if history_calib is not None else new_calibration(max_match)
        self._cal = self.calib  # the calibrations of the source that made the last draft
        self._context: list[int] = []
        self._n_prompt = 0

    def begin(self, prompt: list[int]) -> None:
        self._cursor = Cursor()
        self._context = []
        self.trie.extend(prompt, PROMPT, self._cursor)
        self._n_prompt = len(prompt)
        # the end-of-turn tokens in the prompt: a token a message of it ended on is priced by
        # the calibration of such tokens (see TokenTrie.candidates)
        stop = self.is_stop
        self._ends = tuple(sorted({t for t in set(prompt) if stop(t)})) if stop is not None else ()
        if self._ends and CLOSING not in self.calib:
            self.calib[CLOSING] = Calibration(prior=CLOSING_PRIOR)

    def propose(self, context: list[int], budget: Budget) -> Proposal:
        self._context = context  # the generation's own list, grown in place: the reply at `end`
        trie = self.trie
        trie.extend(context, OUTPUT, self._cursor)
        node, s = trie.match(context, self.max_match, self._cursor)
        limit = min(self.max_nodes, budget.max_nodes)
        if limit <= 0:
            return Draft()
        cals, source, ends = self.calib, self.name, self._ends
        f1 = raw = 0.0
        if node is not None:
            raw = trie.best_share(node)
            f1 = cals[s].factor(1)
            if ends:
                f1 = max(f1, cals[CLOSING].factor(1))
        if self.history is not None:  # the source whose likeliest next token is the likelier
            h_node, h_s = self.history.trie.match(context, self.max_match)
            if h_node is not None:
                h_raw = self.history.trie.best_share(h_node)
                h_f1 = self.history_calib[h_s].factor(1)
                if node is None or min(1.0, h_f1 * h_raw) > min(1.0, f1 * raw):
                    trie, node, s, raw, f1 = self.history.trie, h_node, h_s, h_raw, h_f1
                    cals, source, ends = self.history_calib, HISTORY, ()
        if node is None:
            return Draft()
        cal = cals[s]
        end_cal = cals[CLOSING].factor if ends else None
        # Every path below the node is at most as likely as its best first token: where `limit`
        # nodes each that likely would not pay, no tree from here will (most steps of free
        # text), and the expansion is skipped.
        cands = None
        if budget.gate([min(1.0, f1 * raw)] * limit) > 0:
            cands = trie.candidates(node, limit, min(self.max_branches, budget.max_branches), cal.factor,
                                    is_stop=self.is_stop, ends=ends, end_calib=end_cal)
        return Candidates([c.path for c in cands] if cands else [],
                          lambda size: self._take(cands, size, node, s, raw, end_cal, trie, cals, source, ends))

    def _take(self, cands, size: int, node, s: int, raw: float, end_cal, trie: TokenTrie,
              cals: dict[int, Calibration], source: str, ends: tuple[int, ...]) -> Draft:
        """The first `size` candidates as a tree (see `_as_tree`)."""
        cal = cals[s]
        if size == 0:
            # Not paying now. Probe with the best token now and then, so that a match length whose
            # factor fell below its prior can recover; only where the prior itself expects the
            # token more often than not (a failed one-token draft costs most of a step here).
            self._skipped += 1
            prior = PRIORS.get(s, PRIOR_LONG)
            if self._skipped < 16 or cal.factor(1) >= prior or min(1.0, prior * raw) < 0.5:
                return Draft()
            # the best first token: already expanded unless the bound skipped the expansion
            cands = cands or trie.candidates(node, 1, 1, cal.factor, is_stop=self.is_stop, ends=ends,
                                             end_calib=end_cal)
            if not cands:
                return Draft()
            size = 1
        self._skipped = 0
        self._s, self._cal = s, cals
        draft, self._closing = _as_tree(cands[:size], source)
        return draft

    def accept(self, draft: Draft, accepted: list[int], committed: list[int]) -> None:
        if draft.tokens:
            closing, cals = self._closing, self._cal
            if closing:  # those nodes teach the calibration of message ends, the rest their match's
                cals[self._s].update(draft, accepted, skip=set(closing))
                cals[CLOSING].update(draft, accepted, skip=set(range(len(draft))) - set(closing))
            else:
                cals[self._s].update(draft, accepted)

    def end(self) -> None:
        if self.history is not None:  # this reply, for the user's later ones
            self.history.add(self._context[self._n_prompt:])
            self.history.save(soon=True)
        # a trie of this generation's own without a cache file dies with the drafter: nothing
        # to release (a walk of every node, milliseconds on a long answer)
        if not self.shared and self.cache_path is not None:
            release_and_save(self.trie, self.cache_path)


class SharedLookahead:
    """One trie and one calibration for many requests (batch mode): every request's drafter
    feeds and reads the same trie, so similar requests draft from each other. Prompt branches
    stay until `close`, which releases them and saves the trie to `cache_path` when given."""

    def __init__(self, cache_path: str | Path | None = None, is_stop: Callable[[int], bool] | None = None,
                 history: History | None = None, history_calib: dict[int, Calibration] | None = None):
        """`history`: the past replies of the requests' one user (a server's API key), a second
        source for every drafter, each finished reply added to it (`history_calib` its
        calibrations, else new ones)."""
        self.cache_path = cache_path
        self.trie = load_trie(Path(cache_path) if cache_path else None)
        self.calib = new_calibration()
        self.is_stop = is_stop
        self.history = history
        self.history_calib = history_calib if history_calib is not None else new_calibration()

    def drafter(self, max_branches: int) -> LookaheadDrafter:
        return LookaheadDrafter(max_branches=max_branches, trie=self.trie, shared=True, calib=self.calib,
                                is_stop=self.is_stop, history=self.history, history_calib=self.history_calib)

    def close(self) -> None:
        release_and_save(self.trie, self.cache_path)


def load_trie(cache_path: Path | None, window: int = WINDOW) -> TokenTrie:
    """The trie saved at `cache_path` (`--lookahead-cache`), or a new one."""
    if cache_path and cache_path.exists():
        try:
            return TokenTrie.load(cache_path)
        except (OSError, ValueError, KeyError) as e:
            log.warning("ignoring unreadable lookahead cache %s: %s", cache_path, e)
    return TokenTrie(window=window)


def release_and_save(trie: TokenTrie, cache_path) -> None:
    """The requests are over: drop prompt branches, keep output branches (saved when asked)."""
    trie.release_prompt()
    if cache_path:
        try:
            trie.save(cache_path)
        except OSError as e:
            log.warning("cannot save lookahead cache %s: %s", cache_path, e.strerror)


# What a match of s tokens is worth at first, as a factor on the trie's own estimate (a branch
# seen once: 0.67), before acceptance is learned. Measured on shared/bench/prompts.jsonl (SmolLM2,
# greedy): the first drafted token was accepted about 15% of the time after a one-token match,
# 45% after two, 75% after three, 80% after four and 85-100% after five to eight.
PRIORS = {1: 0.3, 2: 0.65, 3: 1.0, 4: 1.15}
PRIOR_LONG = 1.3
# The calibration of tokens that close a prompt's message (key CLOSING of the calibrations):
# measured with the factors above (SmolLM2 Q4_0, greedy, 256 tokens; the 80 MT-bench first turns,
# the 164 HumanEval prompts as chat, shared/bench/prompts.jsonl), such tokens drafted from the
# prompt were kept 2 of 13 times, where their match lengths predicted 9.4 (72%); a branch seen
# once (0.67) times 0.3 is 0.2, below what a one-token draft needs, and the factor learns from
# what is drafted (a node that comes free with a larger tree).
CLOSING = 0
CLOSING_PRIOR = 0.3
HISTORY = "history"  # the source name of drafts from the user's past replies (Draft.source, the stats' drafter)


def new_calibration(max_match: int = 8) -> dict[int, Calibration]:
    """One factor per matched suffix length, starting from PRIORS, and one (key CLOSING) for
    tokens that close a prompt's message."""
    cal = {s: Calibration(prior=PRIORS.get(s, PRIOR_LONG)) for s in range(1, max_match + 1)}
    cal[CLOSING] = Calibration(prior=CLOSING_PRIOR)
    return cal


def _as_tree(cands, source: str) -> tuple[Draft, list[int]]:
    """Candidates (parents first) -> a preorder Draft whose first path is the likeliest branch,
    so that the common case keeps its cells contiguous in the KV cache; and the indices of its
    nodes that close a prompt's message."""
    kids: dict[int, list[int]] = {}
    for i, c in enumerate(cands):
        kids.setdefault(c.parent, []).append(i)
    tokens, parents, est, closing = [], [], [], []
    stack = [(i, -1) for i in sorted(kids.get(-1, []), key=lambda i: cands[i].path)]
    while stack:
        i, new_parent = stack.pop()
        idx = len(tokens)
        c = cands[i]
        tokens.append(c.token)
        parents.append(new_parent)
        est.append(c.raw)
        if c.closing:
            closing.append(idx)
        for j in sorted(kids.get(i, []), key=lambda j: cands[j].path):
            stack.append((j, idx))
    return Draft(tokens, parents, None, source, est), closing


class Sources:
    """The calibrations of lookahead's sources (its own trie: `lookahead`; the user's past replies:
    `history`), per match length, learned across an engine's generations and, beside the target's
    cost curve, across processes: what the target accepted after a match of s tokens from each
    source is what the next step is priced at. A side context of the engine: `close` writes them."""

    bound = False
    KEY = "lookahead-calibration"

    def __init__(self, cost: CostModel | None):
        self.cost = cost
        self.value: dict[str, dict[int, Calibration]] = {"lookahead": new_calibration(), HISTORY: new_calibration()}
        kept = load_extra(cost, self.KEY)
        if isinstance(kept, dict):
            for name, cals in self.value.items():
                for s, state in (kept.get(name) or {}).items():
                    try:
                        cal = cals.get(int(s))
                        if cal is not None:
                            cal.restore(state)
                    except (TypeError, ValueError):
                        continue  # a record from another version: that length learns again

    def state(self) -> dict:
        return {name: {str(s): c.state() for s, c in cals.items()} for name, cals in self.value.items()}

    def close(self) -> None:
        store_extra(self.cost, self.KEY, self.state())
