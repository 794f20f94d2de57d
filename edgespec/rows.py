"""How the verifier reads the target's rows: the one place where a request's constraints shape
the target's distribution (logit bias, presence and frequency penalties, a GBNF grammar through
llama.cpp's own grammar sampler) and where the log-probabilities of committed tokens are taken.

Drafts stay unconstrained. The row that follows a draft node is shaped by the state *at that
node*: the grammar advanced along the draft path up to it, the penalties counting the path's
tokens. Greedy verification then picks exactly the token plain constrained decoding picks, and
sampled verification compares the draft against exactly the constrained distribution; a draft
token the grammar forbids has probability 0 at its row and is rejected like any other miss.
Plain decoding (`--spec none`) reads its one row per step through the same code.

Cost. llama.cpp's grammar check walks every candidate's text through the grammar's stacks: a
full-vocabulary mask took 24 ms on SmolLM2's 49k tokens (JSON grammar, a loaded 2-core CPU;
one candidate 0.01 ms, 320 candidates 0.07 ms, a clone 0.006 ms), longer than a plain step. A
greedy row first asks whether its argmax is allowed (one candidate): if so it is the masked
argmax; else the row's best 64, then 2048 tokens, best first. A sampled row with top-k checks
the row's best 8k tokens: when k of them are allowed, the warp of the fully masked row keeps
exactly those k. Only log-probabilities (their normaliser) always need the full mask.
"""

from __future__ import annotations

import ctypes
from collections import Counter
from typing import Callable

import numpy as np

import llama_cpp as lc

from .draft import Draft
from .errors import EdgespecError
from .sampling import SamplingConfig, warp

_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])
assert _TOKEN_DATA.itemsize == ctypes.sizeof(lc.llama_token_data)
NEG_INF = np.float32(-np.inf)


class GrammarError(EdgespecError):
    """A grammar llama.cpp cannot parse, or a JSON schema that cannot become one."""


def json_schema_grammar(schema) -> str:
    """GBNF for a JSON schema (a dict or its JSON text), by llama.cpp's converter as
    llama-cpp-python ships it."""
    import json

    from llama_cpp.llama_grammar import json_schema_to_gbnf

    text = schema if isinstance(schema, str) else json.dumps(schema)
    try:
        return json_schema_to_gbnf(text)
    except Exception as e:  # the converter raises what it meets (ValueError, KeyError, assertions)
        raise GrammarError(f"cannot turn the JSON schema into a grammar: {type(e).__name__}: {e}") from None


def json_object_grammar() -> str:
    """Any JSON object (OpenAI's `response_format: json_object`): llama.cpp's json.gbnf."""
    from llama_cpp.llama_grammar import JSON_GBNF

    return JSON_GBNF


class _Buffer:
    """A llama_token_data_array over a numpy buffer of the vocabulary's size (shared by a
    grammar and its clones: one thread uses them, one call at a time)."""

    def __init__(self, n_vocab: int):
        self.data = np.zeros(n_vocab, dtype=_TOKEN_DATA)
        self.full_ids = np.arange(n_vocab, dtype=np.int32)
        self.arr = lc.llama_token_data_array(ctypes.cast(self.data.ctypes.data, lc.llama_token_data_p), n_vocab, -1,
                                             False)
        self.ref = ctypes.byref(self.arr)

    def load(self, ids: np.ndarray) -> None:
        n = len(ids)
        self.data["id"][:n] = ids
        self.data["logit"][:n] = 0.0
        self.arr.data = ctypes.cast(self.data.ctypes.data, lc.llama_token_data_p)
        self.arr.size = n
        self.arr.selected = -1
        self.arr.sorted = False


class Grammar:
    """llama.cpp's grammar sampler over a model's vocabulary; `accept` advances its state."""

    def __init__(self, model, text: str, root: str = "root", _ptr=None, _buf: _Buffer | None = None):
        self.model = model
        if _ptr is None:
            from .llama import last_log_error

            _ptr = lc.llama_sampler_init_grammar(model.vocab, text.encode("utf-8"), root.encode("utf-8"))
            if not _ptr:
                why = last_log_error().strip()
                raise GrammarError("the grammar does not parse" + (f": {why}" if why else ""))
        self._ptr = _ptr
        self.buf = _buf or _Buffer(model.n_vocab)

    def clone(self) -> "Grammar":
        return Grammar(self.model, "", _ptr=lc.llama_sampler_clone(self._ptr), _buf=self.buf)

    def accept(self, token: int) -> None:
        """Advance by a token the grammar allows (llama.cpp aborts on one it does not)."""
        lc.llama_sampler_accept(self._ptr, int(token))

    def allowed(self, ids: np.ndarray | None = None) -> np.ndarray:
        """Which of `ids` (default: the whole vocabulary) the grammar allows next."""
        b = self.buf
        ids = b.full_ids if ids is None else ids
        b.load(ids)
        lc.llama_sampler_apply(self._ptr, b.ref)
        return b.data["logit"][: len(ids)] == 0.0

    def allows(self, token: int) -> bool:
        return bool(self.allowed(np.array([token], dtype=np.int32))[0])

    def close(self) -> None:
        if self._ptr:
            lc.llama_sampler_free(self._ptr)
            self._ptr = None

    def __del__(self) -> None:  # pragma: no cover - interpreter shutdown order varies
        try:
            self.close()
        except Exception:
            pass


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    m = x.max()
    return x - (m + np.log(np.exp(x - m).sum()))


