"""Tiny random-weight llama models for the algorithm tests (sampling, verification, drafting),
written with the `gguf` package at session start and run through real llama.cpp.

A target and a draft model of two layers, 64 wide, share SmolLM2's tokenizer (copied from the
embedded model's GGUF: the same text prompts, chat template and grammar pieces work), so a
completion costs a few milliseconds where the 135M model's cost tens.

A random model's next-token distribution is flat over its vocabulary, and a drafter's guesses
(tokens of the context) would never be what it samples: no test of acceptance could fail. So the
weights are random only around a designed core, a bigram table over a handful of tokens:

* a token of the table embeds as a one-hot vector (every other token as one shared "other"
  direction plus a little noise); the attention and FFN layers are random and small, so the last
  hidden state is its token's direction plus a context-dependent part a few percent of its size;
* the output matrix maps a token's direction to the logits of `TABLE[token]` (its log
  probabilities, ten above a background of random logits around 0), and the context-dependent
  part moves those logits by a few tenths: the model reads its context (a drafter or a KV
  cache out of step changes what it says), but its distribution over the next token stays the
  table's spread, with most of its mass on a few tokens that the prompt itself contains.

The draft model has the same table, sharpened (its logits `SHARPEN` times the target's: a draft
more confident than the target, so that a rejection rule that keeps drafts too often shows), its
own random layers, and Q4_0 weights; the target is Q8_0, whose batched rows equal one-row decodes.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from synthetic_gguf import llama_like_writer
from synthetic_mtp import _tokenizer_from

ARCH = "llama"
N_EMBD = 64
N_HEAD = 2
N_HEAD_KV = 2
HEAD_DIM = N_EMBD // N_HEAD  # 32: a q8_0 KV cache (the default) needs head sizes divisible by 32
N_FF = 128
N_LAYER = 2
N_CTX = 2048
TOP = 10.0  # a table entry's logit above the background
N_DIRS = 48  # a direction for each token of the table (and the others'); the rest hold the context
CONTEXT = 0.1  # output weights on the context dimensions: how much the context moves a logit
SHARPEN = 5.0  # the draft model's logits, times the target's

# The next token after each token of the table (SmolLM2's token texts: Ġ is a space, Ċ a
# newline), as probabilities over the tokens that matter; the rest of the mass is the background.
# The distribution tests' prompts: "red, green, blue. red, green, yellow. red, green," (the first
# token after the last comma spread about 0.6/0.35/0.05 within the top three) and a chat prompt
# whose answer ("Yes", " yes", "Sure", maybe with "!") often ends within three tokens.
TABLE: dict[str | None, dict[str, float]] = {
    ",": {"Ġblue": 0.55, "Ġyellow": 0.33, "Ġgreen": 0.06, "Ġred": 0.03, "Ġpurple": 0.02},
    "Ġblue": {".": 0.8, ",": 0.15, "Ġand": 0.03},
    "Ġyellow": {".": 0.75, ",": 0.2, "Ġand": 0.03},
    "Ġgreen": {",": 0.8, ".": 0.15, "Ġand": 0.03},
    "Ġred": {",": 0.85, ".": 0.1, "Ġand": 0.03},
    "Ġpurple": {".": 0.6, ",": 0.35},
    "red": {",": 0.8, ".": 0.15},
    "Ġand": {"Ġred": 0.5, "Ġblue": 0.3, "Ġgreen": 0.15},
    ".": {"Ġred": 0.8, "<|im_end|>": 0.12, "Ġgreen": 0.05},
    "Ċ": {"Yes": 0.6, "Ġyes": 0.25, "Sure": 0.12},
    "Yes": {"<|im_end|>": 0.55, "!": 0.4},
    "Ġyes": {"<|im_end|>": 0.6, "!": 0.35},
    "Sure": {"!": 0.6, "<|im_end|>": 0.35},
    "!": {"<|im_end|>": 0.85, "Ġyes": 0.1},
    "<|im_end|>": {"Ċ": 0.9},
    None: {"red": 0.4, "Ġred": 0.3, "Ġgreen": 0.15, "Yes": 0.1},  # every other token
}


def write(path: str | Path, vocab_from: str | Path, seed: int = 0, sharpen: float = 1.0,
          tok_fields: list | None = None) -> Path:
    """The f32 model at `path` (see the module docstring); `vocab_from`: the GGUF whose tokenizer
    it takes (or `tok_fields`, read already by `tokenizer(vocab_from)`)."""
    path = Path(path)
    fields = tok_fields if tok_fields is not None else tokenizer(vocab_from)
    tokens = next(v for k, v, _, _ in fields if k == "tokenizer.ggml.tokens")
    ids = {t: i for i, t in enumerate(tokens)}
    n_vocab, d = len(tokens), N_EMBD
    rng = np.random.default_rng(seed)

    def w(*shape: int, scale: float) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)  # numpy (out, in) = ggml {in, out}

    named = sorted({t for t in TABLE if t} | {t for row in TABLE.values() for t in row})
    missing = [t for t in named if t not in ids]
    assert not missing, f"tokens not in the vocabulary: {missing}"
    assert len(named) < N_DIRS, "one direction per named token, and one for the others"
    slot = {ids[t]: i for i, t in enumerate(named)}
    other = len(named)
    ctx = slice(N_DIRS, d)  # the context dimensions: what attention and the FFN write

    emb = np.zeros((n_vocab, d), np.float32)
    emb[:, other] = 1.0
    emb[:, ctx] = w(n_vocab, d - N_DIRS, scale=0.05)  # the other tokens differ a little
    for tok, i in slot.items():
        emb[tok] = 0.0
        emb[tok, i] = 1.0

    # After the final norm a one-hot hidden state is about sqrt(d) = 8 on its direction, so an
    # output weight of x there gives a logit of 8x.
    scale = float(np.sqrt(d))
    out = w(n_vocab, d, scale=1.0 / scale)  # the background: logits ~ N(0, 1)
    for v in sorted({ids[t] for row in TABLE.values() for t in row}):
        cols = [slot[ids[src]] if src else other for src in TABLE]
        keep = out[v, cols].copy()  # off their table entries, the background too
        out[v] = 0.0
        out[v, cols] = keep
        out[v, ctx] = w(d - N_DIRS, scale=CONTEXT)  # what the context adds: a few tenths of a logit
    for src, row in TABLE.items():
        col = slot[ids[src]] if src else other
        for dst, p in row.items():
            out[ids[dst], col] = (TOP + sharpen * np.log(p)) / scale

    def into_context(n_in: int, scale: float) -> np.ndarray:
        m = np.zeros((d, n_in), np.float32)
        m[ctx] = w(d - N_DIRS, n_in, scale=scale)
        return m

    wr = llama_like_writer(path, ARCH, n_ctx=N_CTX, n_embd=d, n_layer=N_LAYER, n_ff=N_FF, n_head=N_HEAD,
                           n_head_kv=N_HEAD_KV, head_dim=HEAD_DIM, n_vocab=n_vocab)
    wr.add_string("general.name", path.stem)
    for key, val, vtype, sub in fields:
        if vtype == gguf.GGUFValueType.ARRAY:
            wr.add_key_value(key, val, vtype, sub_type=sub)
        else:
            wr.add_key_value(key, val, vtype)
    wr.add_tensor("token_embd.weight", emb)
    wr.add_tensor("output_norm.weight", np.ones(d, np.float32))
    wr.add_tensor("output.weight", out)
    for i in range(N_LAYER):
        wr.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(d, np.float32))
        wr.add_tensor(f"blk.{i}.attn_q.weight", w(N_HEAD * HEAD_DIM, d, scale=0.08))
        wr.add_tensor(f"blk.{i}.attn_k.weight", w(N_HEAD_KV * HEAD_DIM, d, scale=0.08))
        wr.add_tensor(f"blk.{i}.attn_v.weight", w(N_HEAD_KV * HEAD_DIM, d, scale=0.03))
        wr.add_tensor(f"blk.{i}.attn_output.weight", into_context(N_HEAD * HEAD_DIM, 0.05))
        wr.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(d, np.float32))
        wr.add_tensor(f"blk.{i}.ffn_gate.weight", w(N_FF, d, scale=0.1))
        wr.add_tensor(f"blk.{i}.ffn_up.weight", w(N_FF, d, scale=0.1))
        wr.add_tensor(f"blk.{i}.ffn_down.weight", into_context(N_FF, 0.01))
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return path


def tokenizer(vocab_from: str | Path) -> list:
    """The tokenizer.* fields of a GGUF (read once, for both models)."""
    return _tokenizer_from(vocab_from)


def write_pair(folder: str | Path, vocab_from: str | Path) -> tuple[Path, Path]:
    """The target (Q8_0) and its draft model (Q4_0, sharpened), in `folder`."""
    from edgespec.llama import quantize

    folder = Path(folder)
    fields = tokenizer(vocab_from)
    out = []
    for name, seed, sharpen, qtype in (("tiny-target", 0, 1.0, "q8_0"), ("tiny-draft", 1, SHARPEN, "q4_0")):
        src = write(folder / f"{name}.f32.gguf", vocab_from, seed, sharpen, fields)
        dst = folder / f"{name}-{qtype}.gguf"
        quantize(src, dst, qtype, threads=2)
        src.unlink()
        out.append(dst)
    return out[0], out[1]
