"""`edgespec convert eagle3 SRC --target TARGET -o OUT.gguf`: an upstream EAGLE-3 checkpoint into
llama.cpp's own `eagle3` GGUF.

Why llama.cpp's format and not edgespec's heads file: llama.cpp (as vendored in llama-cpp-python
0.3.36) runs EAGLE-3 drafts natively (`src/models/eagle3.cpp`: an encoder for the fused target
features and a one-layer decoder that borrows the target's embeddings and LM head through
`ctx_other`). Writing exactly what its converter writes (`convert_hf_to_gguf.py` with
`--target-model-dir`, `conversion/llama.py`) lets the same file drive both edgespec and llama.cpp's
`llama-speculative-simple --spec-type draft-eagle3`, and lets edgespec draft with llama.cpp's graph
instead of a numpy reimplementation.

Upstream layout (SafeAILab/EAGLE `cnets.py`, vLLM/SpecForge `LlamaForCausalLMEagle3`):
config.json with `draft_vocab_size` and `num_hidden_layers == 1`; weights `fc.weight [H, 3*Ht]`,
`midlayer.*` (or `layers.0.*`: self_attn.{q,k,v,o}_proj over 2H inputs, hidden_norm,
input_layernorm, post_attention_layernorm, mlp.{gate,up,down}_proj), `norm.weight`,
`lm_head.weight [Vd, H]`, `d2t` (int64 offsets: target id = i + d2t[i]), `t2d` (dropped), and
optionally `embed_tokens.weight` and `input_norm.weight` (EAGLE-3.1, with `norm_before_fc`).

What llama.cpp's converter writes (and so this module):

    general.architecture            "eagle3"
    eagle3.target_layers            int32[3]: config's eagle_aux_hidden_state_layer_ids, else
                                    [2, L//2, L-3] with L the target's layer count
    eagle3.target_hidden_size       config's target_hidden_size, else the target's hidden size
    eagle3.norm_before_residual / .norm_before_fc   bool (default false)
    eagle3.{block_count=1, context_length, embedding_length, feed_forward_length,
            attention.head_count, attention.head_count_kv, rope.freq_base,
            attention.layer_norm_rms_epsilon, [attention.key_length/value_length],
            [rope.scaling.*], vocab_size, rope.dimension_count}
    general.file_type, tokenizer.*  the target's tokenizer (llama.cpp's n_vocab is the target's)

    fc.weight {3Ht, H} f16, [enc.output_norm.weight {3Ht} f32], d2t {Vd} i64 (absolute ids),
    blk.0.{attn_norm, attn_norm_2, ffn_norm} f32, blk.0.attn_{q,k,v} {2H, *} f16 (q and k with
    the llama rotary permutation), blk.0.attn_output, blk.0.ffn_{gate,up,down} f16,
    output_norm f32, output {H, Vd} f16, [token_embd {H, V} f16], [rope_freqs f32 (llama3 rope)]

Plus edgespec's fingerprint of the target (`edgespec.heads.*`, see format.target_meta) so that a
draft made for another target fails with one line; llama.cpp ignores keys it does not know.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np

from .checkpoint import load_config, load_state_dict
from .format import HeadsError, finish_gguf, target_meta

ARCH = "eagle3"

# (upstream name after "midlayer."/"layers.0.", GGUF name) of the decoder layer
_LAYER = {
    "input_layernorm.weight": "blk.0.attn_norm.weight",
    "hidden_norm.weight": "blk.0.attn_norm_2.weight",
    "self_attn.q_proj.weight": "blk.0.attn_q.weight",
    "self_attn.k_proj.weight": "blk.0.attn_k.weight",
    "self_attn.v_proj.weight": "blk.0.attn_v.weight",
    "self_attn.o_proj.weight": "blk.0.attn_output.weight",
    "post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
    "mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
    "mlp.up_proj.weight": "blk.0.ffn_up.weight",
    "mlp.down_proj.weight": "blk.0.ffn_down.weight",
}


def permute_qk(w: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute`: HF stores q/k rows for rotate-half RoPE, ggml's
    LLAMA_ROPE_TYPE_NORM rotates adjacent pairs, so each head's rows are interleaved."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2)
            .reshape(w.shape))


def _strip(sd: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Drop wrapper prefixes (`model.`, `module.`) and map the layer to `layer.`."""
    out: dict[str, np.ndarray] = {}
    for k, v in sd.items():
        for p in ("module.", "model."):
            if k.startswith(p):
                k = k[len(p):]
        for p in ("midlayer.", "layers.0."):
            if k.startswith(p):
                k = "layer." + k[len(p):]
                break
        out[k] = v
    return out