class Shaper:
    """One generation's constraints and log-probabilities. `view(draft, logits_at)` gives the
    verifier the shaped rows of one step; `commit(token)` advances the state by each committed
    token (`Lifecycle`'s clip); `finished` says the grammar allows nothing but the end."""

    def __init__(self, model, cfg: SamplingConfig):
        self.model, self.cfg = model, cfg
        self.grammar = Grammar(model, cfg.grammar) if cfg.grammar else None
        self.penalized = bool(cfg.presence_penalty or cfg.frequency_penalty)
        self.counts: Counter = Counter()  # generated tokens (the penalties' state)
        bad = [t for t, _ in cfg.logit_bias if t >= model.n_vocab]
        if bad:
            raise EdgespecError(f"logit_bias names token {bad[0]}, past the vocabulary ({model.n_vocab} tokens)")
        self.bias_ids = np.array([t for t, _ in cfg.logit_bias], dtype=np.int64)
        self.bias_vals = np.array([v for _, v in cfg.logit_bias], dtype=np.float32)
        self.n_top = cfg.logprobs
        eog = model.eos if model.eos >= 0 and model.is_eog(model.eos) else int(lc.llama_vocab_eot(model.vocab))
        self.eog = eog
        self.pending: list[tuple] = []  # log-probabilities of a verdict's tokens, not yet committed
        self.logprobs: list[tuple] = []  # (token, logprob, ((token, logprob), ...)) per committed token

    @staticmethod
    def needed(cfg: SamplingConfig) -> bool:
        return bool(cfg.grammar or cfg.presence_penalty or cfg.frequency_penalty or cfg.logit_bias
                    or cfg.logprobs is not None)

    @classmethod
    def build(cls, model, cfg: SamplingConfig) -> "Shaper | None":
        """None when nothing shapes the rows (the verifier then reads them as they are)."""
        return cls(model, cfg) if cls.needed(cfg) else None

    def view(self, draft: Draft, logits_at: Callable[[int], np.ndarray]) -> "StepRows":
        return StepRows(self, draft, logits_at)

    def commit(self, token: int) -> None:
        """A committed token (never an end-of-generation one)."""
        if self.grammar is not None:
            self.grammar.accept(token)
        if self.penalized:
            self.counts[token] += 1
        if self.n_top is not None:
            self.logprobs.append(self.pending.pop(0) if self.pending else (token, float("nan"), ()))

    def end_step(self) -> None:
        """Forget a verdict's log-probabilities past what was committed (a step cut short)."""
        self.pending.clear()

    @property
    def finished(self) -> bool:
        """The grammar is complete: it allows the end of generation and nothing else."""
        g = self.grammar
        if g is None or not g.allows(self.eog):
            return False
        rest = np.flatnonzero(g.allowed())
        is_eog = self.model.is_eog
        return len(rest) <= 16 and all(is_eog(int(t)) for t in rest)

    def close(self) -> None:
        if self.grammar is not None:
            self.grammar.close()


