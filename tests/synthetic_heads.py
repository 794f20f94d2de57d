"""Small synthetic head checkpoints in the upstream layouts, for the converter and loader tests.

Each writer puts a config.json and a weights file into a folder, named and keyed exactly as the
upstream project saves them, with random weights from a fixed seed and dimensions given by the
caller. Each returns the tensors as a loader must give them back: float32 for "float32" and
"bfloat16" (bf16 widened exactly), float16 for "float16", int64/bool as stored.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from torchfmt import Bf16, save_safetensors, save_torch

DTYPES = ("float32", "float16", "bfloat16")
TORCH_DTYPE_NAMES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}


class _Weights:
    """Random weights of one dtype, remembered both as written and as a loader returns them."""

    def __init__(self, seed: int, dtype: str) -> None:
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}")
        self.rng = np.random.default_rng(seed)
        self.dtype = dtype
        self.written: dict[str, Any] = {}
        self.expected: dict[str, np.ndarray] = {}

    def _put(self, name: str, values: np.ndarray) -> None:
        if self.dtype == "bfloat16":
            bits = Bf16.from_float(values)
            self.written[name], self.expected[name] = bits, bits.to_float()
        else:
            arr = values.astype(self.dtype)
            self.written[name], self.expected[name] = arr, arr

    def linear(self, name: str, out_dim: int, in_dim: int, scale: float = 0.02) -> None:
        self._put(name, (self.rng.standard_normal((out_dim, in_dim)) * scale).astype(np.float32))

    def vector(self, name: str, n: int, center: float = 0.0, scale: float = 0.02) -> None:
        self._put(name, (center + self.rng.standard_normal(n) * scale).astype(np.float32))

    def alias(self, name: str, of: str) -> None:
        """The same tensor under a second name (a module repeated in an nn.Sequential)."""
        self.written[name], self.expected[name] = self.written[of], self.expected[of]

    def raw(self, name: str, array: np.ndarray) -> None:
        """An integer or boolean buffer, written as is."""
        self.written[name], self.expected[name] = array, array


def _write(folder: Path, stem: str, fmt: str, weights: _Weights, config: dict) -> dict[str, np.ndarray]:
    """config.json plus `<stem>.safetensors` or `<stem>.<pt|bin>` (fmt "pt" -> the upstream torch name)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    if fmt == "safetensors":
        # safetensors has no shared tensors: an aliased tensor is written twice, as torch's
        # save_model would after cloning.
        save_safetensors(folder / f"{stem}.safetensors", weights.written, metadata={"format": "pt"})
    elif fmt == "pt":
        name = "medusa_lm_head.pt" if stem == "medusa_lm_head" else "pytorch_model.bin"
        save_torch(folder / name, weights.written)
    else:
        raise ValueError(f"fmt must be 'safetensors' or 'pt', not {fmt!r}")
    return dict(weights.expected)


# FasterDecoding/Medusa, medusa/model/medusa_model.py (MedusaConfig, ResBlock, MedusaModelABC:
# `medusa_head = nn.ModuleList([nn.Sequential(*([ResBlock(hidden)] * medusa_num_layers),
# nn.Linear(hidden, vocab, bias=False)) for _ in range(medusa_num_heads)])`), saved as
# `medusa_head.state_dict()` by medusa/train/train_legacy.py (safetensors `save_file` to
# medusa_lm_head.safetensors) and by the first release's train.py (`torch.save` to medusa_lm_head.pt).
# `[ResBlock(hidden)] * n` repeats ONE module, so with n_layers > 1 every layer of a head has the
# same weights, stored under each `{h}.{l}` name (shared storage in the .pt): tied_layers=True
# mirrors that. MedusaConfig has only medusa_num_heads, medusa_num_layers,
# base_model_name_or_path (and version="2" in train_legacy); hidden and vocab sizes come from the
# base model or the weights. own_lm_head=False (not an upstream layout) drops `{h}.{n_layers}.weight`
# so that a converter's fallback to the target's output matrix can be tested.
def write_medusa(folder: str | Path, hidden: int, vocab: int, n_heads: int, n_layers: int,
                 fmt: str = "safetensors", own_lm_head: bool = True, dtype: str = "float32",
                 tied_layers: bool = True, key_prefix: str = "", seed: int = 0,
                 base_model: str = "lmsys/vicuna-7b-v1.3") -> dict[str, np.ndarray]:
    """A Medusa head folder: config.json + medusa_lm_head.{safetensors,pt}."""
    w = _Weights(seed, dtype)
    for h in range(n_heads):
        for layer in range(n_layers):
            name = f"{key_prefix}{h}.{layer}.linear"
            if tied_layers and layer > 0:
                w.alias(f"{name}.weight", f"{key_prefix}{h}.0.linear.weight")
                w.alias(f"{name}.bias", f"{key_prefix}{h}.0.linear.bias")
            else:
                w.linear(f"{name}.weight", hidden, hidden)
                w.vector(f"{name}.bias", hidden)
        if own_lm_head:
            w.linear(f"{key_prefix}{h}.{n_layers}.weight", vocab, hidden)
    config = {
        "medusa_num_heads": n_heads,
        "medusa_num_layers": n_layers,
        "base_model_name_or_path": base_model,
        "version": "2",
        "transformers_version": "4.36.2",
    }
    return _write(Path(folder), "medusa_lm_head", fmt, w, config)


