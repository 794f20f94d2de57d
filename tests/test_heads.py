"""Medusa and EAGLE heads: converters from the upstream layouts, the heads file, and drafting from
the real target's hidden states (greedy output identical to plain decoding, trees verified)."""

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import GREEDY, PROMPTS, Spy
from edgespec.costmodel import flat
from edgespec.drafters.heads import EagleDrafter, MedusaDrafter
from edgespec.drafters.base import Budget, sized
from edgespec.drafters.tree import best_first, select
from edgespec.engine import Engine, EngineConfig
from edgespec.gguf_check import GGUFInfo
from edgespec.heads.convert import convert
from edgespec.heads.format import HeadsError, check_target, read_heads
from edgespec.heads.runtime import EagleHead, MedusaHeads
from edgespec.heads.target import TargetWeights
from edgespec.sampling import SamplingConfig
from synthetic_heads import write_eagle, write_medusa

SMOL_D, SMOL_V = 576, 49152


def fake_target(d=64, vocab=256, name="tiny.gguf"):
    """What a converter reads of a target (sizes and token list), without a model file."""
    tokens = [f"t{i}".encode() for i in range(vocab)]
    info = GGUFInfo(Path(name), "llama", 0, vocab, [tuple(tokens)])
    return SimpleNamespace(n_embd=d, n_vocab=vocab, info=info, path=Path(name))


@pytest.mark.parametrize("fmt", ["safetensors", "pt"])
@pytest.mark.parametrize("own_lm_head", [True, False])
def test_medusa_round_trip(tmp_path, fmt, own_lm_head):
    src = tmp_path / "medusa"
    w = write_medusa(src, 64, 256, n_heads=3, n_layers=2, fmt=fmt, own_lm_head=own_lm_head, dtype="bfloat16")
    out = convert("medusa", src, fake_target(), tmp_path / "m.gguf")
    hf = read_heads(out)
    assert hf.kind == "medusa" and hf.get("medusa.n_heads") == 3 and hf.get("medusa.n_layers") == 2
    for h in range(3):
        for l in range(2):
            np.testing.assert_allclose(hf.tensors[f"medusa.{h}.res.{l}.weight"], w[f"{h}.{l}.linear.weight"], rtol=1e-3, atol=1e-4)
            np.testing.assert_allclose(hf.tensors[f"medusa.{h}.res.{l}.bias"], w[f"{h}.{l}.linear.bias"], rtol=1e-6)
        assert (f"medusa.{h}.output.weight" in hf.tensors) == own_lm_head
    check_target(hf, fake_target())
    with pytest.raises(HeadsError, match="vocabulary size"):
        check_target(hf, fake_target(vocab=300))
    with pytest.raises(HeadsError, match="tokenizer"):
        other = fake_target()
        other.info = GGUFInfo(Path("x"), "llama", 0, 256, [tuple(f"u{i}".encode() for i in range(256))])
        check_target(hf, other)


