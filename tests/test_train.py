"""`edgespec train`: self-distilled data from the real target, heads trained with JAX on a few
hundred tokens (loss falls, held-out agreement beats an untrained head), resumable, and the
result loads and drafts losslessly."""

import json
from dataclasses import replace

import numpy as np
import pytest

pytest.importorskip("jax")
pytest.importorskip("optax")

from conftest import GREEDY  # noqa: E402
from edgespec.frontends.cli import main  # noqa: E402
from edgespec.heads.format import read_heads  # noqa: E402
from edgespec.heads.target import TargetWeights  # noqa: E402
from edgespec.train import data as data_mod  # noqa: E402
from edgespec.train.run import eagle3_taps, eagle_shape  # noqa: E402
from edgespec.train.trainer import TrainConfig, Trainer  # noqa: E402


# Regular text (counting), so that a few hundred tokens teach something that holds on the held-out
# document (the last one) too.
COUNTING = [{"id": f"count-{a}", "messages": [{"role": "user", "content": f"Count from {a} to {a + 40}, separated by commas."}]}
            for a in (1, 50, 120, 300, 520, 700)]


@pytest.fixture(scope="module")
def dataset(smol, tmp_path_factory):
    folder = tmp_path_factory.mktemp("train") / "data"
    return data_mod.collect(smol, COUNTING, folder, 700, max_new=96)


@pytest.fixture(scope="module")
def taps_dataset(smol, tmp_path_factory):
    """The same documents with EAGLE-3's features: the inputs of three target layers."""
    folder = tmp_path_factory.mktemp("train") / "data-eagle3"
    return data_mod.collect(smol, COUNTING, folder, 700, max_new=96, taps=eagle3_taps(smol.target.n_layer))


def test_data_is_the_targets_own_greedy_output_and_resumes(smol, dataset):
    assert len(dataset.tokens) >= 400 and dataset.feats.shape == (len(dataset.tokens), 576)
    s, e = dataset.doc(0)
    prompt = [int(t) for t in dataset.tokens[s : s + dataset.n_prompt[0]]]
    answer = [int(t) for t in dataset.tokens[s + dataset.n_prompt[0] : e]]
    assert smol.start(prompt, len(answer), GREEDY, "none").run().tokens == answer
    # the stored features are the target's: its LM head over them gives the next tokens
    tw = TargetWeights(smol.target.path, smol.target.n_vocab, 576)
    rows = np.arange(s + dataset.n_prompt[0], e - 1)
    pred = (np.asarray(dataset.feats[rows], np.float32) @ tw.lm_head(np.arange(smol.target.n_vocab)).T).argmax(1)
    assert (pred == dataset.tokens[rows + 1]).mean() > 0.9
    again = data_mod.collect(smol, COUNTING, dataset.folder, 700, max_new=96)
    assert len(again.tokens) == len(dataset.tokens)  # nothing collected twice


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["medusa", "eagle", "eagle3"])
def test_training_lowers_loss_and_beats_an_untrained_head(smol, dataset, taps_dataset, tmp_path, kind):
    tw = TargetWeights(smol.target.path, smol.target.n_vocab, 576)
    cfg = TrainConfig(kind, epochs=8 if kind == "medusa" else 12, batch=128, seq=128, draft_vocab=1024, save_every=5,
                      ttt_steps=2)
    if kind == "eagle3":
        dataset = taps_dataset
        assert dataset.feats.shape == (len(dataset.tokens), 3 * 576)
    tr = Trainer(cfg, dataset, tw, tmp_path, eagle_shape(smol) if kind != "medusa" else None)
    before = tr.evaluate(tr.untrained())
    tr.train()
    after = tr.evaluate()
    losses = [x for _, x in tr.history]
    assert np.mean(losses[-3:]) < np.mean(losses[:3])
    assert after.top1[0] > before.top1[0]
    # a second trainer on the same work folder resumes at the last step
    again = Trainer(replace(cfg), dataset, tw, tmp_path, eagle_shape(smol) if kind != "medusa" else None)
    assert again.step == tr.step and len(again.history) == len(tr.history)


