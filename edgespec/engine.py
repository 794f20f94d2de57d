"""The engine: the loaded target (and draft) model, their contexts and the cost curve.

The engine owns every llama.cpp context: one for the target (swapped for one of several KV
streams while a batch decodes many sequences, never both at once), one for the draft model, and
the drafters' side contexts in one declared map (`side`: MTP, EAGLE-3, heads, lookahead's
calibration), which it closes without knowing what they are. Generations are started by method
name through the registry (`methods`); heads are found by `heads.store`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from . import chat, methods
from .costmodel import CostModel, load_or_measure
from .drafters.base import Drafter, NullDrafter
from .errors import EdgespecError
from .kv import KVSeq
from .lifecycle import Lifecycle
from .llama import Context, ContextConfig, Model, batch_dependent, kv_paths_agree, use_exact_kernels
from .sampling import SamplingConfig
from .schedulers.sequential import Generation
from .side import SideContexts

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    model: str
    draft: str | None = None
    n_ctx: int = 4096
    n_batch: int = 512
    threads: int = 0
    threads_draft: int = 0
    n_gpu_layers: int = 0
    n_gpu_layers_draft: int = 0
    draft_n_max: int = 16
    draft_n_min: int = 0
    draft_p_min: float = 0.0
    lookahead_cache: str | None = None
    max_branches: int = 8
    kv_type: str = "q8_0/f16"  # K/V cache types (llama.kv_types)
    pearl_gamma: int = 4
    heads: str | None = None  # a heads file (--heads): Medusa or EAGLE
    exactness: str = "auto"  # auto | strict | batched (see costmodel.resolve_policy)
    # K-quant weights on a CPU under strict: per-row kernels at every batch size (docs/exactness.md)
    exact_kernels: bool = False
    rpc: tuple[str, ...] = ()  # llama.cpp RPC servers (HOST:PORT) for the target's offloaded layers
    rpc_draft: tuple[str, ...] = ()  # and for the draft model's (default: the draft stays here)


class Engine:
    """A loaded target model (and draft model, if any) with its cost curve."""

    def __init__(self, cfg: EngineConfig, quiet: bool = True):
        from .models import cache_root, resolve

        self.cfg = cfg
        # what drafters keep across generations (MTP and EAGLE-3 contexts, heads, lookahead's
        # calibration), by name; each closes itself, those bound to `ctx` before it is swapped
        self.side = SideContexts()
        target_devs, draft_devs = self._devices()
        path = resolve(cfg.model, quiet=quiet)
        # K-quant weights on a CPU (--exact-kernels): the kernels whose rows do not depend on the
        # batch, so that verifying up to 32 rows stays bit-identical to plain decoding, at ~1.5x
        # the plain step (docs/exactness.md)
        self.exact_kernels = self._wants_exact_kernels(path) and use_exact_kernels()
        # nextn (MTP) layers, where the model has them, are loaded for --spec mtp (one layer more)
        self.target = Model(path, cfg.n_gpu_layers, load_mtp=True, devices=target_devs,
                            repack=not self.exact_kernels)
        self.ctx = Context(self.target, self._single_config())
        self.kv = KVSeq(self.ctx)
        self.n_ctx_seq = self.ctx.n_ctx  # tokens per sequence (-c, capped by the model's training length)
        self.draft_model: Model | None = None
        self.draft_ctx: Context | None = None
        self.draft_kv: KVSeq | None = None
        if cfg.draft:
            from .drafters.draft_model import check_vocab

            self.draft_model = Model(resolve(cfg.draft, quiet=quiet), cfg.n_gpu_layers_draft, devices=draft_devs)
            check_vocab(self.target, self.draft_model)
            self.draft_ctx = Context(
                self.draft_model, ContextConfig(self.ctx.n_ctx, cfg.n_batch, cfg.threads_draft or cfg.threads, 1, cfg.kv_type)
            )
            self.draft_kv = KVSeq(self.draft_ctx)  # one per context: its token list is the cache's
            self.draft_cost = load_or_measure(self.draft_ctx, self.draft_kv, cache_root() / "costs.json",
                                              cfg.n_gpu_layers_draft, quiet, tag=",".join(cfg.rpc_draft))
        self._kinds: set[str] | None = None
        self.cost: CostModel = load_or_measure(self.ctx, self.kv, cache_root() / "costs.json", cfg.n_gpu_layers, quiet,
                                               tag=",".join(cfg.rpc))
        self._gpu = None  # whether the target runs on a GPU here (asked once, lazily)
        self.kv.reset()  # the probes' tokens are no conversation to reuse
        self._note_exactness(quiet)
        if not kv_paths_agree(cfg.kv_type) and self.cost.max_exact_rows <= 1 and self.policy == "strict":
            log.warning("with an %s KV cache, llama.cpp's CPU attention takes one kernel for one row and another for "
                        "many past 512 cells (the probe found no batch bit-identical to one-row decodes): "
                        "speculation then verifies one row at a time; a q8_0 K cache (the q8_0/f16 default) keeps "
                        "batches exact", cfg.kv_type)

    def remeasure_cost(self, quiet: bool = True) -> None:
        """Measure the cost of verifying k rows (and the exactness probe) again for the target and
        the draft model, replacing the cached curves: after the machine's load or hardware changed."""
        from .models import cache_root

        cfg = self.cfg
        if self.draft_model is not None:
            self.draft_cost = load_or_measure(self.draft_ctx, self.draft_kv, cache_root() / "costs.json",
                                              cfg.n_gpu_layers_draft, quiet, tag=",".join(cfg.rpc_draft), force=True)
        self.cost = load_or_measure(self.ctx, self.kv, cache_root() / "costs.json", cfg.n_gpu_layers, quiet,
                                    tag=",".join(cfg.rpc), force=True)
        self.kv.reset()

    def heal_cost(self, quiet: bool = True) -> list[str]:
        """Between generations (never during one): measure again each cost curve whose online
        corrections stayed far from 1 (see costmodel.heal), reading back what the cache held, and
        write back what the corrections learned. Returns why each curve was measured again."""
        from .costmodel import due, heal, persist

        healed = []
        for attr, ctx, kv in (("cost", self.ctx, self.kv), ("draft_cost", self.draft_ctx, self.draft_kv)):
            cm = getattr(self, attr, None)
            if cm is None or ctx is None:
                continue
            why = due(cm)
            if why:
                held = list(kv.tokens)  # a conversation's cache (KV reuse): read back after measuring
                setattr(self, attr, heal(ctx, kv, cm, why, quiet))
                if held:
                    kv.extend(held, want_logits=False)
                healed.append(why)
            else:
                persist(cm)
        return healed

    def _devices(self) -> tuple[list[int] | None, list[int] | None]:
        """Devices for the target and the draft model: with --rpc the target offloads to those
        servers (and this machine's GPUs), the draft model only to this machine's GPUs unless
        --rpc-draft names servers for it. Without RPC: llama.cpp's default (every device)."""
        cfg = self.cfg
        if not cfg.rpc and not cfg.rpc_draft:
            return None, None
        from .backend import add_rpc_servers, local_gpu_devices

        target = add_rpc_servers(list(cfg.rpc)) if cfg.rpc else []
        draft = add_rpc_servers(list(cfg.rpc_draft)) if cfg.rpc_draft else []
        local = local_gpu_devices()
        if cfg.rpc and cfg.n_gpu_layers == 0:
            log.warning("--rpc: the target's layers stay here with -ngl 0; -ngl N (or -1: all) offloads them to "
                        "the RPC servers")
        return local + target, local + draft

    # -- exactness -------------------------------------------------------------------------

    def _wants_exact_kernels(self, path) -> bool:
        """Per-row kernels asked for, under strict exactness (asked, or auto's choice on a CPU), for
        a model all on the CPU whose weights take batch-dependent kernels there: the repacked Q4_K
        GEMM from 4 rows and the tiled K-quant kernel from 8 made Qwen2.5-Coder-1.5B Q4_K_M exact
        to only 3 rows."""
        cfg = self.cfg
        return (cfg.exact_kernels and cfg.exactness != "batched" and cfg.n_gpu_layers == 0 and not cfg.rpc
                and batch_dependent(path))

    @property
    def on_gpu(self) -> bool:
        if self._gpu is None:
            from .backend import on_gpu

            self._gpu = on_gpu(self.cfg.n_gpu_layers)
        return self._gpu

    @property
    def policy(self) -> str:
        """The exactness policy in force (strict or batched), from --exactness and the probe."""
        from .costmodel import resolve_policy

        return resolve_policy(self.cfg.exactness, self.cost.max_exact_rows, self.on_gpu)

    @property
    def max_verify_rows(self) -> int:
        """The most rows one verification decodes under the policy in force."""
        from .costmodel import verify_rows

        return verify_rows(self.cost, self.policy)

    def exactness_info(self) -> dict:
        """The probe's result and the policy in force, as stats, bench and the UI show them."""
        from .costmodel import guarantee

        c, policy = self.cost, self.policy
        return {"policy": policy, "requested": self.cfg.exactness, "backend": "gpu" if self.on_gpu else "cpu",
                "kernels": "per-row" if self.exact_kernels else "default",
                "max_exact_rows": c.max_exact_rows, "max_verify_rows": self.max_verify_rows,
                "batch_logit_diff": c.batch_logit_diff, "guarantee": guarantee(policy, c)}

    def _note_exactness(self, quiet: bool) -> None:
        c, policy = self.cost, self.policy
        name = self.target.path.name
        if policy == "batched" and c.max_exact_rows < 32:
            log.warning("%s: batched logits differ from one-row decodes on this backend (bit-exact up to %d rows, "
                        "max |delta logit| %s): verifying in batches anyway (--exactness %s): %s; --exactness strict "
                        "keeps greedy output bit-identical instead", name, c.max_exact_rows,
                        "?" if c.batch_logit_diff is None else f"{c.batch_logit_diff:.3g}", self.cfg.exactness,
                        "sampled output follows the distribution as this backend computes it, greedy output can "
                        "differ from plain decoding at near-ties")
        elif policy == "strict" and c.max_exact_rows <= 1:
            log.warning("%s: no batch of rows is bit-exact against one-row decodes on this backend, so strict "
                        "exactness leaves nothing to verify: speculation is off (--exactness batched turns it on, "
                        "guaranteeing the distribution, not bit-identical greedy output)", name)

    # -- prompts --------------------------------------------------------------------------

    def prompt_tokens(self, text: str | None = None, messages: list[dict] | None = None, raw: bool = False,
                      special: bool = False, tools: list[dict] | None = None) -> list[int]:
        """A prompt's tokens: `text` as is (`raw`), else the messages (or `text` as one user
        message) in the model's chat template. Control tokens (`<|im_start|>`) are read only in
        the template's own text: a message's content is text whatever it holds, and so is raw
        text unless `special` (the command line's `run --raw`, whose user writes the prompt).
        `tools` (OpenAI's function tools) are offered through the template when it takes them,
        else in the generic tool prompt (edgespec.tools); tool calls and results in the history
        are rendered the same way."""
        m = self.target
        if raw:
            return m.tokenize(text or "", add_special=True, parse_special=special)
        if messages is None:
            messages = [{"role": "user", "content": text or ""}]
        if tools or any(x.get("tool_calls") or x["role"] == "tool" for x in messages):
            from . import tools as tools_mod

            # what a template renders itself (the tools, the calls' JSON) must not smuggle a control token
            own = [tools, [x.get("tool_calls") for x in messages]]
            if m.has_control_text(json.dumps(own, ensure_ascii=False)):
                raise EdgespecError("the tools or the tool calls hold a control token's text")
            messages, tools = tools_mod.for_template(m.chat_template, messages, tools)
        bos = m.token_text(m.bos) if m.bos >= 0 else ""
        eos = m.token_text(m.eos) if m.eos >= 0 else ""
        parts = chat.render_parts(m.chat_template, messages, bos, eos, add_generation_prompt=True,
                                  has_marker=m.has_control_text, tools=tools)
        add_bos = m.add_bos and not (bos and parts and parts[0][1] and parts[0][0].startswith(bos))
        return ([m.bos] if add_bos else []) + m.tokenize_parts(parts)

    def infill_tokens(self, prefix: str, suffix: str) -> list[int]:
        """A fill-in-the-middle prompt (prefix-suffix-middle order, as llama.cpp's server's
        infill): the model writes what goes between `prefix` and `suffix`. Both are text (never
        a control token); EdgespecError when the vocabulary has no FIM tokens."""
        m = self.target
        fim = m.fim_tokens
        if fim is None:
            raise EdgespecError("this model's vocabulary has no fill-in-the-middle tokens")
        pre, suf, mid = fim
        text = lambda s: m.tokenize(s, add_special=False, parse_special=False)  # noqa: E731
        return ([m.bos] if m.add_bos and m.bos >= 0 else []) + [pre, *text(prefix), suf, *text(suffix), mid]

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
        if m.scheduler == "pearl":
            from .schedulers.pearl import PearlGeneration

            return PearlGeneration(self, prompt, max_tokens, sampling, reuse=reuse, gamma=self.cfg.pearl_gamma)
        return self.generate(prompt, max_tokens, sampling, drafter or self.make_drafter(method, sampling.seed), reuse)

    # -- heads ----------------------------------------------------------------------------

    def heads_kinds(self) -> set[str]:
        """The kinds of heads this target has (asked once; see heads.store.heads_kinds)."""
        if self._kinds is None:
            from .heads.store import heads_kinds

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
        from .costmodel import persist

        persist(getattr(self, "cost", None))  # what the online correction learned, for the next process
        persist(getattr(self, "draft_cost", None))

        # side contexts run on the target model or read its context (ctx_other): free them first
        self.side.close_all()
        for obj in (self.draft_ctx, self.draft_model, self.ctx, self.target):
            if obj is not None:
                obj.close()
