"""The engine: the loaded target (and draft) model, their contexts and cost curves.

The engine owns every llama.cpp context: one for the target (swapped for one of several KV
streams while a batch decodes many sequences, never both at once), one for the draft model, and
the drafters' side contexts in one declared map (`side`: MTP, EAGLE-3, heads, lookahead's
calibration), which it closes without knowing what they are. Generations are started by method
name through the registry (`methods`: a drafter for the sequential loop, or a scheduler of its
own). What it leaves to others: its settings (`config.EngineConfig`), the devices
(`backend.devices_for`), the exactness policy in force (`exactness`), the cost curves' cache and
upkeep (`costcache.curve`, `keep_up`), prompt tokens (`prompts`), heads lookup (`heads.store`).
"""

from __future__ import annotations

from functools import cached_property

from . import backend, methods, prompts
from .config import EngineConfig
from .costcache import curve, keep_up, persist
from .costmodel import CostModel
from .drafters.base import Drafter, NullDrafter
from .drafters.draft_model import check_vocab
from .errors import EdgespecError
from .exactness import Exactness, exact_kernels
from .heads.store import heads_kinds
from .kv import KVSeq
from .lifecycle import Lifecycle
from .llama import Context, ContextConfig, Model
from .models import resolve
from .sampling import SamplingConfig
from .schedulers.sequential import Generation
from .side import SideContexts


