"""`edgespec convert medusa|eagle SRC --target TARGET -o OUT.gguf`: a published checkpoint folder
(or one written by `edgespec train`) into an edgespec heads file.

Upstream layouts (read from the projects' own code):

- Medusa (FasterDecoding/Medusa, `medusa_model.py`): `config.json` with `medusa_num_heads`,
  `medusa_num_layers`; `medusa_lm_head.safetensors|.pt` holding the `medusa_head` ModuleList:
  `{h}.{l}.linear.weight|bias` (ResBlock l of head h) and `{h}.{n_layers}.weight` (head h's own
  LM head; absent: tied to the target's).
- EAGLE-1/2 (SafeAILab/EAGLE, `cnets1.py`/`cnets.py`): `config.json` (a LlamaConfig of the draft
  layer) and `pytorch_model.bin|model.safetensors`: `fc.weight|bias` over cat(embedding, feature),
  `layers.0.self_attn.{q,k,v,o}_proj.*`, `layers.0.post_attention_layernorm.weight`,
  `layers.0.mlp.{gate,up,down}_proj.weight`, optionally `embed_tokens.weight`.

Heads trained by `edgespec train` add `draft_vocab` (int64 token ids) to the same files.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from .checkpoint import load_config, load_state_dict
from .format import HeadsError, HeadsFile, target_meta, write_heads


def _strip(sd: dict[str, np.ndarray], prefixes: tuple[str, ...]) -> dict[str, np.ndarray]:
    out = {}
    for k, v in sd.items():
        for p in prefixes:
            if k.startswith(p):
                k = k[len(p):]
                break
        out[k] = v
    return out


def _need(sd: dict, key: str, shape: tuple | None, src) -> np.ndarray:
    if key not in sd:
        raise HeadsError(f"{src}: no tensor {key} (not a checkpoint of this kind?)")
    a = sd[key]
    if shape is not None and tuple(a.shape) != tuple(shape):
        raise HeadsError(f"{src}: {key} has shape {tuple(a.shape)}, expected {tuple(shape)}")
    return a


def medusa_tensors(cfg: dict, sd: dict[str, np.ndarray], d: int, n_vocab: int, src) -> tuple[dict, dict]:
    sd = _strip(sd, ("medusa_head.", "module.medusa_head."))
    # Heads are counted from the weights: Medusa's own loader overrides medusa_num_heads ("fix the
    # uploaded config"), so published configs may not match their files.
    heads = {int(k.split(".")[0]) for k in sd if k.split(".")[0].isdigit() and ".linear." in k}
    if not heads:
        raise HeadsError(f"{src}: no tensor {{h}}.{{l}}.linear.weight (not a Medusa checkpoint?)")
    n_heads = max(heads) + 1
    n_layers = int(cfg.get("medusa_num_layers") or 1 + max(int(k.split(".")[1]) for k in sd if ".linear." in k))
    meta = {"medusa.n_heads": n_heads, "medusa.n_layers": n_layers}
    t: dict[str, np.ndarray] = {}
    for h in range(n_heads):
        for l in range(n_layers):
            t[f"medusa.{h}.res.{l}.weight"] = _need(sd, f"{h}.{l}.linear.weight", (d, d), src)
            t[f"medusa.{h}.res.{l}.bias"] = _need(sd, f"{h}.{l}.linear.bias", (d,), src)
        own = sd.get(f"{h}.{n_layers}.weight")
        if own is not None:
            if own.shape[1] != d:
                raise HeadsError(f"{src}: head {h}'s LM head has shape {own.shape}, expected [*, {d}]")
            t[f"medusa.{h}.output.weight"] = own
    return meta, t


_EAGLE_NAMES = {
    "fc.weight": "eagle.fc.weight", "fc.bias": "eagle.fc.bias",
    "layers.0.self_attn.q_proj.weight": "eagle.attn_q.weight",
    "layers.0.self_attn.k_proj.weight": "eagle.attn_k.weight",
    "layers.0.self_attn.v_proj.weight": "eagle.attn_v.weight",
    "layers.0.self_attn.q_proj.bias": "eagle.attn_q.bias",
    "layers.0.self_attn.k_proj.bias": "eagle.attn_k.bias",
    "layers.0.self_attn.v_proj.bias": "eagle.attn_v.bias",
    "layers.0.self_attn.o_proj.weight": "eagle.attn_output.weight",
    "layers.0.post_attention_layernorm.weight": "eagle.ffn_norm.weight",
    "layers.0.mlp.gate_proj.weight": "eagle.ffn_gate.weight",
    "layers.0.mlp.up_proj.weight": "eagle.ffn_up.weight",
    "layers.0.mlp.down_proj.weight": "eagle.ffn_down.weight",
    "embed_tokens.weight": "eagle.token_embd.weight",
    "lm_head.weight": "eagle.output.weight",
}


def eagle_tensors(cfg: dict, sd: dict[str, np.ndarray], d: int, n_vocab: int, src) -> tuple[dict, dict]:
    sd = _strip(sd, ("model.", "module."))
    if "midlayer.self_attn.q_proj.weight" in sd:
        raise HeadsError(f"{src} is an EAGLE-3 checkpoint: convert it with `edgespec convert eagle3`")
    hidden = int(cfg.get("hidden_size", d))
    if hidden != d:
        raise HeadsError(f"{src}: hidden size {hidden}, the target's is {d}")
    n_head = int(cfg.get("num_attention_heads", 0))
    n_kv = int(cfg.get("num_key_value_heads", n_head))
    hd = int(cfg.get("head_dim") or (d // n_head if n_head else 0))
    if not n_head or not hd:
        raise HeadsError(f"{src}: config.json has no num_attention_heads")
    ff = int(cfg.get("intermediate_size", 0))
    meta = {"eagle.n_head": n_head, "eagle.n_head_kv": n_kv, "eagle.head_dim": hd, "eagle.n_ff": ff,
            "eagle.rope_theta": float(cfg.get("rope_theta", 10000.0)), "eagle.rms_eps": float(cfg.get("rms_norm_eps", 1e-6))}
    shapes = {"fc.weight": (d, 2 * d), "layers.0.self_attn.q_proj.weight": (n_head * hd, d),
              "layers.0.self_attn.k_proj.weight": (n_kv * hd, d), "layers.0.self_attn.v_proj.weight": (n_kv * hd, d),
              "layers.0.self_attn.o_proj.weight": (d, n_head * hd), "layers.0.post_attention_layernorm.weight": (d,),
              "layers.0.mlp.gate_proj.weight": (ff, d), "layers.0.mlp.up_proj.weight": (ff, d),
              "layers.0.mlp.down_proj.weight": (d, ff)}
    t = {_EAGLE_NAMES[k]: _need(sd, k, shp, src) for k, shp in shapes.items()}
    for k in ("fc.bias", "layers.0.self_attn.q_proj.bias", "layers.0.self_attn.k_proj.bias",
              "layers.0.self_attn.v_proj.bias", "embed_tokens.weight", "lm_head.weight"):
        if k in sd:
            t[_EAGLE_NAMES[k]] = sd[k]
    emb = t.get("eagle.token_embd.weight")
    if emb is not None and emb.shape != (n_vocab, d):
        raise HeadsError(f"{src}: embed_tokens has shape {emb.shape}, the target has {n_vocab} tokens of {d}")
    return meta, t


_MTP_NAMES = {
    "eh_proj.weight": "mtp.fc.weight", "enorm.weight": "mtp.enorm.weight", "hnorm.weight": "mtp.hnorm.weight",
    "input_layernorm.weight": "mtp.attn_norm.weight",
    "self_attn.q_proj.weight": "mtp.attn_q.weight", "self_attn.k_proj.weight": "mtp.attn_k.weight",
    "self_attn.v_proj.weight": "mtp.attn_v.weight", "self_attn.o_proj.weight": "mtp.attn_output.weight",
    "post_attention_layernorm.weight": "mtp.ffn_norm.weight",
    "mlp.gate_proj.weight": "mtp.ffn_gate.weight", "mlp.up_proj.weight": "mtp.ffn_up.weight",
    "mlp.down_proj.weight": "mtp.ffn_down.weight", "shared_head.norm.weight": "mtp.output_norm.weight",
    "shared_head.head.weight": "mtp.output.weight", "embed_tokens.weight": "mtp.token_embd.weight",
}


def mtp_tensors(cfg: dict, sd: dict[str, np.ndarray], d: int, n_vocab: int, src) -> tuple[dict, dict]:
    """DeepSeek-V3's MTP module as its Hugging Face checkpoints hold it (`model.layers.{N}.*`
    past the main layers: enorm, hnorm, eh_proj, a decoder layer, shared_head.norm); dense MLP only."""
    import re

    sd = {re.sub(r"^(model\.)?layers\.\d+\.", "", k): v for k, v in sd.items()}
    if "eh_proj.weight" not in sd:
        raise HeadsError(f"{src}: no tensor eh_proj.weight (not an MTP module?)")
    meta, _ = _attention_shape(cfg, d, src, "mtp")
    n_head, n_kv, hd, ff = (meta[f"mtp.{k}"] for k in ("n_head", "n_head_kv", "head_dim", "n_ff"))
    shapes = {"eh_proj.weight": (d, 2 * d), "enorm.weight": (d,), "hnorm.weight": (d,), "input_layernorm.weight": (d,),
              "self_attn.q_proj.weight": (n_head * hd, d), "self_attn.k_proj.weight": (n_kv * hd, d),
              "self_attn.v_proj.weight": (n_kv * hd, d), "self_attn.o_proj.weight": (d, n_head * hd),
              "post_attention_layernorm.weight": (d,), "mlp.gate_proj.weight": (ff, d), "mlp.up_proj.weight": (ff, d),
              "mlp.down_proj.weight": (d, ff), "shared_head.norm.weight": (d,)}
    t = {_MTP_NAMES[k]: _need(sd, k, shp, src) for k, shp in shapes.items()}
    for k in ("shared_head.head.weight", "embed_tokens.weight"):
        if k in sd:
            if sd[k].shape != (n_vocab, d):
                raise HeadsError(f"{src}: {k} has shape {sd[k].shape}, expected {(n_vocab, d)}")
            t[_MTP_NAMES[k]] = sd[k]
    return meta, t


def _attention_shape(cfg: dict, d: int, src, prefix: str) -> tuple[dict, None]:
    hidden = int(cfg.get("hidden_size", d))
    if hidden != d:
        raise HeadsError(f"{src}: hidden size {hidden}, the target's is {d}")
    n_head = int(cfg.get("num_attention_heads", 0))
    if not n_head:
        raise HeadsError(f"{src}: config.json has no num_attention_heads")
    n_kv = int(cfg.get("num_key_value_heads", n_head))
    hd = int(cfg.get("head_dim") or d // n_head)
    return {f"{prefix}.n_head": n_head, f"{prefix}.n_head_kv": n_kv, f"{prefix}.head_dim": hd,
            f"{prefix}.n_ff": int(cfg.get("intermediate_size", 0)),
            f"{prefix}.rope_theta": float(cfg.get("rope_theta", 10000.0)),
            f"{prefix}.rms_eps": float(cfg.get("rms_norm_eps", 1e-6))}, None


def convert(kind: str, src: str | os.PathLike, target, out: str | os.PathLike, source_note: str = "") -> Path:
    """Convert checkpoint folder (or file) `src` for `target` (an llama.Model) into `out`."""
    src = Path(src)
    folder = src if src.is_dir() else src.parent
    cfg = load_config(folder)
    sd = load_state_dict(src)
    meta = target_meta(target)
    d, n_vocab = meta["heads.n_embd"], meta["heads.n_vocab"]
    if kind == "medusa":
        extra, tensors = medusa_tensors(cfg, sd, d, n_vocab, src)
    elif kind == "eagle":
        extra, tensors = eagle_tensors(cfg, sd, d, n_vocab, src)
    elif kind == "mtp":
        extra, tensors = mtp_tensors(cfg, sd, d, n_vocab, src)
    else:
        raise HeadsError(f"cannot convert {kind!r} here (medusa, eagle; eagle3 has its own converter)")
    vocab = sd.get("draft_vocab")
    if vocab is not None:
        vocab = np.asarray(vocab, np.int64)
        if vocab.ndim != 1 or vocab.min() < 0 or vocab.max() >= n_vocab:
            raise HeadsError(f"{src}: draft_vocab holds ids outside the target's {n_vocab} tokens")
        tensors["draft_vocab"] = vocab
    meta.update(extra)
    meta["heads.source"] = source_note or f"converted from {src.resolve()}"
    return write_heads(out, HeadsFile(kind, meta, tensors))