@pytest.mark.parametrize("fmt,bias,embed", [("pt", True, False), ("safetensors", False, True)])
def test_eagle_round_trip(tmp_path, fmt, bias, embed):
    src = tmp_path / "eagle"
    w = write_eagle(src, 64, n_heads=4, n_kv_heads=2, ffn=128, vocab=256, fmt=fmt, bias=bias, with_embed=embed,
                    rope_theta=50000.0)
    hf = read_heads(convert("eagle", src, fake_target(), tmp_path / "e.gguf"))
    assert hf.kind == "eagle"
    assert (hf.get("eagle.n_head"), hf.get("eagle.n_head_kv"), hf.get("eagle.head_dim"), hf.get("eagle.n_ff")) == (4, 2, 16, 128)
    assert hf.get("eagle.rope_theta") == 50000.0
    np.testing.assert_allclose(hf.tensors["eagle.fc.weight"], w["fc.weight"], rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(hf.tensors["eagle.ffn_down.weight"], w["layers.0.mlp.down_proj.weight"], rtol=1e-3, atol=1e-4)
    assert ("eagle.fc.bias" in hf.tensors) == bias
    assert ("eagle.token_embd.weight" in hf.tensors) == embed


def test_converter_errors(tmp_path):
    src = tmp_path / "eagle"
    write_eagle(src, 64, n_heads=4, n_kv_heads=2, ffn=128, vocab=256)
    with pytest.raises(HeadsError, match="hidden size 64"):
        convert("eagle", src, fake_target(d=32), tmp_path / "x.gguf")
    with pytest.raises(HeadsError, match="not a Medusa checkpoint"):
        convert("medusa", src, fake_target(), tmp_path / "x.gguf")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + bytes(20))
    with pytest.raises(HeadsError, match="cannot read heads file"):
        read_heads(junk)
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "llama.gguf"), "llama")
    w.add_tensor("x", np.zeros(4, np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(HeadsError, match="not an edgespec heads file"):
        read_heads(tmp_path / "llama.gguf")


def test_select_lays_trees_out_depth_first():
    """Nodes ranked by probability are laid out in preorder, likelier children first, within the
    row and branch budget: the KV bookkeeping keeps the first branch's cells in place."""
    nodes = [(0.9, -1, 10, 0.9), (0.5, -1, 11, 0.5), (0.8, 0, 12, 0.9), (0.4, 0, 13, 0.4), (0.7, 2, 14, 0.9)]
    b = Budget(max_nodes=8, max_branches=8, fixed_rows=1, cost=flat(0.05), sampling=GREEDY, n_min=5)
    d = sized(select(nodes, b, "x"), b)
    assert d.tokens == [10, 12, 14, 13, 11] and d.parents == [-1, 0, 1, 0, -1]
    b2 = replace(b, max_branches=2, n_min=8)
    d2 = sized(select(nodes, b2, "x"), b2)
    assert len(d2.leaves()) <= 2
    # an end-of-generation node is left out: where the target ends there, its parent's row
    # yields the end token as the step's own, so its row would buy nothing
    d3 = sized(select(nodes, b, "x", is_stop=lambda tok: tok == 14), b)
    assert d3.tokens == [10, 12, 13, 11] and d3.parents == [-1, 0, 0, -1]


# -- on the real target ----------------------------------------------------------------------


def random_medusa(tmp_path, target, n_heads=3, seed=0) -> Path:
    src = tmp_path / f"medusa-{seed}"
    write_medusa(src, SMOL_D, SMOL_V, n_heads=n_heads, n_layers=1, own_lm_head=False, seed=seed)
    return convert("medusa", src, target, tmp_path / f"medusa-{seed}.gguf")


def random_eagle(tmp_path, target, seed=0) -> Path:
    src = tmp_path / f"eagle-{seed}"
    write_eagle(src, SMOL_D, n_heads=9, n_kv_heads=3, ffn=256, vocab=SMOL_V, fmt="safetensors", seed=seed)
    return convert("eagle", src, target, tmp_path / f"eagle-{seed}.gguf")


@pytest.fixture(scope="module")
def heads_files(smol, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("heads")
    return {"medusa": random_medusa(tmp, smol.target), "eagle": random_eagle(tmp, smol.target)}


def drafter_for(eng, kind, path):
    hf = read_heads(path)
    tw = TargetWeights(eng.target.path, eng.target.n_vocab, SMOL_D)
    if kind == "medusa":
        return MedusaDrafter(MedusaHeads(hf, tw))
    return EagleDrafter(EagleHead(hf, tw, eng.n_ctx_seq))


_PLAIN: dict[str, list[int]] = {}  # plain greedy output of PROMPTS[:4] on the session's `smol`


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_heads_greedy_identical_with_trees(smol, heads_files, kind):
    """Forced drafting (a cost curve on which it pays, at least 6 nodes a step): every prompt's
    output equals plain decoding, and multi-branch trees were verified."""
    saved_cost, saved_cfg = smol.cost, smol.cfg
    smol.cost = flat(0.05, saved_cost.max_exact_rows)
    smol.cfg = replace(saved_cfg, draft_n_min=6)
    try:
        branches = 0
        for text in PROMPTS[:4]:
            prompt = smol.prompt_tokens(text)
            if text not in _PLAIN:  # the same for both kinds: plain decoding once per prompt
                _PLAIN[text] = smol.start(prompt, 48, GREEDY, "none").run().tokens
            plain = _PLAIN[text]
            spy = Spy(drafter_for(smol, kind, heads_files[kind]))
            gen = smol.generate(prompt, 48, GREEDY, spy).run()
            assert gen.tokens == plain, f"{kind} differs from plain on {text[:30]!r}"
            branches = max(branches, max(len(d.leaves()) for d, _ in spy.log if d.tokens))
            assert all(len(d) >= 6 for d, _ in spy.log if d.tokens)
        assert branches > 1
    finally:
        smol.cost, smol.cfg = saved_cost, saved_cfg


def test_heads_sampled_run_completes(smol, heads_files):
    """Under sampling the tree is walked by the target's own draws (exactness is tested
    statistically in test_distribution); a seeded run repeats itself."""
    prompt = smol.prompt_tokens(PROMPTS[2])
    cfg = SamplingConfig(temp=0.8, seed=7)
    runs = [smol.generate(prompt, 24, cfg, drafter_for(smol, "eagle", heads_files["eagle"])).run().tokens for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) > 0


@pytest.mark.slow
def test_engine_finds_and_refuses_heads(tmp_path, heads_files):
    eng = Engine(EngineConfig(model="smollm2-135m-instruct:q4_0", n_ctx=512, threads=2, heads=str(heads_files["medusa"])))
    try:
        assert eng.heads_kinds() == {"medusa"}
        gen = eng.start(eng.prompt_tokens("Hi"), 4, GREEDY, "medusa").run()
        assert gen.drafter_name == "medusa"
        with pytest.raises(HeadsError, match="holds medusa heads, not eagle"):
            eng.start(eng.prompt_tokens("Hi"), 4, GREEDY, "eagle")
    finally:
        eng.close()
    other = Engine(EngineConfig(model="gemma3-270m", n_ctx=256, threads=2, heads=str(heads_files["medusa"])))
    try:
        with pytest.raises(HeadsError, match="was made for"):
            other.start(other.prompt_tokens("Hi"), 4, GREEDY, "medusa")
    finally:
        other.close()


def write_mtp(folder: Path, d=64, n_head=4, n_kv=2, ff=128, layer=2, seed=0) -> dict:
    """A DeepSeek-V3-style MTP module checkpoint (the module as layer `layer` of the model)."""
    import json

    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    hd = d // n_head
    shapes = {"eh_proj.weight": (d, 2 * d), "enorm.weight": (d,), "hnorm.weight": (d,), "input_layernorm.weight": (d,),
              "self_attn.q_proj.weight": (n_head * hd, d), "self_attn.k_proj.weight": (n_kv * hd, d),
              "self_attn.v_proj.weight": (n_kv * hd, d), "self_attn.o_proj.weight": (d, n_head * hd),
              "post_attention_layernorm.weight": (d,), "mlp.gate_proj.weight": (ff, d), "mlp.up_proj.weight": (ff, d),
              "mlp.down_proj.weight": (d, ff), "shared_head.norm.weight": (d,)}
    w = {f"model.layers.{layer}.{k}": rng.normal(0, 0.02, s).astype(np.float32) for k, s in shapes.items()}
    folder.mkdir(parents=True, exist_ok=True)
    save_file(w, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"hidden_size": d, "num_attention_heads": n_head,
                                                    "num_key_value_heads": n_kv, "intermediate_size": ff,
                                                    "num_hidden_layers": layer, "num_nextn_predict_layers": 1}))
    return w


def test_mtp_round_trip(tmp_path):
    from edgespec.heads.store import checkpoint_kind

    w = write_mtp(tmp_path / "mtp")
    assert checkpoint_kind(tmp_path / "mtp") == "mtp"
    hf = read_heads(convert("mtp", tmp_path / "mtp", fake_target(), tmp_path / "mtp.gguf"))
    assert hf.kind == "mtp" and hf.get("mtp.n_head") == 4
    np.testing.assert_allclose(hf.tensors["mtp.fc.weight"], w["model.layers.2.eh_proj.weight"], rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(hf.tensors["mtp.output_norm.weight"], w["model.layers.2.shared_head.norm.weight"], rtol=1e-6)


@pytest.mark.parametrize("kind", ["medusa", "eagle", "eagle3", "mtp"])
def test_shipped_heads_are_found_and_accepted(smol, kind):
    """The heads trained for SmolLM2 ship with edgespec: found for the :q4_0 variant without
    --heads, lossless, and really accepted (drafting forced)."""
    assert kind in smol.heads_kinds()
    saved = smol.cfg
    smol.cfg = replace(saved, draft_n_min=3)
    try:
        # a code prompt: the kind of text they were trained on reaches about 0.75 accepted per step
        prompt = smol.prompt_tokens("Write a Python function that checks whether a string is a palindrome.")
        plain = smol.start(prompt, 96, GREEDY, "none").run().tokens
        gen = smol.start(prompt, 96, GREEDY, kind).run()
        assert gen.tokens == plain
        assert gen.stats.n_accept / gen.stats.n_steps > 0.4, f"{kind}: {gen.stats.summary()}"
    finally:
        smol.cfg = saved


def test_medusa_tree_ends_a_branch_at_the_end_of_generation():
    """Medusa's children do not depend on the node; an end-of-generation node still gets none."""
    choices = [[(7, 0.9), (2, 0.5)], [(3, 0.9), (5, 0.4)], [(4, 0.9)]]
    nodes = best_first(choices, 20)
    assert any(nodes[par][2] == 7 for _, par, _, _ in nodes if par >= 0)
    stopped = best_first(choices, 20, is_stop=lambda tok: tok == 7)
    assert [n for n in stopped if n[1] < 0] == [n for n in nodes if n[1] < 0]  # both roots stay
    assert not any(stopped[par][2] == 7 for _, par, _, _ in stopped if par >= 0)
    assert any(stopped[par][2] == 2 for _, par, _, _ in stopped if par >= 0)