def _need(sd: dict, key: str, shape: tuple, src) -> np.ndarray:
    if key not in sd:
        shown = key.replace("layer.", "midlayer.", 1) if key.startswith("layer.") else key
        raise HeadsError(f"{src}: no tensor {shown} (not an EAGLE-3 checkpoint?)")
    a = np.asarray(sd[key])
    if tuple(a.shape) != tuple(shape):
        raise HeadsError(f"{src}: {key} has shape {tuple(a.shape)}, expected {tuple(shape)}")
    return a


def _int(cfg: dict, key: str, src, default: int | None = None) -> int:
    v = cfg.get(key, default)
    if v is None:
        raise HeadsError(f"{src}: config.json has no {key}")
    return int(v)


def _rope(cfg: dict) -> tuple[float, dict]:
    """(rope theta, scaling parameters) from a config with `rope_parameters` or `rope_scaling`."""
    rp = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rp = rp.get("full_attention", rp) if isinstance(rp, dict) else {}
    theta = float(rp.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    return theta, rp


def _llama3_rope_freqs(rp: dict, theta: float, dim: int) -> np.ndarray:
    """`rope_freqs.weight` as conversion/llama.py's generate_extra_tensors makes it."""
    freqs = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor = rp.get("factor", 8.0)
    low, high = rp.get("low_freq_factor", 1.0), rp.get("high_freq_factor", 4.0)
    old_ctx = rp.get("original_max_position_embeddings", 8192)
    low_wl, high_wl = old_ctx / low, old_ctx / high
    out = []
    for f in freqs:
        wl = 2 * math.pi / f
        if wl < high_wl:
            out.append(1.0)
        elif wl > low_wl:
            out.append(factor)
        else:
            smooth = (old_ctx / wl - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


def _copy_tokenizer(w, target_path: Path) -> None:
    """Every `tokenizer.*` key of the target GGUF, byte for byte (llama.cpp's converter reads the
    target's HF tokenizer instead; the GGUF holds the same vocabulary, already converted)."""
    import gguf

    r = gguf.GGUFReader(str(target_path))
    T = gguf.GGUFValueType
    for f in r.fields.values():
        if not f.name.startswith("tokenizer."):
            continue
        vtype = f.types[0]
        if vtype == T.ARRAY:
            sub = f.types[1] if len(f.types) > 1 else None
            if sub == T.ARRAY:
                raise HeadsError(f"{target_path}: nested array {f.name} in the tokenizer cannot be copied")
            if sub == T.STRING:
                val = [bytes(f.parts[i]) for i in f.data]
            else:
                val = [f.parts[i][0] for i in f.data]
            if val:
                w.add_key_value(f.name, val, vtype, sub_type=sub)
        elif vtype == T.STRING:
            w.add_key_value(f.name, bytes(f.parts[f.data[0]]), vtype)
        else:
            w.add_key_value(f.name, f.parts[f.data[0]][0], vtype)


def convert_eagle3(src: str | os.PathLike, target_model, out: str | os.PathLike, outtype: str = "f16",
                   source_note: str = "") -> Path:
    """Convert EAGLE-3 checkpoint folder (or weights file) `src`, made for `target_model` (an
    `edgespec.llama.Model`), into llama.cpp's eagle3 GGUF `out`. `outtype` of the 2-D weights:
    "f16" (what llama.cpp's converter picks for f16/f32 checkpoints), "f32", or "q8_0" (a draft
    step on a CPU is mostly reading the LM head: half the bytes of f16). Returns the path."""
    import gguf

    if outtype not in ("f16", "f32", "q8_0"):
        raise HeadsError(f"unknown outtype {outtype!r} (f16, f32 or q8_0)")
    src = Path(src)
    folder = src if src.is_dir() else src.parent
    cfg = load_config(folder)
    if "transformer_layer_config" in cfg:  # Eagle3Speculator (RedHat speculators) nests the layer config
        cfg = {**cfg, **cfg["transformer_layer_config"]}
    if "draft_vocab_size" not in cfg or int(cfg.get("num_hidden_layers", 0)) != 1:
        raise HeadsError(f"{src}: not an EAGLE-3 checkpoint (config.json needs draft_vocab_size and "
                         f"num_hidden_layers 1)")
    sd = _strip(load_state_dict(src))

    d_t, n_vocab, n_layer_t = int(target_model.n_embd), int(target_model.n_vocab), int(target_model.n_layer)
    H = _int(cfg, "hidden_size", src)
    n_head = _int(cfg, "num_attention_heads", src)
    n_kv = _int(cfg, "num_key_value_heads", src, n_head)
    hd = int(cfg.get("head_dim") or H // n_head)
    F = _int(cfg, "intermediate_size", src)
    Vd = _int(cfg, "draft_vocab_size", src)
    Ht = int(cfg.get("target_hidden_size") or d_t)
    if Ht != d_t:
        raise HeadsError(f"{src}: made for a target of hidden size {Ht}, {Path(target_model.path).name} has {d_t}")
    aux = cfg.get("eagle_aux_hidden_state_layer_ids")
    layers = [int(x) for x in aux] if aux else [2, n_layer_t // 2, n_layer_t - 3]
    if len(layers) != 3 or not all(0 <= x <= n_layer_t for x in layers):
        raise HeadsError(f"{src}: target layers {layers} are not 3 layers of a {n_layer_t}-layer target")
    norm_before_residual = bool(cfg.get("norm_before_residual", False))
    norm_before_fc = bool(cfg.get("norm_before_fc", False))

    tensors: dict[str, np.ndarray] = {}
    tensors["fc.weight"] = _need(sd, "fc.weight", (H, 3 * Ht), src)
    if norm_before_fc:
        tensors["enc.output_norm.weight"] = _need(sd, "input_norm.weight", (3 * Ht,), src)
    shapes = {
        "input_layernorm.weight": (H,), "hidden_norm.weight": (H,),
        "self_attn.q_proj.weight": (n_head * hd, 2 * H), "self_attn.k_proj.weight": (n_kv * hd, 2 * H),
        "self_attn.v_proj.weight": (n_kv * hd, 2 * H), "self_attn.o_proj.weight": (H, n_head * hd),
        "post_attention_layernorm.weight": (H,), "mlp.gate_proj.weight": (F, H),
        "mlp.up_proj.weight": (F, H), "mlp.down_proj.weight": (H, F),
    }
    for k, shp in shapes.items():
        a = _need(sd, "layer." + k, shp, src)
        if k == "self_attn.q_proj.weight":
            a = permute_qk(a, n_head, n_head)
        elif k == "self_attn.k_proj.weight":
            a = permute_qk(a, n_head, n_kv)
        tensors[_LAYER[k]] = a
    tensors["output_norm.weight"] = _need(sd, "norm.weight", (H,), src)
    if "lm_head.weight" in sd:
        tensors["output.weight"] = _need(sd, "lm_head.weight", (Vd, H), src)
    if "embed_tokens.weight" in sd:
        emb = np.asarray(sd["embed_tokens.weight"])
        if emb.shape != (n_vocab, H):
            raise HeadsError(f"{src}: embed_tokens has shape {emb.shape}, expected ({n_vocab}, {H}) "
                             f"for {Path(target_model.path).name}")
        tensors["token_embd.weight"] = emb
    elif H != d_t:
        raise HeadsError(f"{src}: draft hidden size {H} differs from the target's {d_t} and the checkpoint has no "
                         f"embed_tokens (llama.cpp would borrow the target's {d_t}-wide embeddings)")
    if "d2t" in sd:
        off = np.asarray(sd["d2t"]).astype(np.int64).reshape(-1)
        if off.size != Vd:
            raise HeadsError(f"{src}: d2t has {off.size} entries, draft_vocab_size is {Vd}")
        ids = off + np.arange(Vd, dtype=np.int64)
        if ids.min() < 0 or ids.max() >= n_vocab:
            raise HeadsError(f"{src}: d2t maps to ids outside the target's {n_vocab} tokens (made for another target?)")
        if np.unique(ids).size != ids.size:
            raise HeadsError(f"{src}: d2t maps two draft tokens to the same target token")
        tensors["d2t"] = ids
    elif Vd != n_vocab:
        raise HeadsError(f"{src}: no d2t, and the draft vocabulary ({Vd}) is not the target's ({n_vocab})")
    if "output.weight" not in tensors and Vd != n_vocab:
        raise HeadsError(f"{src}: no lm_head for the {Vd}-token draft vocabulary (the target's covers {n_vocab})")
    theta, rp = _rope(cfg)
    rope_type = str(rp.get("rope_type", rp.get("type", "")) or "").lower()
    if rope_type == "llama3":
        tensors["rope_freqs.weight"] = _llama3_rope_freqs(rp, theta, hd)

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".part")
    w = gguf.GGUFWriter(str(tmp), ARCH)
    a = ARCH
    w.add_name(f"EAGLE-3 draft for {Path(target_model.path).stem}")
    T = gguf.GGUFValueType
    w.add_key_value(f"{a}.target_layers", layers, T.ARRAY, sub_type=T.INT32)
    w.add_uint32(f"{a}.target_hidden_size", Ht)
    w.add_bool(f"{a}.norm_before_residual", norm_before_residual)
    w.add_bool(f"{a}.norm_before_fc", norm_before_fc)
    w.add_block_count(1)
    n_ctx = cfg.get("max_position_embeddings")
    if n_ctx is not None:
        w.add_context_length(int(n_ctx))
    w.add_embedding_length(H)
    w.add_feed_forward_length(F)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    if rope_type == "linear" and rp.get("factor") is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(rp["factor"]))
    elif rope_type == "yarn" and rp.get("factor") is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(rp["factor"]))
        w.add_rope_scaling_orig_ctx_len(int(rp["original_max_position_embeddings"]))
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
    if cfg.get("head_dim") is not None:
        w.add_key_length(hd)
        w.add_value_length(hd)
    w.add_file_type({"f16": gguf.LlamaFileType.MOSTLY_F16, "f32": gguf.LlamaFileType.ALL_F32,
                     "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[outtype])
    w.add_vocab_size(int(cfg.get("vocab_size", n_vocab)))
    w.add_rope_dimension_count(hd)
    _copy_tokenizer(w, Path(target_model.path))
    meta = target_meta(target_model)
    meta["heads.kind"] = "eagle3"
    meta["heads.source"] = source_note or f"converted from {src.resolve()}"
    for k, v in sorted(meta.items()):
        if isinstance(v, (int, np.integer)) and not isinstance(v, bool):
            w.add_uint32("edgespec." + k, int(v))
        else:
            w.add_string("edgespec." + k, str(v))
    for name, t in tensors.items():
        if name == "d2t":
            w.add_tensor(name, np.ascontiguousarray(t, np.int64))
        elif t.ndim <= 1 or name.endswith("_norm.weight"):
            w.add_tensor(name, np.ascontiguousarray(t, np.float32))
        elif outtype == "q8_0" and t.shape[-1] % 32 == 0:
            q = gguf.quants.quantize(np.ascontiguousarray(t, np.float32), gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:  # (q8_0 rows must be whole blocks of 32; llama.cpp's converter falls back to f16 too)
            w.add_tensor(name, np.ascontiguousarray(t, np.float32 if outtype == "f32" else np.float16))
    return finish_gguf(w, tmp, out)
