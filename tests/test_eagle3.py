"""EAGLE-3: the converter into llama.cpp's own `eagle3` GGUF, and drafting with llama.cpp's eagle3
graph (edgespec/drafters/eagle3.py).

Two targets:
* the embedded smollm2-135m-instruct (d=576, 30 layers, 49152 tokens) with a random synthetic
  upstream checkpoint: the layout llama.cpp's converter writes, that llama.cpp loads it, that
  greedy output with the drafter equals plain decoding, and that llama.cpp's own
  llama-speculative-simple runs the file and writes the same text;
* a tiny synthetic llama "bigram" target (identity layers: the next token depends on the last
  one only) with drafts built from its own weights: the draft graph equals a numpy EAGLE-3 forward
  of the upstream layout (so the Q/K permutation, d2t and the norms are right), an exact draft is
  accepted almost always (so the (token[P+1], g[P]) pairing is right), and a noisy one makes trees
  whose accepted nodes lie off the first branch (the re-laid case) without changing the output.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest

from conftest import Spy
from rpc_tools import require
from synthetic_heads import write_eagle3
from torchfmt import save_safetensors

from edgespec import llama_ext
from edgespec.costmodel import flat
from edgespec.drafters import eagle3 as e3
from edgespec.drafters.base import Calibration
from edgespec.engine import Engine, EngineConfig
from edgespec.gguf_check import inspect
from edgespec.heads.eagle3 import convert_eagle3, permute_qk
from edgespec.heads.format import HeadsError, target_meta
from edgespec.kvtypes import DEFAULT_KV, kv_types
from edgespec.llama import Model
from edgespec.sampling import SamplingConfig
from edgespec.schedulers.sequential import Generation

GREEDY = SamplingConfig(temp=0.0)
SMOL = "smollm2-135m-instruct:q4_0"
SMOL_D, SMOL_V, SMOL_L = 576, 49152, 30

# the tiny bigram target
D, V, N_LAYER, FF = 64, 256, 6, 64


# -- fixtures -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smol_target():
    from edgespec.models import resolve

    m = Model(resolve(SMOL))
    yield m
    m.close()


@pytest.fixture(scope="module")
def smol_e3(tmp_path_factory, smol_target):
    """A random upstream checkpoint for smollm2 (draft vocabulary of 4096), converted."""
    d = tmp_path_factory.mktemp("smol_e3")
    w = write_eagle3(d / "ckpt", hidden=SMOL_D, n_heads=9, n_kv_heads=3, ffn=512, vocab=SMOL_V, draft_vocab=4096,
                     fmt="safetensors", rope_theta=100000.0)
    out = convert_eagle3(d / "ckpt", smol_target, d / "smol-eagle3.gguf")
    return out, w


@pytest.fixture(scope="module")
def smol_engine(smol_e3):
    # the smol engine's cost curve is the user's (the embedded model's, as in conftest)
    eng = Engine(EngineConfig(model=SMOL, heads=str(smol_e3[0]), n_ctx=1024, threads=1, draft_n_min=3, draft_n_max=6))
    yield eng
    eng.close()  # the EAGLE-3 side context first


# -- the bigram target ---------------------------------------------------------------------


def _rms(x: np.ndarray, eps: float = 1e-5) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)


def write_bigram_target(path: Path, seed: int = 0) -> tuple[Path, np.ndarray, np.ndarray]:
    """A llama GGUF whose layers are the identity (zero attn_output and ffn_down), so the token
    after t is argmax(W . rms(E[t])). Returns (path, E, W)."""
    rng = np.random.default_rng(seed)
    E = rng.standard_normal((V, D)).astype(np.float32)
    W = (rng.standard_normal((V, D)) * 0.5).astype(np.float32)
    w = gguf.GGUFWriter(str(path), "llama")
    for k, v in (("context_length", 1024), ("embedding_length", D), ("block_count", N_LAYER),
                 ("feed_forward_length", FF), ("attention.head_count", 2), ("attention.head_count_kv", 2),
                 ("rope.dimension_count", 32), ("vocab_size", V)):
        w.add_uint32(f"llama.{k}", v)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_uint32("general.file_type", 0)
    w.add_string("tokenizer.ggml.model", "test")  # llama.cpp's dummy tokenizer of V tokens
    w.add_array("tokenizer.ggml.tokens", [f"tok_{i}" for i in range(V)])
    w.add_array("tokenizer.ggml.scores", [0.0] * V)
    w.add_tensor("token_embd.weight", E)
    w.add_tensor("output_norm.weight", np.ones(D, np.float32))
    w.add_tensor("output.weight", W)
    small = lambda *s: (rng.standard_normal(s) * 0.05).astype(np.float32)  # noqa: E731
    for i in range(N_LAYER):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(D, np.float32))
        for n in ("attn_q", "attn_k", "attn_v"):
            w.add_tensor(f"blk.{i}.{n}.weight", small(D, D))
        w.add_tensor(f"blk.{i}.attn_output.weight", np.zeros((D, D), np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(D, np.float32))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", small(FF, D))
        w.add_tensor(f"blk.{i}.ffn_up.weight", small(FF, D))
        w.add_tensor(f"blk.{i}.ffn_down.weight", np.zeros((D, FF), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, E, W


def bigram_next(E: np.ndarray, W: np.ndarray) -> np.ndarray:
    return np.argmax(_rms(E) @ W.T, axis=1)


def write_copy_draft(folder: Path, E: np.ndarray, W: np.ndarray, noise: float = 0.0, vd: int = 200,
                     seed: int = 1) -> np.ndarray:
    """An upstream EAGLE-3 checkpoint that copies the bigram target: attention looks at its own
    row only (q = 10 k on the token half), V/O pass the normed token embedding through, the FFN
    and the g paths are zero (hidden_norm 0 with norm_before_residual), and lm_head is the
    target's output restricted to a draft vocabulary holding every token the target can say.
    So the row (token[P+1], g[P]) predicts the target's token after token[P+1], but only when
    the pairs sit at the right positions. `noise` perturbs input_layernorm: near-ties flip and
    the target's choice moves to the draft's second or third place. Returns the draft ids."""
    rng = np.random.default_rng(seed)
    nxt = bigram_next(E, W)
    img = np.unique(nxt)
    rest = np.setdiff1d(np.arange(V), img)
    used = np.sort(np.concatenate([img, rng.choice(rest, vd - len(img), replace=False)]))
    eye, zero = np.eye(D, dtype=np.float32), np.zeros((D, D), np.float32)
    small = lambda *s: (rng.standard_normal(s) * 0.05).astype(np.float32)  # noqa: E731
    t = {
        "midlayer.self_attn.q_proj.weight": 10 * np.concatenate([eye, zero], 1),
        "midlayer.self_attn.k_proj.weight": np.concatenate([eye, zero], 1),
        "midlayer.self_attn.v_proj.weight": np.concatenate([eye, zero], 1),
        "midlayer.self_attn.o_proj.weight": eye.copy(),
        "midlayer.hidden_norm.weight": np.zeros(D, np.float32),
        "midlayer.input_layernorm.weight": (1 + noise * rng.standard_normal(D)).astype(np.float32),
        "midlayer.post_attention_layernorm.weight": np.ones(D, np.float32),
        "midlayer.mlp.gate_proj.weight": small(FF, D),
        "midlayer.mlp.up_proj.weight": small(FF, D),
        "midlayer.mlp.down_proj.weight": np.zeros((D, FF), np.float32),
        "fc.weight": small(D, 3 * D),
        "norm.weight": np.ones(D, np.float32),
        "lm_head.weight": W[used].copy(),
        "d2t": (used - np.arange(vd)).astype(np.int64),
        "t2d": np.isin(np.arange(V), used),
    }
    folder.mkdir(parents=True, exist_ok=True)
    save_safetensors(folder / "model.safetensors", t)
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": D, "intermediate_size": FF,
           "num_attention_heads": 2, "num_key_value_heads": 2, "num_hidden_layers": 1, "rms_norm_eps": 1e-5,
           "rope_theta": 10000.0, "vocab_size": V, "draft_vocab_size": vd, "max_position_embeddings": 512,
           "norm_before_residual": True, "eagle_aux_hidden_state_layer_ids": [1, 3, 4]}
    (folder / "config.json").write_text(json.dumps(cfg))
    return used


@pytest.fixture(scope="module")
def bigram(tmp_path_factory):
    d = tmp_path_factory.mktemp("bigram")
    path, E, W = write_bigram_target(d / "bigram.gguf")
    tgt = Model(path)
    files = {}
    for name, noise in (("exact", 0.0), ("noisy", 0.2)):
        write_copy_draft(d / name, E, W, noise)
        files[name] = convert_eagle3(d / name, tgt, d / f"{name}.gguf")
    tgt.close()
    # f32 weights: batched rows differ from single rows in the last bits, so the measured curve
    # would allow one row; a flat one lets every step verify its draft (as test_mtp does)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EDGESPEC_CACHE", str(d / "cache"))  # the cost curve of a throwaway file stays here
        eng = Engine(EngineConfig(model=str(path), n_ctx=1024, threads=1, draft_n_max=8, max_branches=8))
    eng.cost = flat(0.01)
    yield SimpleNamespace(eng=eng, E=E, W=W, nxt=bigram_next(E, W), files=files, dir=d)
    eng.close()  # the EAGLE-3 side context first


def _relaid(log) -> int:
    """Accepted nodes off a draft's first branch (the scheduler re-lays them next step)."""
    n = 0
    for draft, acc in log:
        if draft.tokens:
            first = set(draft.path_to(draft.leaves()[0]))
            n += sum(1 for a in acc if a not in first)
    return n


