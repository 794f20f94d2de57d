"""MTP drafting: the target's own nextn (multi-token prediction) layers propose the next token
(`--spec mtp`).

Models such as MiMo, GLM-4.5, DeepSeek-V3 and Qwen3.5 ship one or more nextn blocks after the
trunk. llama.cpp loads them when the model is opened with `load_mtp` and runs them in a second
context of type LLAMA_CONTEXT_TYPE_MTP over the SAME llama_model: that context's KV cache holds
only the nextn layers, the target's only the trunk. This drafter drives it the way
`common/speculative.cpp` drives `draft-mtp` (docs/llamacpp-eagle3-mtp.md §3.3):

* The target context outputs its nextn hidden state h for every decoded row (unmasked
  `llama_set_embeddings_nextn`; what h is depends on the architecture: the pre-norm trunk output
  for mimo2, post-norm for qwen35; llama.cpp's graph decides, not us). These are NOT the post-norm
  embeddings `Context.hidden` gives, so the drafter reads them itself, from the rows the
  scheduler names right after each target decode (`observe`), before anything else decodes.
* The MTP row at position k is (token x_k, h_{k-1}) and predicts x_{k+1}. The row of the last
  committed token waits for the h of the row before it, which arrives with the next verification
  (the "deferred pending h"); `propose` decodes every row still missing in ONE llama_process
  (the catch-up of the accepted tokens plus the seed row), and the seed row's logits give the
  first draft token.
* Deeper tokens (only when `n_max` > 1) chain the MTP's own output state (`h_nextn` of the MTP
  context) as the next row's h, as llama.cpp does for single-head MTP.
* Those chained rows are not valid history (their h is the MTP's, not the target's), so they are
  dropped from the MTP KV cache (llama_memory_seq_rm) as soon as the draft is made: the MTP cache
  holds exactly the committed tokens, like the target's, and a rejection needs no other rollback.

The draft is a greedy chain with no distributions (`probs=None`): the verifier samples the target
and follows the chain, which keeps sampling exact. Models with several nextn blocks (chained heads,
`llama_set_nextn_layer_offset`) are driven with their first block only.
"""

from __future__ import annotations

import ctypes
import time

import numpy as np

import llama_cpp as lc

from .. import llama_ext
from ..draft import Draft
from ..errors import EdgespecError
from ..kv import SideKV
from ..llama import Context, ContextConfig, Model, last_log_error
from ..sampling import warp
from .base import NEXTN_ROWS, Budget, Calibration, TokenTimed, top_prob

# GGUF architectures whose llama.cpp 0.3.36 graph has an MTP branch (LLM_GRAPH_TYPE_DECODER_MTP,
# grep `graph_mtp` in src/models/). Others may carry nextn tensors (glm4, exaone4, ...) but only
# load or skip them: an MTP context on them would run the trunk's graph.
MTP_ARCHS = frozenset({
    "qwen35", "qwen35moe", "qwen3next", "mimo2", "step35", "glm4moe", "glm-dsa", "glm5-next", "deepseek2",
    "deepseek32", "deepseek4", "bailingmoe3", "cohere2moe", "hy_v3", "nemotron_h_moe",
})

_DECODE = lc.LLAMA_PROCESS_TYPE_DECODE
_F = ctypes.POINTER(ctypes.c_float)


