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
from edgespec.train.run import eagle_shape  # noqa: E402
from edgespec.train.trainer import TrainConfig, Trainer  # noqa: E402


# Regular text (counting), so that a few hundred tokens teach something that holds on the held-out
# document (the last one) too.
COUNTING = [{"id": f"count-{a}", "messages": [{"role": "user", "content": f"Count from {a} to {a + 40}, separated by commas."}]}
            for a in (1, 50, 120, 300, 520, 700)]


@pytest.fixture(scope="module")
def dataset(smol, tmp_path_factory):
    folder = tmp_path_factory.mktemp("train") / "data"
    return data_mod.collect(smol, COUNTING, folder, 700, max_new=96)


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


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_training_lowers_loss_and_beats_an_untrained_head(smol, dataset, tmp_path, kind):
    tw = TargetWeights(smol.target.path, smol.target.n_vocab, 576)
    cfg = TrainConfig(kind, epochs=8 if kind == "medusa" else 12, batch=128, seq=128, draft_vocab=1024, save_every=5)
    tr = Trainer(cfg, dataset, tw, tmp_path, eagle_shape(smol) if kind == "eagle" else None)
    before = tr.evaluate(tr.untrained())
    tr.train()
    after = tr.evaluate()
    losses = [x for _, x in tr.history]
    assert np.mean(losses[-3:]) < np.mean(losses[:3])
    assert after.top1[0] > before.top1[0]
    # a second trainer on the same work folder resumes at the last step
    again = Trainer(replace(cfg), dataset, tw, tmp_path, eagle_shape(smol) if kind == "eagle" else None)
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


def test_train_bad_input(capsys):
    assert main(["train", "medusa", "--tokens", "3"]) == 2
    assert "--tokens must be at least" in capsys.readouterr().err