# -- the converter -------------------------------------------------------------------------


def _fields(path: Path) -> tuple[dict, dict]:
    r = gguf.GGUFReader(str(path))
    kv = {f.name: f for f in r.fields.values()}
    tensors = {t.name: t for t in r.tensors}
    return kv, tensors


def _val(f):
    return f.contents()


def test_convert_writes_llamacpp_eagle3_layout(smol_e3, smol_target):
    path, w = smol_e3
    kv, t = _fields(path)
    T = gguf.GGUFValueType
    assert _val(kv["general.architecture"]) == "eagle3"
    assert _val(kv["eagle3.target_layers"]) == [2, SMOL_L // 2, SMOL_L - 3]
    assert kv["eagle3.target_layers"].types == [T.ARRAY, T.INT32]
    want = {"eagle3.target_hidden_size": SMOL_D, "eagle3.block_count": 1, "eagle3.embedding_length": SMOL_D,
            "eagle3.feed_forward_length": 512, "eagle3.attention.head_count": 9, "eagle3.attention.head_count_kv": 3,
            "eagle3.vocab_size": SMOL_V, "eagle3.rope.dimension_count": 64, "eagle3.context_length": 2048,
            "eagle3.norm_before_residual": False, "eagle3.norm_before_fc": False, "general.file_type": 1}
    for k, v in want.items():
        assert _val(kv[k]) == v, k
    assert _val(kv["eagle3.rope.freq_base"]) == pytest.approx(100000.0)
    assert _val(kv["eagle3.attention.layer_norm_rms_epsilon"]) == pytest.approx(1e-5)
    # the target's tokenizer, byte for byte, and edgespec's fingerprint of the target
    assert inspect(path).tokens == smol_target.info.tokens
    for k, v in target_meta(smol_target).items():
        assert _val(kv["edgespec." + k]) == v
    # tensors: ggml shapes {ne0, ne1}, types as llama.cpp's converter writes them
    H, F, hd = SMOL_D, 512, 64
    shapes = {"fc.weight": [3 * SMOL_D, H], "d2t": [4096], "output_norm.weight": [H], "output.weight": [H, 4096],
              "blk.0.attn_norm.weight": [H], "blk.0.attn_norm_2.weight": [H], "blk.0.ffn_norm.weight": [H],
              "blk.0.attn_q.weight": [2 * H, 9 * hd], "blk.0.attn_k.weight": [2 * H, 3 * hd],
              "blk.0.attn_v.weight": [2 * H, 3 * hd], "blk.0.attn_output.weight": [9 * hd, H],
              "blk.0.ffn_gate.weight": [H, F], "blk.0.ffn_up.weight": [H, F], "blk.0.ffn_down.weight": [F, H]}
    assert set(t) == set(shapes)
    Q = gguf.GGMLQuantizationType
    for name, shp in shapes.items():
        assert [int(x) for x in t[name].shape] == shp, name
        want_type = Q.I64 if name == "d2t" else Q.F32 if len(shp) == 1 else Q.F16
        assert t[name].tensor_type == want_type, name
    arr = lambda n: np.array(t[n].data).reshape([int(x) for x in reversed(t[n].shape)])  # noqa: E731
    # d2t as absolute target ids
    np.testing.assert_array_equal(arr("d2t"), w["d2t"] + np.arange(4096))
    # q and k with llama.cpp's rotary permutation (k over its 3 kv heads), v as is
    np.testing.assert_allclose(arr("blk.0.attn_q.weight"), permute_qk(w["midlayer.self_attn.q_proj.weight"], 9, 9),
                               rtol=1e-3, atol=1e-5)
    np.testing.assert_allclose(arr("blk.0.attn_k.weight"), permute_qk(w["midlayer.self_attn.k_proj.weight"], 9, 3),
                               rtol=1e-3, atol=1e-5)
    np.testing.assert_allclose(arr("blk.0.attn_v.weight"), w["midlayer.self_attn.v_proj.weight"], rtol=1e-3, atol=1e-5)
    np.testing.assert_allclose(arr("blk.0.attn_norm_2.weight"), w["midlayer.hidden_norm.weight"])
    np.testing.assert_allclose(arr("fc.weight"), w["fc.weight"], rtol=1e-3, atol=1e-5)


def test_permutation_is_llamacpps():
    """permute_qk groups each head's rotate-half pairs (i, i + hd/2) next to each other."""
    w = np.arange(2 * 8 * 3, dtype=np.float32).reshape(16, 3)  # 2 heads of 8 rows
    p = permute_qk(w, 2, 2)
    rows = [int(r[0]) // 3 for r in p]
    assert rows == [0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15]


def _rewrite(src: Path, dst: Path, drop: str | None = None, change: dict | None = None,
             cfg: dict | None = None) -> Path:
    """A copy of checkpoint folder `src` without tensor `drop`, with tensors and config keys
    replaced (a None value removes the key)."""
    from edgespec.heads.checkpoint import load_config, load_state_dict

    sd = dict(load_state_dict(src))
    if drop:
        del sd[drop]
    sd.update(change or {})
    dst.mkdir(parents=True, exist_ok=True)
    save_safetensors(dst / "model.safetensors", sd)
    c = load_config(src)
    for k, v in (cfg or {}).items():
        if v is None:
            c.pop(k, None)
        else:
            c[k] = v
    (dst / "config.json").write_text(json.dumps(c))
    return dst


def test_convert_errors_are_one_line(tmp_path, smol_target):
    src = tmp_path / "ok"
    write_eagle3(src, hidden=SMOL_D, n_heads=9, n_kv_heads=3, ffn=64, vocab=SMOL_V, draft_vocab=256, fmt="safetensors")
    cases = [
        (dict(drop="midlayer.self_attn.q_proj.weight"), "no tensor midlayer.self_attn.q_proj.weight"),
        (dict(change={"fc.weight": np.zeros((SMOL_D, 3 * 512), np.float32)}), r"fc.weight has shape \(576, 1536\)"),
        (dict(cfg={"target_hidden_size": 512}), "hidden size 512.*has 576"),
        (dict(cfg={"draft_vocab_size": None, "num_hidden_layers": 2}), "not an EAGLE-3 checkpoint"),
        (dict(change={"d2t": np.full(256, SMOL_V, np.int64)}), "outside the target's 49152 tokens"),
        (dict(cfg={"eagle_aux_hidden_state_layer_ids": [2, 15, 40]}), "target layers"),
    ]
    for i, (kw, msg) in enumerate(cases):
        bad = _rewrite(src, tmp_path / f"bad{i}", **kw)
        with pytest.raises(HeadsError, match=msg) as err:
            convert_eagle3(bad, smol_target, tmp_path / f"bad{i}.gguf")
        assert "\n" not in str(err.value)
        assert not (tmp_path / f"bad{i}.gguf").exists()


# -- llama.cpp loads it --------------------------------------------------------------------


def test_converted_file_loads_in_llamacpp(smol_e3, smol_engine):
    path, _ = smol_e3
    m = Model(path)
    try:
        assert m.arch == "eagle3" and m.n_layer == 1 and m.n_embd == SMOL_D and m.n_vocab == SMOL_V
        n = llama_ext.fn("model_target_layer_ids_n")(m.ptr)
        ids = llama_ext.fn("model_target_layer_ids")(m.ptr)
        assert [ids[i] for i in range(n)] == [2, 15, 27]
    finally:
        m.close()
    d = e3.build(smol_engine, path)
    # the draft context borrows the target's embeddings and LM head (the file has neither)
    assert llama_ext.fn("get_ctx_other")(d.rt.ctx.ptr) == smol_engine.ctx.ptr
    assert d.reads == "layer taps" and d.taps == (2, 15, 27)
    assert e3.build(smol_engine, path).rt is d.rt  # made once per target context


# -- lossless on smollm2 ---------------------------------------------------------------------


@pytest.mark.parametrize("tree,deep", [(False, False), (True, False), (True, True)])
def test_greedy_equals_plain_on_smollm2(smol_engine, smol_e3, tree, deep):
    """`deep`: a flat cost curve and a calibration that trusts the random draft, so its trees
    grow deep (sequence copies in the draft cache, up to 6 levels) and are verified whole."""
    eng = smol_engine
    saved = eng.cost
    if deep:
        eng.cost = flat(0.05, saved.max_exact_rows)
    try:
        for text in ("The capital of France is", "def fibonacci(n):"):
            prompt = eng.prompt_tokens(text, raw=True)
            want = eng.start(prompt, 24, GREEDY, "none").run().tokens
            d = e3.build(eng, smol_e3[0], tree=tree)
            if deep:  # a random draft made to look confident: its trees then grow deep
                d.calib = Calibration(prior=2000.0)
            spy = Spy(d)
            gen = Generation(eng, prompt, 24, GREEDY, drafter=spy).run()
            assert gen.tokens == want
            assert gen.stats.n_drafted >= 3 * (gen.stats.n_steps - 1)  # --spec-draft-n-min 3 drafts every step
            assert d.n_gap == 0
            if deep and saved.max_exact_rows > 8:
                assert max(max(dr.depths(), default=0) for dr, _ in spy.log) >= 3
    finally:
        eng.cost = saved


def test_sampled_generation_runs(smol_engine, smol_e3):
    eng = smol_engine
    prompt = eng.prompt_tokens("Once upon a time", raw=True)
    gen = Generation(eng, prompt, 16, SamplingConfig(temp=0.8, seed=3), drafter=e3.build(eng, smol_e3[0])).run()
    assert len(gen.tokens) == 16 or gen.stats.finish_reason == "stop"
    assert gen.stats.n_drafted > 0


# -- the graph and the pairing, on the bigram target ------------------------------------------


def _hf_eagle3(sd: dict, cfg: dict, E: np.ndarray, tokens: list[int], feats: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """EAGLE-3's draft step in the upstream (HF) layout, in numpy: rows k = (tokens[k], g[k]) at
    positions 0..n-1, causal. Returns (draft-vocabulary logits, pre-norm outputs)."""
    H, nh, nkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd, eps = H // nh, cfg["rms_norm_eps"]
    p = lambda k: sd["midlayer." + k].astype(np.float64)  # noqa: E731
    g = feats @ sd["fc.weight"].astype(np.float64).T
    x = np.concatenate([_rms(E[tokens].astype(np.float64), eps) * p("input_layernorm.weight"),
                        _rms(g, eps) * p("hidden_norm.weight")], 1)
    n = len(tokens)
    q = (x @ p("self_attn.q_proj.weight").T).reshape(n, nh, hd)
    k = (x @ p("self_attn.k_proj.weight").T).reshape(n, nkv, hd)
    v = (x @ p("self_attn.v_proj.weight").T).reshape(n, nkv, hd)
    inv = 1.0 / cfg["rope_theta"] ** (np.arange(0, hd, 2) / hd)
    ang = np.arange(n)[:, None] * inv[None]
    cos, sin = np.cos(np.concatenate([ang, ang], 1))[:, None], np.sin(np.concatenate([ang, ang], 1))[:, None]
    rot = lambda t: np.concatenate([-t[..., hd // 2:], t[..., : hd // 2]], -1)  # noqa: E731  rotate_half
    q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
    rep = nh // nkv
    out = np.zeros((n, nh, hd))
    for h in range(nh):
        s = q[:, h] @ k[:, h // rep].T / np.sqrt(hd)
        s = np.where(np.tril(np.ones((n, n), bool)), s, -np.inf)
        a = np.exp(s - s.max(1, keepdims=True))
        out[:, h] = (a / a.sum(1, keepdims=True)) @ v[:, h // rep]
    r = out.reshape(n, H) @ p("self_attn.o_proj.weight").T + g
    y = _rms(r, eps) * p("post_attention_layernorm.weight")
    gate, up = y @ p("mlp.gate_proj.weight").T, y @ p("mlp.up_proj.weight").T
    h_out = r + (gate / (1 + np.exp(-gate)) * up) @ p("mlp.down_proj.weight").T
    logits = (_rms(h_out, eps) * sd["norm.weight"]) @ sd["lm_head.weight"].astype(np.float64).T
    return logits, h_out


@pytest.mark.parametrize("outtype,tol", [("f32", 2e-3), ("q8_0", 3e-2)])
def test_draft_graph_equals_the_upstream_forward(bigram, outtype, tol):
    """A random GQA checkpoint through our converter and llama.cpp's graph gives the logits and
    pre-norm outputs of a numpy forward of the upstream layout: Q/K permutation, norms,
    residuals, d2t placement (f32 weights: to rounding; q8_0: to its quantization)."""
    from edgespec.heads.checkpoint import load_config, load_state_dict

    d = bigram.dir / "random"
    if not d.exists():
        w = write_eagle3(bigram.dir / "random0", hidden=D, n_heads=2, n_kv_heads=1, ffn=96, vocab=V, draft_vocab=100,
                         fmt="safetensors", rope_theta=10000.0, seed=5)
        # q and k large enough that attention depends on them (and on RoPE: a wrong permutation shows)
        _rewrite(bigram.dir / "random0", d, change={k: w[k] * 60 for k in ("midlayer.self_attn.q_proj.weight",
                                                                          "midlayer.self_attn.k_proj.weight")})
    sd, cfg = load_state_dict(d), load_config(d)
    eng = bigram.eng
    out = convert_eagle3(d, eng.target, bigram.dir / f"random-{outtype}.gguf", outtype=outtype)
    rt = e3.Eagle3Runtime(eng.target, eng.ctx, out, threads=1, kv_type="f16", n_seq_max=1)
    try:
        rng = np.random.default_rng(0)
        tokens = [int(t) for t in rng.integers(0, V, 12)]
        feats = rng.standard_normal((12, 3 * D)).astype(np.float32)
        ref_logits, ref_h = _hf_eagle3(sd, cfg, bigram.E, tokens, feats)
        g = rt.encode(feats)
        np.testing.assert_allclose(g, feats @ sd["fc.weight"].T, rtol=tol, atol=tol)
        rt.reset()
        assert rt.decode([(0, i, tokens[i], g[i:].ctypes.data) for i in range(12)])
        ids = sd["d2t"] + np.arange(100)
        for i in range(12):
            lg = rt.logits(i)
            assert np.array_equal(np.flatnonzero(np.isfinite(lg)), np.sort(ids))
            np.testing.assert_allclose(lg[ids], ref_logits[i], rtol=tol, atol=tol)
            np.testing.assert_allclose(rt.prenorm(i), ref_h[i], rtol=tol, atol=tol)
    finally:
        rt.close()


@pytest.mark.parametrize("tree", [False, True])
def test_exact_draft_is_accepted(bigram, tree):
    """The copying draft predicts the target's token only if row P holds (token[P+1], g[P]):
    nearly every drafted chain token is accepted, and a tree accepts a full path per step."""
    eng = bigram.eng
    for prompt in ([3, 200, 7, 9], [11, 12, 13]):
        want = [int(bigram.nxt[prompt[-1]])]
        while len(want) < 40:
            want.append(int(bigram.nxt[want[-1]]))
        d = e3.build(eng, bigram.files["exact"], tree=tree)
        gen = Generation(eng, prompt, 40, GREEDY, drafter=d).run()
        assert gen.tokens == want
        st = gen.stats
        assert st.n_accept >= 30
        if not tree:
            assert st.n_accept >= 0.8 * st.n_drafted
        assert st.n_steps <= 12


def test_tree_with_relaid_nodes_is_lossless(bigram):
    """A noisy draft: the target often takes the draft's second choice, accepted nodes lie off
    the first branch (re-laid by the scheduler), and the output is still plain decoding's."""
    eng = bigram.eng
    relaid = accepted = 0
    for prompt in ([3, 200, 7, 9], [11, 12, 13], [100, 101], [250, 1, 2, 3]):
        want = Generation(eng, prompt, 40, GREEDY).run().tokens
        spy = Spy(e3.build(eng, bigram.files["noisy"], tree=True))
        gen = Generation(eng, prompt, 40, GREEDY, drafter=spy).run()
        assert gen.tokens == want
        relaid += _relaid(spy.log)
        accepted += gen.stats.n_accept
        assert spy.inner.n_gap == 0
    assert relaid > 0 and accepted > 60


@pytest.mark.parametrize("split", [False, True])
def test_long_prompt_in_chunks(bigram, monkeypatch, split):
    """A prompt longer than the batch: taps, encoder and catch-up all go in chunks. `split`:
    catch-ups of more than 3 rows decode their last pair alone (see Eagle3Runtime.catch_up)."""
    if split:
        monkeypatch.setattr(e3, "_ALL_OUTPUT_FLOATS", 3 * V)
    eng = bigram.eng
    rng = np.random.default_rng(7)
    prompt = [int(t) for t in rng.integers(0, V, 700)]
    want = Generation(eng, prompt, 12, GREEDY).run().tokens
    d = e3.build(eng, bigram.files["exact"], tree=False)
    gen = Generation(eng, prompt, 12, GREEDY, drafter=d).run()
    assert gen.tokens == want and gen.stats.n_accept >= 8


# -- refusals --------------------------------------------------------------------------------


def test_refuses_a_target_without_layer_inputs(bigram):
    fake = SimpleNamespace(arch="qwen2", path=Path("qwen2.gguf"))
    with pytest.raises(HeadsError, match="layer inputs.*qwen2"):
        e3.Eagle3Runtime(fake, bigram.eng.ctx, bigram.files["exact"])


def test_refuses_a_draft_for_another_target(smol_engine, bigram, smol_e3):
    with pytest.raises(HeadsError, match="hidden size 64"):
        e3.build(smol_engine, bigram.files["exact"])
    e3.build(smol_engine, smol_e3[0])  # the engine keeps working with the right one
    with pytest.raises(HeadsError, match="not an EAGLE-3 draft"):
        e3.Eagle3Runtime(smol_engine.target, smol_engine.ctx, smol_engine.target.path)


# -- llama.cpp's own driver on the same file -----------------------------------------------------


@pytest.fixture(scope="module")
def spec_bin() -> Path:
    """llama.cpp's llama-speculative-simple (tests/rpc_tools.py builds it; under CI a missing one fails)."""
    return require("llama-speculative-simple")


def _llamacpp(spec_bin: Path, target: Path, draft: Path, prompt: str, n: int, n_max: int = 3,
              kv: str = DEFAULT_KV) -> tuple[str, dict]:
    """llama-speculative-simple's output and stats, with the engine's K/V cache types: with
    others smollm2 flips a near-tie ("United"/"united") within 32 tokens."""
    ctk, ctv = kv_types(kv)
    for _ in range(3):  # its log thread may drop the last lines at exit: the stats are among them
        r = subprocess.run([str(spec_bin), "-m", str(target), "-md", str(draft), "--spec-type", "draft-eagle3",
                            "-p", prompt, "-n", str(n), "-c", "512", "--spec-draft-n-max", str(n_max), "--temp", "0",
                            "-t", "1", "-ctk", ctk, "-ctv", ctv], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        stats = {k: int(v) for k, v in re.findall(r"(n_drafted|n_accept)\s*=\s*(\d+)", r.stderr)}
        if len(stats) == 2:
            return r.stdout, stats
    pytest.fail(f"no n_drafted/n_accept in llama-speculative-simple's log: {r.stderr[-1000:]}")


def test_same_text_as_llama_speculative_simple(spec_bin, smol_engine, smol_e3, bigram):
    """llama.cpp's draft-eagle3 runs our converted files and writes the same greedy text; on
    the exact bigram draft it accepts nearly everything too."""
    for eng, draft, text in ((smol_engine, smol_e3[0], "The capital of France is"),
                             (bigram.eng, bigram.files["exact"], "hello world")):
        out, stats = _llamacpp(spec_bin, eng.target.path, draft, text, 32, kv=eng.cfg.kv_type)
        prompt = eng.prompt_tokens(text, raw=True)
        d = e3.build(eng, draft, tree=False)
        d.n_max = 3  # as --spec-draft-n-max 3
        gen = Generation(eng, prompt, 32, GREEDY, drafter=d).run()
        ours = (eng.target.detokenize(prompt) + eng.target.detokenize(gen.tokens)).strip()
        theirs = out.strip()
        assert len(theirs) > len(text) + 10
        assert theirs.startswith(ours) or ours.startswith(theirs)  # it may run a few tokens past -n
        assert stats["n_drafted"] > 0
        if draft == bigram.files["exact"]:  # (the last step's drafts may be cut at -n)
            assert stats["n_accept"] >= 0.75 * stats["n_drafted"]
            assert gen.stats.n_accept >= 0.75 * gen.stats.n_drafted