def test_train_command_end_to_end(tmp_path, capsys):
    out = tmp_path / "medusa.gguf"
    rc = main(["train", "medusa", "-m", "smollm2-135m-instruct:q4_0", "--data", "builtin", "--tokens", "300",
               "--max-new", "48", "--epochs", "2", "--batch", "64", "--draft-vocab", "512", "--work", str(tmp_path / "w"),
               "-o", str(out), "-q", "-c", "512"])
    assert rc == 0
    hf = read_heads(out)
    assert hf.kind == "medusa" and len(hf.draft_vocab) <= 512
    report = json.loads((tmp_path / "w" / "report-medusa.json").read_text())
    assert report["tokens"] >= 300 and len(report["top1"]) == 3
    assert (tmp_path / "w" / "medusa-checkpoint" / "config.json").exists()
    rc = main(["run", "-m", "smollm2-135m-instruct:q4_0", "-p", "Say hi.", "-n", "8", "--spec", "medusa", "--heads",
               str(out), "--json"])
    assert rc == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["stats"]["drafter"] == "medusa"
    # a learning curve over the same (kept) data: each fraction trained from scratch, no heads written
    out.unlink()
    rc = main(["train", "medusa", "-m", "smollm2-135m-instruct:q4_0", "--data", "builtin", "--tokens", "800",
               "--max-new", "48", "--epochs", "2", "--batch", "64", "--draft-vocab", "512", "--work", str(tmp_path / "w"),
               "-o", str(out), "-q", "-c", "512", "--curve", "0.5,1"])  # more data: collection resumes
    assert rc == 0 and not out.exists()
    text = capsys.readouterr().out
    assert "learning curve of medusa" in text
    rows = json.loads((tmp_path / "w" / "learning-medusa.json").read_text())["rows"]
    assert [r["fraction"] for r in rows] == [0.5, 1.0]
    assert rows[0]["tokens"] < rows[1]["tokens"] and all(len(r["top1"]) == 3 for r in rows)


def test_train_bad_input(capsys):
    assert main(["train", "medusa", "--tokens", "3"]) == 2
    assert "--tokens must be at least" in capsys.readouterr().err
    assert main(["train", "medusa", "--curve", "0.5,2"]) == 2
    assert "--curve takes fractions" in capsys.readouterr().err


@pytest.mark.slow
def test_train_eagle3_writes_llamacpps_file_whose_graph_is_the_trained_one(tmp_path):
    """`train eagle3` end to end: the EAGLE-3 checkpoint layout, llama.cpp's eagle3 GGUF, and
    llama.cpp's graph over it giving the logits of the JAX model that was trained (step 0 from
    fc(taps), step 1 from its own pre-norm output), so what training measures is what runs;
    greedy output with it equals plain decoding."""
    import jax.numpy as jnp
    from safetensors.numpy import load_file

    from edgespec.drafters import eagle3 as e3
    from edgespec.engine import Engine, EngineConfig
    from edgespec.train.models import eagle3_forward

    out, work = tmp_path / "e3.gguf", tmp_path / "w"
    rc = main(["train", "eagle3", "-m", "smollm2-135m-instruct:q4_0", "--data", "builtin", "--tokens", "300",
               "--max-new", "48", "--epochs", "2", "--batch", "128", "--draft-vocab", "512", "--ttt-steps", "2",
               "--work", str(work), "-o", str(out), "-q", "-c", "512"])
    assert rc == 0
    ckpt = work / "eagle3-checkpoint"
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["draft_vocab_size"] <= 512 and cfg["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    sd = load_file(str(ckpt / "model.safetensors"))
    vocab = sd.pop("d2t") + np.arange(cfg["draft_vocab_size"])
    assert sd.pop("t2d").sum() == len(vocab) and "midlayer.hidden_norm.weight" in sd
    report = json.loads((work / "report-eagle3.json").read_text())
    assert len(report["top1"]) == 2

    # drafting forced: a head trained for seconds may be declined by the cost model on a busy machine
    eng = Engine(EngineConfig(model="smollm2-135m-instruct:q4_0", n_ctx=512, threads=2, heads=str(out), draft_n_min=3))
    try:
        ds = data_mod.load(work / "data-eagle3")
        s, e = ds.doc(0)
        n = min(64, e - s - 2)
        taps = np.asarray(ds.feats[s : s + n], np.float32)
        toks = ds.tokens[s:e].astype(np.int64)
        tw = TargetWeights(eng.target.path, eng.target.n_vocab, 576)
        sh = eagle_shape(eng)
        shape = (sh["n_head"], sh["n_head_kv"], sh["head_dim"], sh["rope_theta"], sh["rms_eps"])
        embs = np.stack([tw.embed(toks[1 + k : 1 + k + n]) for k in range(2)])[:, None]
        want = np.asarray(eagle3_forward({k: jnp.asarray(v) for k, v in sd.items()}, taps[None], embs,
                                         np.arange(n)[None], np.ones((1, n), bool), 2, *shape))[:, 0, n - 1]
        rt = e3.build(eng, out, tree=False).rt
        rt.reset()
        assert rt.catch_up([int(t) for t in toks[1 : n + 1]], rt.encode(taps), 0)
        got0 = rt.logits(rt.last_row)[vocab]
        assert rt.decode([(0, n, int(toks[n + 1]), rt.prenorm_addr(rt.last_row))])
        got1 = rt.logits(0)[vocab]
        for w, g in zip(want, (got0, got1)):  # f16 weights in the GGUF, f32 in training
            assert np.abs(w - g).max() < 2e-3 * np.abs(w).max() + 1e-2 and np.corrcoef(w, g)[0, 1] > 0.9999
        eng.side.release("eagle3")
        prompt = eng.prompt_tokens("Count from 1 to 20, separated by commas.")
        plain = eng.start(prompt, 32, GREEDY, "none").run().tokens
        gen = eng.start(prompt, 32, GREEDY, "eagle3")
        assert gen.run().tokens == plain and gen.stats.n_drafted > 0
    finally:
        eng.close()
