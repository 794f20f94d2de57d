"""The heads as JAX functions, with their losses (the `edgespec[train]` extra; never imported at run time).

Parameters use the names of the upstream checkpoints (Medusa's `medusa_head` ModuleList, EAGLE's
`fc` and `layers.0.*`), so exporting is writing the dict as it is. The target's LM head
(restricted to the draft vocabulary) and its token embeddings are frozen inputs, not parameters.
The layer math is the runtime's (`heads/runtime.py`): the same RoPE, norms and masks.
"""

from __future__ import annotations

import numpy as np


def _jnp():
    import jax.numpy as jnp

    return jnp


# -- Medusa-1: heads on the frozen target's last feature --------------------------------------

def medusa_init(d: int, n_heads: int, n_layers: int) -> dict:
    """Zero ResBlocks: every head starts as the target's own next-token prediction (as Medusa)."""
    p = {}
    for h in range(n_heads):
        for l in range(n_layers):
            p[f"{h}.{l}.linear.weight"] = np.zeros((d, d), np.float32)
            p[f"{h}.{l}.linear.bias"] = np.zeros((d,), np.float32)
    return p


def medusa_logits(params: dict, feats, lm_t, n_heads: int, n_layers: int):
    """feats [B, d] -> logits [B, n_heads, K] over the draft vocabulary (lm_t: [d, K])."""
    import jax

    jnp = _jnp()
    outs = []
    for h in range(n_heads):
        x = feats
        for l in range(n_layers):
            x = x + jax.nn.silu(x @ params[f"{h}.{l}.linear.weight"].T + params[f"{h}.{l}.linear.bias"])
        outs.append(x @ lm_t)
    return jnp.stack(outs, 1)


def medusa_loss(params, feats, labels, lm_t, n_heads: int, n_layers: int, decay: float = 0.8):
    """Medusa-1: cross-entropy per head against the target's token k+2 places ahead, weighted
    decay**k. labels [B, n_heads] (draft vocabulary index, -1: none)."""
    import jax

    jnp = _jnp()
    logits = medusa_logits(params, feats, lm_t, n_heads, n_layers)
    logp = jax.nn.log_softmax(logits, -1)
    ok = labels >= 0
    nll = -jnp.take_along_axis(logp, jnp.maximum(labels, 0)[..., None], -1)[..., 0]
    w = decay ** jnp.arange(n_heads)
    per_head = (nll * ok).sum(0) / jnp.maximum(ok.sum(0), 1)
    return (per_head * w).sum() / w.sum(), logits


# -- EAGLE-1/2: one decoder layer over (token embedding, feature) -----------------------------

def eagle_init(d: int, n_head: int, n_kv: int, hd: int, ff: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    g = lambda *s: rng.normal(0.0, 0.02, s).astype(np.float32)  # noqa: E731
    fc = np.concatenate([np.zeros((d, d), np.float32), np.eye(d, dtype=np.float32)], 1)  # start: pass the feature on
    return {
        "fc.weight": fc + g(d, 2 * d) * 0.1, "fc.bias": np.zeros(d, np.float32),
        "layers.0.self_attn.q_proj.weight": g(n_head * hd, d),
        "layers.0.self_attn.k_proj.weight": g(n_kv * hd, d),
        "layers.0.self_attn.v_proj.weight": g(n_kv * hd, d),
        "layers.0.self_attn.o_proj.weight": g(d, n_head * hd) * 0.1,
        "layers.0.post_attention_layernorm.weight": np.ones(d, np.float32),
        "layers.0.mlp.gate_proj.weight": g(ff, d),
        "layers.0.mlp.up_proj.weight": g(ff, d),
        "layers.0.mlp.down_proj.weight": g(d, ff) * 0.1,
    }


def mtp_init(d: int, n_head: int, n_kv: int, hd: int, ff: int, seed: int = 0) -> dict:
    """DeepSeek-V3's MTP module in EAGLE's names plus its norms (exported under DeepSeek's names)."""
    p = eagle_init(d, n_head, n_kv, hd, ff, seed)
    del p["fc.bias"]
    ones = lambda: np.ones(d, np.float32)  # noqa: E731
    p.update({"enorm.weight": ones(), "hnorm.weight": ones(), "layers.0.input_layernorm.weight": ones(),
              "norm.weight": ones()})
    return p


# our parameter name -> DeepSeek-V3's (under model.layers.{n_layer}.)
MTP_EXPORT = {"fc.weight": "eh_proj.weight", "enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight",
              "norm.weight": "shared_head.norm.weight"}


def mtp_export_name(k: str) -> str:
    return MTP_EXPORT.get(k) or k.replace("layers.0.", "", 1)


def _rms(x, w, eps):
    jnp = _jnp()
    return x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * w


def _rope(x, pos, theta: float):
    jnp = _jnp()
    hd = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd)
    ang = pos[..., None].astype(jnp.float32) * jnp.asarray(inv, jnp.float32)
    ang = jnp.concatenate([ang, ang], -1)[..., None, :]  # [B, T, 1, hd]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return x * jnp.cos(ang) + jnp.concatenate([-x2, x1], -1) * jnp.sin(ang)