def _draft_config(hidden: int, n_heads: int, n_kv_heads: int, ffn: int, vocab: int, dtype: str,
                  rope_theta: float, rms_eps: float) -> dict[str, Any]:
    """The LlamaConfig fields EAGLE's draft configs carry (eagle/train/*_config.json)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": ffn,
        "max_position_embeddings": 2048,
        "model_type": "llama",
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "num_hidden_layers": 1,
        "pad_token_id": 0,
        "rms_norm_eps": rms_eps,
        "rope_theta": rope_theta,
        "tie_word_embeddings": False,
        "torch_dtype": TORCH_DTYPE_NAMES[dtype],
        "transformers_version": "4.28.1",
        "use_cache": True,
        "vocab_size": vocab,
    }


def _attention_mlp(w: _Weights, prefix: str, hidden: int, in_dim: int, n_heads: int, n_kv_heads: int,
                   ffn: int, qkv_bias: bool) -> None:
    """q/k/v/o projections and the SiLU-gated MLP of one draft decoder layer."""
    if hidden % n_heads or n_heads % n_kv_heads:
        raise ValueError("hidden must divide by n_heads, and n_heads by n_kv_heads")
    head_dim = hidden // n_heads
    for proj, out_dim in (("q", n_heads * head_dim), ("k", n_kv_heads * head_dim), ("v", n_kv_heads * head_dim)):
        w.linear(f"{prefix}self_attn.{proj}_proj.weight", out_dim, in_dim)
        if qkv_bias:
            w.vector(f"{prefix}self_attn.{proj}_proj.bias", out_dim)
    w.linear(f"{prefix}self_attn.o_proj.weight", hidden, n_heads * head_dim)
    w.linear(f"{prefix}mlp.gate_proj.weight", ffn, hidden)
    w.linear(f"{prefix}mlp.up_proj.weight", ffn, hidden)
    w.linear(f"{prefix}mlp.down_proj.weight", hidden, ffn)


# SafeAILab/EAGLE, eagle/model/cnets1.py (the EAGLE-1/EAGLE-2 `Model`, loaded by
# eagle/model/ea_model.py with use_eagle3=False): `embed_tokens` (nn.Embedding, frozen),
# `layers = [LlamaDecoderLayer(config, index)]` where layer 0 has NO input_layernorm
# (`if self.index != 0`), q/k/v biases only when the config has `qkv_bias` (Qwen2 drafts),
# `fc = nn.Linear(2 * hidden, hidden, bias=bias)` with bias from config.json's "bias" (default
# True; the LLaMA-3 drafts say false), and no final norm and no lm_head (the target's are used).
# ea_model.py reads pytorch_model.bin (torch.load) or model.safetensors. The config follows
# eagle/train/vicuna_7B_config.json and EAGLE-LLaMA3-Instruct-8B.
def write_eagle(folder: str | Path, hidden: int, n_heads: int, n_kv_heads: int, ffn: int, vocab: int,
                fmt: str = "pt", with_embed: bool = False, dtype: str = "float32", bias: bool = True,
                qkv_bias: bool = False, rope_theta: float = 10000.0, rms_eps: float = 1e-6,
                seed: int = 0) -> dict[str, np.ndarray]:
    """An EAGLE-1/2 draft folder: config.json + pytorch_model.bin or model.safetensors."""
    w = _Weights(seed, dtype)
    if with_embed:
        w.linear("embed_tokens.weight", vocab, hidden, scale=1.0)
    _attention_mlp(w, "layers.0.", hidden, hidden, n_heads, n_kv_heads, ffn, qkv_bias)
    w.vector("layers.0.post_attention_layernorm.weight", hidden, center=1.0)
    w.linear("fc.weight", hidden, 2 * hidden)
    if bias:
        w.vector("fc.bias", hidden)
    config = _draft_config(hidden, n_heads, n_kv_heads, ffn, vocab, dtype, rope_theta, rms_eps)
    config["bias"] = bias
    if qkv_bias:
        config["qkv_bias"] = True
    return _write(Path(folder), "model", fmt, w, config)


# SafeAILab/EAGLE, eagle/model/cnets.py (the EAGLE-3 `Model`) and eagle/traineagle3/cnets.py +
# main.py (training; saved with deepspeed `save_16bit_model(..., exclude_frozen_parameters=True)`,
# so the frozen embed_tokens is NOT in the file, while the buffers d2t and t2d are):
#   midlayer = LlamaDecoderLayeremb: self_attn.{q,k,v}_proj take 2*hidden (cat of the normed token
#     embedding and the normed feature), o_proj, hidden_norm, input_layernorm,
#     post_attention_layernorm, mlp.{gate,up,down}_proj; no biases anywhere
#   fc = nn.Linear(3 * (target_hidden_size or hidden), hidden, bias=False)
#   norm (RMSNorm), lm_head = nn.Linear(hidden, draft_vocab_size, bias=False)
#   d2t: int64 [draft_vocab], target_id = draft_id + d2t[draft_id] (`used_tokens[i] - i`)
#   t2d: bool [vocab], True for the target ids the draft vocabulary holds
# config.json: eagle/traineagle3/config.json (LlamaConfig fields + "draft_vocab_size"); the published
# heads name the architecture LlamaForCausalLMEagle3. llama.cpp's converter (conversion/llama.py)
# takes "draft_vocab_size" with num_hidden_layers == 1 as the EAGLE-3 signature, maps midlayer.* to
# layer 0, keeps d2t as int64 and skips t2d.
def write_eagle3(folder: str | Path, hidden: int, n_heads: int, n_kv_heads: int, ffn: int, vocab: int,
                 draft_vocab: int, fmt: str = "pt", dtype: str = "float32", target_hidden: int | None = None,
                 rope_theta: float = 500000.0, rms_eps: float = 1e-5, seed: int = 0) -> dict[str, np.ndarray]:
    """An EAGLE-3 draft folder: config.json + pytorch_model.bin or model.safetensors."""
    if not 0 < draft_vocab <= vocab:
        raise ValueError("draft_vocab must be in 1..vocab")
    w = _Weights(seed, dtype)
    _attention_mlp(w, "midlayer.", hidden, 2 * hidden, n_heads, n_kv_heads, ffn, qkv_bias=False)
    w.vector("midlayer.hidden_norm.weight", hidden, center=1.0)
    w.vector("midlayer.input_layernorm.weight", hidden, center=1.0)
    w.vector("midlayer.post_attention_layernorm.weight", hidden, center=1.0)
    w.linear("fc.weight", hidden, 3 * (target_hidden or hidden))
    w.vector("norm.weight", hidden, center=1.0)
    w.linear("lm_head.weight", draft_vocab, hidden)
    used = np.sort(w.rng.choice(vocab, size=draft_vocab, replace=False)).astype(np.int64)
    w.raw("d2t", used - np.arange(draft_vocab, dtype=np.int64))
    t2d = np.zeros(vocab, dtype=bool)
    t2d[used] = True
    w.raw("t2d", t2d)
    config = _draft_config(hidden, n_heads, n_kv_heads, ffn, vocab, dtype, rope_theta, rms_eps)
    config["architectures"] = ["LlamaForCausalLMEagle3"]
    config["draft_vocab_size"] = draft_vocab
    if target_hidden is not None:
        config["target_hidden_size"] = target_hidden
    return _write(Path(folder), "model", fmt, w, config)