class Engine:
    """A loaded target model (and draft model, if any) with its cost curves."""

    def __init__(self, cfg: EngineConfig, quiet: bool = True):
        self.cfg = cfg
        # what drafters keep across generations (MTP and EAGLE-3 contexts, heads, lookahead's
        # calibration), by name; each closes itself, those bound to `ctx` before it is swapped
        self.side = SideContexts()
        target_devs, draft_devs = backend.devices_for(cfg.rpc, cfg.rpc_draft, cfg.n_gpu_layers)
        path = resolve(cfg.model, quiet=quiet)
        # K-quant weights on a CPU under strict (--exact-kernels): per-row kernels (docs/exactness.md)
        self.exact_kernels = exact_kernels(cfg.exactness, cfg.exact_kernels, cfg.n_gpu_layers, bool(cfg.rpc), path)
        # nextn (MTP) layers, where the model has them, are loaded for --spec mtp (one layer more)
        self.target = Model(path, cfg.n_gpu_layers, load_mtp=True, devices=target_devs,
                            repack=not self.exact_kernels)
        self.ctx = Context(self.target, self._single_config())
        self.kv = KVSeq(self.ctx)
        self.n_ctx_seq = self.ctx.n_ctx  # tokens per sequence (-c, capped by the model's training length)
        self.draft_model: Model | None = None
        self.draft_ctx: Context | None = None
        self.draft_kv: KVSeq | None = None
        self.draft_cost: CostModel | None = None
        if cfg.draft:
            self.draft_model = Model(resolve(cfg.draft, quiet=quiet), cfg.n_gpu_layers_draft, devices=draft_devs)
            check_vocab(self.target, self.draft_model)
            self.draft_ctx = Context(
                self.draft_model, ContextConfig(self.ctx.n_ctx, cfg.n_batch, cfg.threads_draft or cfg.threads, 1, cfg.kv_type)
            )
            self.draft_kv = KVSeq(self.draft_ctx)  # one per context: its token list is the cache's
        self._kinds: set[str] | None = None
        self._measure_costs(quiet)
        self.exactness.warn(self.target.path.name, cfg.kv_type)

    # -- cost curves ----------------------------------------------------------------------

    def _measure_costs(self, quiet: bool, force: bool = False) -> None:
        """The draft model's and the target's cost curves, from the cache or measured (`force`:
        measured again, replacing the cached ones). The draft model's is read for its time per
        token only (costcache.load_or_measure's `one_row`): its first run waits for no curve."""
        c = self.cfg
        if self.draft_ctx is not None:
            self.draft_cost = curve(self.draft_ctx, self.draft_kv, c.n_gpu_layers_draft, c.rpc_draft, quiet, force,
                                    one_row=True)
        self.cost: CostModel = curve(self.ctx, self.kv, c.n_gpu_layers, c.rpc, quiet, force)
        self.kv.reset()  # the probes' tokens are no conversation to reuse

    def remeasure_cost(self, quiet: bool = True) -> None:
        """Measure the cost of verifying k rows (and the exactness probe) again for the target and
        the draft model, replacing the cached curves: after the machine's load or hardware changed."""
        self._measure_costs(quiet, force=True)

    def heal_cost(self, quiet: bool = True) -> list[str]:
        """Between generations (never during one): measure the target's cost curve again where
        its online corrections stayed far from 1 or it was measured on a busy machine, once the
        machine is quiet, else write back what they learned (costcache.keep_up); the draft
        model's is read for t(1) only and not corrected. Returns why it was measured again."""
        self.cost, why = keep_up(self.ctx, self.kv, self.cost, quiet)
        return [why] if why else []

    # -- exactness (edgespec.exactness) ---------------------------------------------------

    @cached_property
    def on_gpu(self) -> bool:
        """Whether the target runs (partly) on a GPU here (asked once)."""
        return backend.on_gpu(self.cfg.n_gpu_layers)

    @property
    def exactness(self) -> Exactness:
        """The exactness policy in force, from --exactness, the probe (the current cost curve) and the backend."""
        return Exactness(self.cfg.exactness, self.cost, self.on_gpu, self.exact_kernels)

    @property
    def policy(self) -> str:
        """strict or batched: the policy in force (Exactness.policy)."""
        return self.exactness.policy

    @property
    def max_verify_rows(self) -> int:
        """The most rows one verification decodes under the policy in force."""
        return self.exactness.max_verify_rows

    def exactness_info(self) -> dict:
        """The probe's result and the policy in force, as stats, bench and the UI show them."""
        return self.exactness.info()

    # -- prompts (edgespec.prompts) -------------------------------------------------------

    def prompt_tokens(self, text: str | None = None, messages: list[dict] | None = None, raw: bool = False,
                      special: bool = False, tools: list[dict] | None = None) -> list[int]:
        """A prompt's tokens for the target (see prompts.prompt_tokens)."""
        return prompts.prompt_tokens(self.target, text, messages, raw, special, tools)

    def infill_tokens(self, prefix: str, suffix: str) -> list[int]:
        """A fill-in-the-middle prompt for the target (see prompts.infill_tokens)."""
        return prompts.infill_tokens(self.target, prefix, suffix)

    # -- generations ----------------------------------------------------------------------

    def make_drafter(self, method: str, seed: int | None = None) -> Drafter:
        """The drafter of a method for one generation (`seed`: the generation's, or None)."""
        return methods.build_drafter(self, method, methods.Options(seed=seed, max_branches=self.cfg.max_branches))

    def generate(self, prompt: list[int], max_tokens: int, sampling: SamplingConfig,
                 drafter: Drafter | None = None, reuse: bool = False) -> Generation:
        return Generation(self, prompt, max_tokens, sampling, drafter=drafter or NullDrafter(), reuse=reuse)

    def start(self, prompt: list[int], max_tokens: int, sampling: SamplingConfig, method: str,
              drafter: Drafter | None = None, reuse: bool = False) -> Lifecycle:
        """A generation by method name: its own scheduler, or the sequential loop with its
        drafter (`drafter` replaces the one the method would build, e.g. one sharing a trie).
        `reuse`: read only what the prompt adds to the target's cache (a conversation's next
        turn); see `Lifecycle._prologue`."""
        m = methods.get(method)
        if m.needs_draft_model and self.draft_ctx is None:
            raise EdgespecError(f"--spec {method} needs a draft model: pass -md MODEL")
        if m.start is not None:
            return m.start(self, prompt, max_tokens, sampling, reuse)
        return self.generate(prompt, max_tokens, sampling, drafter or self.make_drafter(method, sampling.seed), reuse)

    def heads_kinds(self) -> set[str]:
        """The kinds of heads this target has (asked once; see heads.store.heads_kinds)."""
        if self._kinds is None:
            self._kinds = heads_kinds(self.cfg.heads, self.target)
        return self._kinds

    # -- contexts -------------------------------------------------------------------------

    def use_streams(self, n_seq: int | None) -> Context:
        """Replace the target's context by one with `n_seq` KV streams of `-c` tokens each (batch
        decoding: a sequence's cells stay in position order in its own stream), or with `None`
        bring back the single-sequence context. The engine holds one target KV cache at a time."""
        cfg = self.cfg
        if n_seq is None:
            ccfg = self._single_config()
        else:
            ccfg = ContextConfig(self.n_ctx_seq * n_seq, max(cfg.n_batch, 32), cfg.threads, n_seq, cfg.kv_type,
                                 unified=False)
        if self.ctx.cfg == ccfg:
            return self.ctx
        self.side.close_all(bound_only=True)  # made over the context freed here
        self.ctx.close()
        self.ctx = Context(self.target, ccfg)
        self.kv = KVSeq(self.ctx)
        return self.ctx

    def _single_config(self) -> ContextConfig:
        """One sequence, with sequence ids for tree branches when the methods draft trees."""
        c = self.cfg
        return ContextConfig(c.n_ctx, c.n_batch, c.threads, max(1, c.max_branches), c.kv_type)

    def close(self) -> None:
        persist(getattr(self, "cost", None))  # what the online correction learned, for the next process
        persist(self.draft_cost)

        # side contexts run on the target model or read its context (ctx_other): free them first
        self.side.close_all()
        for obj in (self.draft_ctx, self.draft_model, self.ctx, self.target):
            if obj is not None:
                obj.close()