def eagle_forward(params: dict, emb, feats, pos, valid, n_head: int, n_kv: int, hd: int, theta: float, eps: float):
    """emb, feats [B, T, d] (token at i+1, feature at i), pos [B, T]; causal attention within a
    row among valid positions -> predicted features at i+1 [B, T, d]."""
    import jax

    jnp = _jnp()
    B, T, _ = feats.shape
    P = lambda k: params["layers.0." + k]  # noqa: E731
    if "enorm.weight" in params:  # MTP: both inputs normed first
        emb, feats = _rms(emb, params["enorm.weight"], eps), _rms(feats, params["hnorm.weight"], eps)
    x = jnp.concatenate([emb, feats], -1) @ params["fc.weight"].T
    if "fc.bias" in params:
        x = x + params["fc.bias"]
    a_in = _rms(x, P("input_layernorm.weight"), eps) if "layers.0.input_layernorm.weight" in params else x
    q = _rope((a_in @ P("self_attn.q_proj.weight").T).reshape(B, T, n_head, hd), pos, theta)
    k = _rope((a_in @ P("self_attn.k_proj.weight").T).reshape(B, T, n_kv, hd), pos, theta)
    v = (a_in @ P("self_attn.v_proj.weight").T).reshape(B, T, n_kv, hd)
    g = n_head // n_kv
    qg = q.reshape(B, T, n_kv, g, hd)
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k) / np.sqrt(hd)
    mask = jnp.tril(jnp.ones((T, T), bool))[None] & valid[:, None, :]
    s = jnp.where(mask[:, None, None], s, -1e30)
    a = jax.nn.softmax(s, -1)
    o = jnp.einsum("bkgts,bskd->btkgd", a, v).reshape(B, T, n_head * hd) @ P("self_attn.o_proj.weight").T
    x = x + o
    h = x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * P("post_attention_layernorm.weight")
    return x + (jax.nn.silu(h @ P("mlp.gate_proj.weight").T) * (h @ P("mlp.up_proj.weight").T)) @ P("mlp.down_proj.weight").T


def readout(params: dict, out, eps: float):
    """What goes into the LM head: MTP's final norm, or EAGLE's feature as it is."""
    return _rms(out, params["norm.weight"], eps) if "norm.weight" in params else out


def eagle_loss(params, emb, feats, pos, valid, next_feats, labels, lm_t, cfg: tuple, w_cls: float = 0.1):
    """EAGLE: smooth-L1 regression of the next feature plus cross-entropy of the target's next
    token through the frozen LM head (w_cls = 0.1 as the paper). labels [B, T] (-1: none)."""
    import jax

    jnp = _jnp()
    pred = eagle_forward(params, emb, feats, pos, valid, *cfg)
    if "norm.weight" in params:  # MTP: cross-entropy on the token after next only (DeepSeek-V3)
        reg, w_cls = 0.0, 1.0
    else:
        m = (labels >= -1) & valid  # positions that count for the regression
        diff = jnp.abs(pred - next_feats)
        sl1 = jnp.where(diff < 1.0, 0.5 * diff * diff, diff - 0.5).mean(-1)
        reg = (sl1 * m).sum() / jnp.maximum(m.sum(), 1)
    logits = readout(params, pred, cfg[-1]) @ lm_t
    logp = jax.nn.log_softmax(logits, -1)
    ok = (labels >= 0) & valid
    nll = -jnp.take_along_axis(logp, jnp.maximum(labels, 0)[..., None], -1)[..., 0]
    cls = (nll * ok).sum() / jnp.maximum(ok.sum(), 1)
    return reg + w_cls * cls, logits


# -- EAGLE-3: fused low/mid/high taps, training-time test over several steps ------------------