class MtpContext:
    """The MTP context of one target context: same llama_model, its own KV cache (the nextn
    layers only) and a reusable llama_batch_ext (rows carry a token AND an h row, which the
    plain llama_batch cannot). A side context bound to the target's context (`edgespec.side`):
    the two share positions, so it is made again when the engine swaps that context."""

    bound = True

    def __init__(self, model: Model, target_ctx: Context, threads: int, kv_type: str):
        name = model.path.name
        if model.n_layer_nextn <= 0:
            raise EdgespecError(f"{name} has no MTP (nextn) layers; --spec mtp needs a GGUF converted with its "
                                f"MTP block (MiMo, GLM-4.5, DeepSeek-V3, Qwen3.5, ...); use --heads for a "
                                f"trained MTP module")
        if model.arch not in MTP_ARCHS:
            raise EdgespecError(f"{name} ({model.arch}) carries nextn layers but llama.cpp has no MTP graph for "
                                f"{model.arch}; --spec mtp runs on {', '.join(sorted(MTP_ARCHS))}")
        if not model.load_mtp:
            raise EdgespecError(f"internal: {name} was loaded without its MTP layers (load_mtp)")
        self.target_ctx: Context = target_ctx
        self.ctx = Context(model, ContextConfig(target_ctx.n_ctx, target_ctx.n_batch, threads, 1, kv_type,
                                                ctx_type=lc.LLAMA_CONTEXT_TYPE_MTP))
        self.n_embd = int(lc.llama_model_n_embd_out(model.ptr))  # MTP rows are n_embd_out wide
        llama_ext.fn("set_embeddings_nextn")(self.ctx.ptr, True, True)  # h_nextn of output rows
        self.batch = lc.llama_batch_ext_init(self.ctx.ptr)
        if not self.batch:
            raise EdgespecError(f"cannot create a batch for the MTP context of {name}")
        self.kv = SideKV(self.ctx)
        self.tokens: list[int] = []  # what the MTP KV cache holds: position i is tokens[i]

    def reset(self) -> None:
        self.kv.clear()
        self.tokens = []

    def truncate(self, n: int) -> None:
        if n < len(self.tokens):
            self.kv.keep(n)
            del self.tokens[n:]

    def decode(self, rows: list[tuple[int, int, np.ndarray]], out_last: bool) -> None:
        """One llama_process of (token, position, h) rows; logits (and h_nextn) for the last row
        when `out_last`, at batch index len(rows) - 1. `set_embd_token` copies each row."""
        b = self.batch
        lc.llama_batch_ext_clear(b)
        for j, (tok, pos, h) in enumerate(rows):
            i = lc.llama_batch_ext_add_token(b, 0, tok)
            if i < 0:
                raise EdgespecError(f"internal: MTP batch refused row {j} ({i})")
            p = lc.llama_pos(pos)
            lc.llama_batch_ext_set_pos(b, i, ctypes.byref(p))
            lc.llama_batch_ext_set_embd_token(b, i, lc.llama_embd(h.ctypes.data_as(_F), 1, h.size))
            if out_last and j == len(rows) - 1:
                lc.llama_batch_ext_set_output_logits(b, i, True)
        rc = lc.llama_process(self.ctx.ptr, _DECODE, b)
        if rc != 0:
            raise EdgespecError(f"MTP decode failed with code {rc}: {last_log_error()}")

    def h_out(self, i: int) -> np.ndarray:
        """A copy of the MTP's own output state of batch row `i` of the last decode."""
        ptr = llama_ext.fn("get_embeddings_nextn_ith")(self.ctx.ptr, i)
        if not ptr:
            raise EdgespecError(f"internal: no MTP nextn state for row {i}")
        return np.ctypeslib.as_array(ptr, shape=(self.n_embd,)).copy()

    def close(self) -> None:
        if getattr(self, "batch", None):
            lc.llama_batch_ext_free(self.batch)
            self.batch = None
        self.ctx.close()