class StepRows:
    """The shaped rows of one step (node -1: the root), read by the verifier along its walk."""

    def __init__(self, shaper: Shaper, draft: Draft, logits_at: Callable[[int], np.ndarray]):
        self.s, self.draft, self.logits_at = shaper, draft, logits_at
        self._cur: Grammar | None = None  # a clone advanced along _path (None: the committed state)
        self._path: list[int] = []
        self.lp: dict[int, np.ndarray] = {}  # node -> log-softmax of its shaped row (logprobs only)

    def _grammar_at(self, node: int) -> Grammar:
        g = self.s.grammar
        path = self.draft.path_to(node) if node >= 0 else []
        if not path:
            return g
        if self._cur is None or self._path != path[: len(self._path)]:
            if self._cur is not None:
                self._cur.close()
            self._cur, self._path = g.clone(), []
        for n in path[len(self._path):]:
            self._cur.accept(self.draft.tokens[n])
            self._path.append(n)
        return self._cur

    def _shaped(self, node: int) -> np.ndarray:
        """The row with bias and penalties (a copy when they change it)."""
        x = self.logits_at(node)
        s = self.s
        if not len(s.bias_ids) and not s.penalized:
            return x
        x = np.array(x, dtype=np.float32)
        if len(s.bias_ids):
            x[s.bias_ids] += s.bias_vals
        if s.penalized:
            counts = s.counts
            if node >= 0:
                counts = counts + Counter(self.draft.tokens[n] for n in self.draft.path_to(node))
            if counts:
                ids = np.fromiter(counts.keys(), dtype=np.int64, count=len(counts))
                c = np.fromiter(counts.values(), dtype=np.float32, count=len(counts))
                x[ids] -= c * np.float32(s.cfg.frequency_penalty) + np.float32(s.cfg.presence_penalty)
        return x

    def _masked_full(self, node: int, x: np.ndarray) -> np.ndarray:
        ok = self._grammar_at(node).allowed()
        return np.where(ok, x, NEG_INF)

    def _full(self, node: int) -> np.ndarray:
        """The fully shaped row; its log-softmax is kept when log-probabilities are asked for."""
        x = self._shaped(node)
        if self.s.grammar is not None:
            x = self._masked_full(node, x)
        if self.s.n_top is not None and node not in self.lp:
            self.lp[node] = _log_softmax(x) if np.isfinite(x).any() else None
        return x

    def argmax(self, node: int) -> int:
        s = self.s
        if s.n_top is not None:
            x = self._full(node)
            return int(np.argmax(x)) if np.isfinite(x).any() else s.eog
        x = self._shaped(node)
        a = int(np.argmax(x))
        if s.grammar is None:
            return a
        g = self._grammar_at(node)
        if g.allows(a):  # the masked argmax is the argmax when the grammar allows it
            return a
        for m in (64, 2048):  # else the first allowed token of the row's best m, best first
            if m >= len(x):
                break
            idx = np.argpartition(-x, m - 1)[:m]
            idx = idx[np.lexsort((idx, -x[idx]))].astype(np.int32)  # np.argmax's order: value, then id
            ok = g.allowed(idx)
            if ok.any():
                b = int(idx[int(np.argmax(ok))])
                if x[b] > x[idx[-1]]:  # strictly above the cut: no token outside ties with it
                    return b
                break
        x = self._masked_full(node, x)
        return int(np.argmax(x)) if np.isfinite(x).any() else s.eog

    def probs(self, node: int, cfg: SamplingConfig) -> np.ndarray:
        s = self.s
        if s.grammar is None or s.n_top is not None:
            x = self._full(node)
        else:
            x = self._shaped(node)
            k, n = cfg.top_k, len(x)
            x = self._top_masked(node, x, k) if 0 < k and 8 * k < n else self._masked_full(node, x)
        if not np.isfinite(x).any():  # nothing allowed: the generation ends here
            p = np.zeros(len(x))
            p[s.eog] = 1.0
            return p
        return warp(x, cfg)

    def _top_masked(self, node: int, x: np.ndarray, k: int) -> np.ndarray:
        """The masked row as top-k sees it: when k of the row's best 8k tokens are allowed, the k
        best allowed tokens of the whole row are among them (ties aside, as in the warp)."""
        m = 8 * k
        idx = np.argpartition(-x, m - 1)[:m].astype(np.int32)
        ok = self._grammar_at(node).allowed(idx)
        if int(ok.sum()) < k:
            return self._masked_full(node, x)
        y = np.full(len(x), NEG_INF, dtype=np.float32)
        keep = idx[ok]
        y[keep] = x[keep]
        return y

    def verdict(self, nodes: list[int], tokens: list[int]) -> None:
        """The verifier's tokens and the rows they came from: their log-probabilities wait in the
        shaper until they are committed."""
        s = self.s
        s.pending.clear()
        if s.n_top is not None:
            for node, tok in zip(nodes, tokens):
                if node not in self.lp:
                    self._full(node)
                lp = self.lp.get(node)
                if lp is None:
                    s.pending.append((tok, float("-inf"), ()))
                    continue
                top = ()
                if s.n_top > 0:
                    idx = np.argpartition(-lp, s.n_top - 1)[: s.n_top]
                    idx = idx[np.argsort(-lp[idx], kind="stable")]
                    top = tuple((int(i), float(lp[i])) for i in idx if np.isfinite(lp[i]))
                s.pending.append((tok, float(lp[tok]), top))
        if self._cur is not None:
            self._cur.close()
            self._cur = None
