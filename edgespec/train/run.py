"""One training run: collect data, train, report, write the checkpoint in the upstream layout and
convert it into a heads GGUF. The front end passes `progress(stage, info)` and shows bars."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ..errors import EdgespecError
from . import data as data_mod
from .trainer import Report, TrainConfig, Trainer


@dataclass
class TrainResult:
    gguf: Path
    checkpoint: Path
    report: Report
    untrained: Report
    tokens: int  # rows of training data stored
    t_data: float
    t_train: float


def eagle_shape(engine) -> dict:
    """The EAGLE layer's shape: the target's own attention and FFN sizes (as EAGLE's config)."""
    m = engine.target
    get = lambda k: m.meta(f"{m.arch}.{k}")  # noqa: E731
    d = int(get("embedding_length"))
    n_head = int(get("attention.head_count"))
    n_kv = int(get("attention.head_count_kv") or n_head)
    return {"n_head": n_head, "n_head_kv": n_kv, "head_dim": int(get("attention.key_length") or d // n_head),
            "n_ff": int(get("feed_forward_length")), "rope_theta": float(get("rope.freq_base") or 10000.0),
            "rms_eps": float(get("attention.layer_norm_rms_epsilon") or 1e-5), "n_layer": m.n_layer,
            "n_vocab": m.n_vocab, "n_ctx_train": int(get("context_length") or 2048)}


def eagle3_taps(n_layer: int) -> tuple[int, int, int]:
    """The target layers whose inputs EAGLE-3 fuses (low, middle, high), as llama.cpp's converter
    picks them when a checkpoint names none."""
    return (2, n_layer // 2, n_layer - 3)


def export(trainer: Trainer, folder: Path, target_name: str, shape: dict | None) -> Path:
    """The trained weights in the upstream layout: safetensors + config.json (plus `draft_vocab`)."""
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    t = trainer.export_params()
    cfg = trainer.cfg
    d = trainer.d
    if cfg.kind == "eagle3":  # d2t: offsets from draft index to target id; t2d: which target ids are drafted
        vocab = trainer.vocab.astype(np.int64)
        t["d2t"] = vocab - np.arange(len(vocab), dtype=np.int64)
        t2d = np.zeros(shape["n_vocab"], bool)
        t2d[vocab] = True
        t["t2d"] = t2d
    else:
        t["draft_vocab"] = trainer.vocab.astype(np.int64)
    if cfg.kind == "medusa":
        config = {"medusa_num_heads": cfg.medusa_heads, "medusa_num_layers": cfg.medusa_layers,
                  "hidden_size": d, "base_model_name_or_path": target_name, "trained_by": "edgespec train"}
        name = "medusa_lm_head.safetensors"
    elif cfg.kind == "mtp":  # DeepSeek-V3's layout: the module as layer n_layer of the model
        from .models import mtp_export_name

        n_layer = shape.get("n_layer", 0)
        t = {(f"model.layers.{n_layer}." + mtp_export_name(k) if k != "draft_vocab" else k): v for k, v in t.items()}
        config = {"hidden_size": d, "num_attention_heads": shape["n_head"], "num_key_value_heads": shape["n_head_kv"],
                  "head_dim": shape["head_dim"], "intermediate_size": shape["n_ff"], "rope_theta": shape["rope_theta"],
                  "rms_norm_eps": shape["rms_eps"], "num_hidden_layers": n_layer, "num_nextn_predict_layers": 1,
                  "mtp_module": True, "base_model_name_or_path": target_name, "trained_by": "edgespec train"}
        name = "model.safetensors"
    elif cfg.kind == "eagle3":  # SafeAILab/EAGLE's EAGLE-3 layout (LlamaForCausalLMEagle3)
        config = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": d, "target_hidden_size": d,
                  "num_attention_heads": shape["n_head"], "num_key_value_heads": shape["n_head_kv"],
                  "head_dim": shape["head_dim"], "intermediate_size": shape["n_ff"], "rope_theta": shape["rope_theta"],
                  "rms_norm_eps": shape["rms_eps"], "num_hidden_layers": 1, "vocab_size": shape["n_vocab"],
                  "draft_vocab_size": len(trainer.vocab), "max_position_embeddings": shape.get("n_ctx_train", 2048),
                  "eagle_aux_hidden_state_layer_ids": list(eagle3_taps(shape["n_layer"])),
                  "base_model_name_or_path": target_name, "trained_by": "edgespec train"}
        name = "model.safetensors"
    else:
        config = {"architectures": ["LlamaForCausalLM"], "hidden_size": d, "num_attention_heads": shape["n_head"],
                  "num_key_value_heads": shape["n_head_kv"], "head_dim": shape["head_dim"],
                  "intermediate_size": shape["n_ff"], "rope_theta": shape["rope_theta"],
                  "rms_norm_eps": shape["rms_eps"], "num_hidden_layers": 1, "bias": True,
                  "base_model_name_or_path": target_name, "trained_by": "edgespec train"}
        name = "model.safetensors"
    save_file({k: np.ascontiguousarray(v) for k, v in t.items()}, str(folder / name))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def train_heads(engine, kind: str, prompts: list[dict], out: Path, work: Path, tokens: int, cfg: TrainConfig,
                progress: Callable[[str, dict], None] = lambda stage, info: None, max_new: int = 256) -> TrainResult:
    from ..heads.store import convert_any

    t0 = time.perf_counter()
    ds = _collect(engine, kind, prompts, work, tokens, max_new, progress)
    t_data = time.perf_counter() - t0
    tw, shape = _target_inputs(engine, kind)
    trainer = Trainer(cfg, ds, tw, work, shape, progress=lambda info: progress("train", info))
    before = trainer.evaluate(trainer.untrained())
    t1 = time.perf_counter()
    trainer.train()
    t_train = time.perf_counter() - t1
    report = trainer.evaluate()
    report.untrained_top1 = before.top1
    ckpt = export(trainer, work / f"{kind}-checkpoint", Path(engine.target.path).name, shape)
    src = f"trained by edgespec train {kind} on {len(ds.starts)} documents, {len(ds.tokens)} tokens"
    gguf = convert_any(kind, ckpt, engine.target, out, source_note=src)
    (work / f"report-{kind}.json").write_text(json.dumps({**report.to_dict(), "tokens": len(ds.tokens),
                                                           "t_data_s": t_data, "t_train_s": t_train,
                                                           "config": asdict(cfg)}, indent=2))
    _plot(trainer.history, work / f"curves-{kind}.png", kind)
    return TrainResult(gguf, ckpt, report, before, len(ds.tokens), t_data, t_train)


def _target_inputs(engine, kind: str):
    """The target's embeddings/LM head, and the layer shape the EAGLE-like heads copy."""
    from ..heads.target import TargetWeights

    tw = TargetWeights(engine.target.path, engine.target.n_vocab, engine.target.n_embd)
    return tw, (eagle_shape(engine) if kind in ("eagle", "mtp", "eagle3") else None)


def _collect(engine, kind: str, prompts: list[dict], work: Path, tokens: int, max_new: int,
             progress: Callable[[str, dict], None]) -> data_mod.Dataset:
    """The kind's training data in `work` (collected, or resumed where it stopped)."""
    taps = None
    if kind == "eagle3":
        from ..drafters.eagle3 import LAYER_INPUT_ARCHS

        if engine.target.arch not in LAYER_INPUT_ARCHS:
            raise EdgespecError(f"EAGLE-3 reads the inputs of three target layers, which llama.cpp records for "
                                f"{', '.join(sorted(LAYER_INPUT_ARCHS)[:6])}, ... targets, not {engine.target.arch}")
        taps = eagle3_taps(engine.target.n_layer)
    return data_mod.collect(engine, prompts, work / ("data-eagle3" if taps else "data"), tokens, max_new,
                            progress=lambda rows, total: progress("data", {"rows": rows, "total": total}), taps=taps)


def learning_curve(engine, kind: str, prompts: list[dict], work: Path, tokens: int, cfg: TrainConfig,
                   fractions: list[float], progress: Callable[[str, dict], None] = lambda stage, info: None,
                   max_new: int = 256) -> list[dict]:
    """Whether more data would help: train `kind` from scratch on each fraction of the training
    documents (the same held-out documents for all) and report the held-out agreement of each.
    Writes `learning-KIND.json` (and a PNG) in `work`; no heads."""
    import tempfile

    ds = _collect(engine, kind, prompts, work, tokens, max_new, progress)
    tw, shape = _target_inputs(engine, kind)
    train_docs, _ = ds.split()
    rows = []
    for f in sorted(fractions):
        docs = train_docs[: max(1, round(len(train_docs) * f))]
        with tempfile.TemporaryDirectory(prefix="edgespec-curve-") as tmp:  # fresh, never resumed
            t1 = time.perf_counter()
            trainer = Trainer(cfg, ds, tw, Path(tmp), shape, progress=lambda info: progress("train", info),
                              train_docs=docs)
            trainer.train()
            t_train = time.perf_counter() - t1
            r = trainer.evaluate()
        rows.append({"fraction": f, "documents": len(docs), "tokens": int(sum(ds.doc(j)[1] - ds.doc(j)[0] for j in docs)),
                     "top1": r.top1, "top5": r.top5, "mean_accepted": r.mean_accepted, "t_train_s": t_train,
                     "held_out_positions": r.n_positions})
        progress("curve", rows[-1])
    (work / f"learning-{kind}.json").write_text(json.dumps({"kind": kind, "config": asdict(cfg), "rows": rows}, indent=2))
    _plot_curve(rows, work / f"learning-{kind}.png", kind)
    return rows


def _pyplot():
    """matplotlib's pyplot without a display, or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _plot_curve(rows: list[dict], path: Path, kind: str) -> None:
    """Held-out top-1 of the first head/step and the expected chain length against training tokens."""
    plt = _pyplot()
    if plt is None:
        return
    x = [r["tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    lines = ax.plot(x, [100 * r["top1"][0] for r in rows], "o-", label="held-out top-1, first head/step (%)")
    ax.set_xscale("log")
    ax.set_xlabel("training tokens")
    ax.set_ylabel("%")
    ax2 = ax.twinx()
    lines += ax2.plot(x, [r["mean_accepted"] for r in rows], "s--", color="tab:orange", label="expected chain length")
    ax2.set_ylabel("tokens per step")
    ax.legend(lines, [ln.get_label() for ln in lines], loc="upper left", fontsize=8)
    ax.set_title(f"edgespec train {kind} --curve")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot(history: list[tuple[int, float]], path: Path, kind: str) -> None:
    """The training loss curve as a PNG (skipped without matplotlib)."""
    plt = _pyplot()
    if plt is None:
        return
    if not history:
        return
    h = np.asarray(history)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(h[:, 0], h[:, 1], lw=0.8, alpha=0.5, label="step")
    if len(h) >= 10:
        k = max(5, len(h) // 30)
        ax.plot(h[k - 1 :, 0], np.convolve(h[:, 1], np.ones(k) / k, mode="valid"), lw=1.5, label=f"mean of {k}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"edgespec train {kind}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def check_extra() -> None:
    """One clear line when the training extra is not installed."""
    try:
        import jax  # noqa: F401
        import optax  # noqa: F401
    except ImportError:
        raise EdgespecError('training needs the train extra: pip install "edgespec[train]" (JAX, optax)') from None