class MtpDrafter(TokenTimed):
    """Drafts with the target's nextn layers (see the module docstring)."""

    name = "mtp"
    # The MTP reads the target's nextn rows itself (`observe`'s batch rows), not the post-norm
    # features the scheduler copies for heads.
    reads = NEXTN_ROWS
    taps = None

    def __init__(self, mtp: MtpContext, n_max: int = 1, p_min: float = 0.0, is_stop=None):
        """`n_max`: draft tokens per step at most (1: the MTP's trained depth; more chain its
        own output state). `p_min`: stop a chain at a token whose probability is below it.
        `is_stop(token)`: the token ends a generation, so a chain ends before it."""
        self.m = mtp
        self.is_stop = is_stop
        self.n_max, self.p_min = max(1, n_max), p_min
        # depth 1 reads the target's h, deeper tokens the MTP's own: two regimes, two factors
        self.calib = Calibration(prior=1.0, depth=2)
        self.t_token = 0.0  # seconds per MTP row (EMA), the drafting cost per chained token
        self.t_draft = 0.0  # seconds in propose this generation
        self.n_draft = 0  # proposals this generation
        self.n_missing = 0  # rows decoded without their target h (a scheduler that did not report)
        self._h: dict[int, np.ndarray] = {}  # the target's h by position, until its row is decoded
        self._prompt: list[int] | None = None
        self._target = mtp.target_ctx
        self._nextn(True)  # before the prompt is decoded: its rows are needed too
        # The MTP cache is kept from the engine's last generation: `_sync` keeps its common
        # prefix with the next prompt (a conversation's earlier turns), rows from 0 start afresh.

    # -- the target's rows --------------------------------------------------------------------

    def _nextn(self, on: bool) -> None:
        if self._target.ptr:
            llama_ext.fn("set_embeddings_nextn")(self._target.ptr, on, False)  # unmasked: every row

    def _reset(self) -> None:
        self.m.reset()
        self._h = {}

    def observe(self, pos: int, rows: list[int], hidden: np.ndarray | None = None) -> None:
        """The target just decoded batch rows `rows`, holding committed positions pos, pos+1, ...
        (a prompt chunk, or the root and accepted nodes of a verification). Copies their h; a
        prompt chunk whose tokens are known (after `begin`) is decoded into the MTP cache at once,
        so a long prompt never holds more than a chunk of h rows."""
        if not rows:
            return
        if pos == 0:
            self._reset()  # a new sequence
        n = int(max(rows)) + 1
        # the bounds check of llama.cpp (an out-of-range row logs an error and gives NULL)
        if not llama_ext.fn("get_embeddings_nextn_ith")(self._target.ptr, n - 1):
            raise EdgespecError(f"internal: the target has no nextn state for row {n - 1} (nextn off?)")
        base = llama_ext.fn("get_embeddings_nextn")(self._target.ptr)
        h = np.ctypeslib.as_array(base, shape=(n, self.m.n_embd))[np.asarray(rows)].copy()
        for i in range(len(rows)):
            self._h[pos + i] = h[i]
        end = pos + len(rows)
        if self._prompt is not None and end <= len(self._prompt):
            self._sync(self._prompt[:end], out_last=False)

    def _sync(self, tokens: list[int], out_last: bool) -> int:
        """Make the MTP cache hold exactly `tokens`, row k being (tokens[k], h_{k-1}); with
        `out_last` the last row is (re)decoded for its logits. Returns the rows decoded."""
        m = self.m
        keep = 0
        lim = min(len(m.tokens), len(tokens))
        while keep < lim and m.tokens[keep] == tokens[keep]:
            keep += 1
        if out_last:
            keep = min(keep, len(tokens) - 1)
        m.truncate(keep)
        zero = None
        step = m.ctx.n_batch
        for s in range(keep, len(tokens), step):
            rows = []
            for k in range(s, min(s + step, len(tokens))):
                h = self._h.get(k - 1)
                if h is None:
                    if k > 0:
                        self.n_missing += 1
                    zero = np.zeros(m.n_embd, np.float32) if zero is None else zero
                    h = zero
                rows.append((tokens[k], k, h))
            m.decode(rows, out_last and s + step >= len(tokens))
            m.tokens.extend(tokens[s : s + len(rows)])
        # keep the h of the last two positions: the next row needs the last, a redo of the last
        # row the one before
        for k in [k for k in self._h if k < len(tokens) - 2]:
            del self._h[k]
        return len(tokens) - keep

    # -- the drafter interface ---------------------------------------------------------------

    def begin(self, prompt: list[int]) -> None:
        self._prompt = list(prompt)
        self._nextn(True)
        self.t_draft, self.n_draft = 0.0, 0

    def propose(self, context: list[int], budget: Budget) -> Draft:
        t0 = time.perf_counter()
        m = self.m
        n_seed = len(context) - 1  # the last committed token's position: the seed row
        limit = min(self.n_max, budget.max_nodes, m.ctx.n_ctx - len(context))
        drafting = limit > 0 and (n_seed == 0 or (n_seed - 1) in self._h)
        n_new = self._sync(context, out_last=drafting)
        if not drafting:
            return Draft()
        if n_new <= 2:  # a catch-up of a row or two costs about one chained step
            self._time_token(time.perf_counter() - t0)
        sampling, stop = budget.sampling, self.is_stop
        row = (n_new - 1) % m.ctx.n_batch  # the seed row's index in the last chunk decoded
        logits = None
        chained = False

        def top() -> float:
            nonlocal logits
            logits = m.ctx.logits(row)
            return top_prob(logits) if sampling.greedy else float(warp(logits, sampling).max())

        def draw() -> int | None:
            x = int(np.argmax(logits))
            # an end token needs no row: the row before yields it where the target ends
            return None if stop is not None and stop(x) else x

        def advance(x: int, n: int) -> bool:
            nonlocal row, chained
            t1 = time.perf_counter()
            m.decode([(x, n_seed + n, m.h_out(row))], out_last=True)
            self._time_token(time.perf_counter() - t1)
            row, chained = 0, True
            return True

        tokens, est, _ = self.gated_chain(budget, limit, budget.n_min, self.p_min, top, draw, advance)
        if chained:
            m.kv.keep(len(context))  # chained rows carry the MTP's own h: never history
        self.t_draft += time.perf_counter() - t0
        self.n_draft += 1
        if not tokens or len(tokens) < min(budget.n_min, limit):
            return Draft()
        return Draft.chain(tokens, est=est, source=self.name)

    def end(self) -> None:
        """Leave the target context as found: unmasked nextn rows keep its last layer from
        being cut to the output rows, and copy every row's h."""
        self._nextn(False)
        self._prompt = None
        self._h = {}


def build(engine, n_max: int = 1) -> MtpDrafter:
    """An MTP drafter for one generation on `engine`'s target context. The MTP context is made
    once per target context and kept among the engine's side contexts (`engine.side["mtp"]`): a
    new one when the engine swapped its target context (batch streams), since the pair shares
    positions. One generation at a time: a new drafter clears the MTP cache. `n_max` > 1 (or
    --spec-draft-n-min) lets a step chain that many tokens; the cost curve decides how many are
    verified."""
    c = engine.cfg
    m = engine.side.keep("mtp", lambda: MtpContext(engine.target, engine.ctx, c.threads_draft or c.threads, c.kv_type),
                         fits=lambda m: m.target_ctx is engine.ctx and bool(m.ctx.ptr))
    return MtpDrafter(m, n_max=max(1, n_max, c.draft_n_min), p_min=c.draft_p_min, is_stop=engine.target.is_eog)