def eagle3_init(d: int, d_t: int, n_head: int, n_kv: int, hd: int, ff: int, lm_head: np.ndarray, seed: int = 0) -> dict:
    """EAGLE-3's draft in its upstream names (`fc`, `midlayer.*`, `norm`, `lm_head` over the draft
    vocabulary). `lm_head` [Vd, d] starts as the target's rows; fc starts as the high tap."""
    rng = np.random.default_rng(seed)
    g = lambda *s: rng.normal(0.0, 0.02, s).astype(np.float32)  # noqa: E731
    fc = np.concatenate([np.zeros((d, 2 * d_t), np.float32), np.eye(d, d_t, dtype=np.float32)], 1) + g(d, 3 * d_t) * 0.1
    ones = lambda: np.ones(d, np.float32)  # noqa: E731
    return {
        "fc.weight": fc,
        "midlayer.input_layernorm.weight": ones(), "midlayer.hidden_norm.weight": ones(),
        "midlayer.self_attn.q_proj.weight": g(n_head * hd, 2 * d),
        "midlayer.self_attn.k_proj.weight": g(n_kv * hd, 2 * d),
        "midlayer.self_attn.v_proj.weight": g(n_kv * hd, 2 * d),
        "midlayer.self_attn.o_proj.weight": g(d, n_head * hd) * 0.1,
        "midlayer.post_attention_layernorm.weight": ones(),
        "midlayer.mlp.gate_proj.weight": g(ff, d), "midlayer.mlp.up_proj.weight": g(ff, d),
        "midlayer.mlp.down_proj.weight": g(d, ff) * 0.1,
        "norm.weight": ones(),
        "lm_head.weight": np.asarray(lm_head, np.float32),
    }


def eagle3_forward(params: dict, taps, embs, pos, valid, steps: int, n_head: int, n_kv: int, hd: int, theta: float,
                   eps: float):
    """The draft as llama.cpp's eagle3 graph runs it, unrolled over `steps` (training-time test).

    taps [B, T, 3*d_t] (the target's layer inputs at position i), embs [steps, B, T, d] (the token
    at i+1+k), pos [B, T]. Step 0 reads g = fc(taps); step k reads the pre-norm output of step
    k-1 at the same i, sits at position i+k and attends to step 0's keys at positions <= i and to
    its own chain (steps 1..k at i), exactly the cells a drafted chain sees at run time.
    Returns logits [steps, B, T, Vd]."""
    import jax

    jnp = _jnp()
    B, T, _ = taps.shape
    P = lambda k: params["midlayer." + k]  # noqa: E731
    g = taps @ params["fc.weight"].T
    causal = (jnp.tril(jnp.ones((T, T), bool))[None] & valid[:, None, :])[:, None, None]  # [B,1,1,T,T]
    grp = n_head // n_kv
    keys, vals, outs = [], [], []
    for k in range(steps):
        x = jnp.concatenate([_rms(embs[k], P("input_layernorm.weight"), eps), _rms(g, P("hidden_norm.weight"), eps)], -1)
        q = _rope((x @ P("self_attn.q_proj.weight").T).reshape(B, T, n_head, hd), pos + k, theta)
        kk = _rope((x @ P("self_attn.k_proj.weight").T).reshape(B, T, n_kv, hd), pos + k, theta)
        v = (x @ P("self_attn.v_proj.weight").T).reshape(B, T, n_kv, hd)
        qg = q.reshape(B, T, n_kv, grp, hd) / np.sqrt(hd)
        if k == 0:
            keys0, vals0 = kk, v
        else:
            keys.append(kk)
            vals.append(v)
        s0 = jnp.where(causal, jnp.einsum("btkgd,bskd->bkgts", qg, keys0), -1e30)  # [B, kv, g, T, T]
        diag = [jnp.einsum("btkgd,btkd->bkgt", qg, kd)[..., None] for kd in keys]  # own chain, [B, kv, g, T, 1]
        a = jax.nn.softmax(jnp.concatenate([s0, *diag], -1), -1)
        o = jnp.einsum("bkgts,bskd->btkgd", a[..., :T], vals0)
        for m, vd in enumerate(vals):
            o = o + a[..., T + m].transpose(0, 3, 1, 2)[..., None] * vd[:, :, :, None, :]
        o = o.reshape(B, T, n_head * hd) @ P("self_attn.o_proj.weight").T
        h = o + g
        f = _rms(h, P("post_attention_layernorm.weight"), eps)
        h = h + (jax.nn.silu(f @ P("mlp.gate_proj.weight").T) * (f @ P("mlp.up_proj.weight").T)) @ P("mlp.down_proj.weight").T
        outs.append(_rms(h, params["norm.weight"], eps) @ params["lm_head.weight"].T)
        g = h  # the next step's g: this step's pre-norm output
    return jnp.stack(outs)


def eagle3_loss(params, taps, embs, pos, valid, labels, cfg: tuple, steps: int, decay: float = 0.8):
    """EAGLE-3: cross-entropy of the target's token at every unrolled step (labels [steps, B, T],
    draft-vocabulary index; -1 outside it and -2 none: no loss), weighted decay**k."""
    import jax

    jnp = _jnp()
    logits = eagle3_forward(params, taps, embs, pos, valid, steps, *cfg)
    logp = jax.nn.log_softmax(logits, -1)
    ok = labels >= 0
    nll = -jnp.take_along_axis(logp, jnp.maximum(labels, 0)[..., None], -1)[..., 0]
    per = (nll * ok).sum((1, 2)) / jnp.maximum(ok.sum((1, 2)), 1)
    w = decay ** jnp.arange(steps)
    return (per * w).sum() / w.sum(), logits
