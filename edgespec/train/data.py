"""Training data by self-distillation: the target answers prompts, and one teacher-forced pass
through llama.cpp gives its post-norm hidden state at every position of prompt + answer.

What heads must predict is what this target says, so the labels are the target's own greedy
tokens. Stored compactly on disk in `DIR`: `feats.f16` (fp16 [N, d], memory-mapped), `tokens.i32`
([N]) and `docs.json` (where each document starts, how many prompt tokens it has, which prompts
are done), appended prompt by prompt, so an interrupted collection resumes where it stopped.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ..errors import EdgespecError


@dataclass
class Dataset:
    """Documents of (tokens, features): document j spans rows starts[j] .. starts[j+1]-1, and its
    first n_prompt[j] tokens are the prompt."""

    folder: Path
    tokens: np.ndarray  # int32 [N]
    feats: np.ndarray  # float16 [N, d] (memory-mapped)
    starts: list[int]
    n_prompt: list[int]

    @property
    def n_embd(self) -> int:
        return int(self.feats.shape[1])

    def doc(self, j: int) -> tuple[int, int]:
        return self.starts[j], (self.starts[j + 1] if j + 1 < len(self.starts) else len(self.tokens))

    def split(self, held_out: float = 0.1) -> tuple[list[int], list[int]]:
        """Document indices for training and for the held-out report (every k-th document)."""
        n = len(self.starts)
        k = max(2, min(round(1 / held_out), n)) if held_out > 0 else n + 1  # at least one held out
        test = [j for j in range(n) if j % k == k - 1]
        return [j for j in range(n) if j % k != k - 1], test


def _manifest(folder: Path) -> dict:
    f = folder / "docs.json"
    if f.exists():
        return json.loads(f.read_text())
    return {"n_embd": 0, "target": "", "starts": [], "n_prompt": [], "done": []}


def load(folder: str | os.PathLike) -> Dataset:
    folder = Path(folder)
    m = _manifest(folder)
    if not m["starts"]:
        raise EdgespecError(f"no training data in {folder}")
    n = m["rows"]
    tokens = np.fromfile(folder / "tokens.i32", dtype=np.int32, count=n)
    feats = np.memmap(folder / "feats.f16", dtype=np.float16, mode="r", shape=(n, m["n_embd"]))
    return Dataset(folder, tokens, feats, m["starts"], m["n_prompt"])


def collect(engine, prompts: list[dict], folder: str | os.PathLike, max_tokens: int, max_new: int = 256,
            progress: Callable[[int, int], None] | None = None, method: str = "lookahead",
            taps: tuple[int, ...] | None = None) -> Dataset:
    """Answer `prompts` with the target (greedy) and store the features of prompt + answer
    until `max_tokens` rows are stored. Prompts already done in `folder` are skipped (resume).
    `progress(rows, max_tokens)` is called after each prompt. With `taps` the features are the
    inputs of those target layers, concatenated (EAGLE-3), instead of the post-norm output."""
    from ..sampling import SamplingConfig

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    m = _manifest(folder)
    target = Path(engine.target.path).name
    if m["target"] and m["target"] != target:
        raise EdgespecError(f"{folder} holds data of {m['target']}, not {target}: use another --work folder")
    m["target"] = target
    want = list(taps) if taps else None
    if m["starts"] and m.get("taps") != want:
        raise EdgespecError(f"{folder} holds features of other layers than {want or 'the output'}: use another --work folder")
    m["taps"] = want
    rows = m.get("rows", 0)
    _truncate(folder, rows, m["n_embd"])  # drop the tail of a prompt interrupted mid-write
    done = set(m["done"])
    greedy = SamplingConfig(temp=0.0)
    kv, ctx = engine.kv, engine.ctx
    for item in prompts:
        if rows >= max_tokens:
            break
        if item["id"] in done:
            continue
        prompt = engine.prompt_tokens(messages=item["messages"]) if "messages" in item else engine.prompt_tokens(item["prompt"])
        room = engine.n_ctx_seq - len(prompt) - 1
        if room < 8:
            continue
        gen = engine.start(prompt, min(max_new, room), greedy, method).run()
        doc = prompt + gen.tokens
        parts: list[np.ndarray] = []
        ctx.set_embeddings(True)
        ctx.set_hidden_taps(taps)
        kv.reset()
        try:
            kv.extend(doc, want_logits=False, on_hidden=lambda h, pos: parts.append(h))
        finally:
            ctx.set_hidden_taps(None)
        feats = np.concatenate(parts).astype(np.float16)
        m["n_embd"] = feats.shape[1]
        with open(folder / "feats.f16", "ab") as f:
            f.write(feats.tobytes())
        with open(folder / "tokens.i32", "ab") as f:
            f.write(np.asarray(doc, np.int32).tobytes())
        m["starts"].append(rows)
        m["n_prompt"].append(len(prompt))
        m["done"].append(item["id"])
        rows += len(doc)
        m["rows"] = rows
        tmp = folder / "docs.json.tmp"
        tmp.write_text(json.dumps(m))
        tmp.replace(folder / "docs.json")
        if progress:
            progress(rows, max_tokens)
    if not m["starts"]:
        raise EdgespecError("no training data collected (prompts too long for the context?)")
    return load(folder)


def _truncate(folder: Path, rows: int, n_embd: int) -> None:
    for name, width in (("tokens.i32", 4), ("feats.f16", 2 * n_embd)):
        f = folder / name
        if f.exists() and f.stat().st_size > rows * width:
            with open(f, "r+b") as fh:
                fh.truncate(rows * width)


def training_prompts(spec: list[str] | None, exclude: set[str] = frozenset()) -> list[dict]:
    """Prompts from suites (`builtin`, `mtbench`, `humaneval`) or JSONL/text files; prompts whose
    text is in `exclude` (the evaluation prompts) are left out."""
    from ..suites import load_suite, read_text

    out: list[dict] = []
    for s in spec or ["mtbench", "humaneval", "builtin"]:
        if s == "builtin":
            items = load_suite(None)
        elif s in ("mtbench", "humaneval") or s.endswith(".jsonl"):
            items = load_suite(s)
        else:
            text = read_text(s, "training data")
            items = [{"id": f"{Path(s).name}-{i}", "prompt": p.strip()}
                     for i, p in enumerate(text.split("\n\n")) if p.strip()]
        out.extend(items)
    return [x for x in out if _text(x) not in exclude]


def _text(item: dict) -> str:
    if "messages" in item:
        return "\n".join(m.get("content", "") for m in item["messages"])
    return item.get("prompt", "")
