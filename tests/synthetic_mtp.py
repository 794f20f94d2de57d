"""A tiny synthetic `mimo2` GGUF with one MTP (nextn) layer, for the MTP drafter's tests.

mimo2 is the simplest llama.cpp architecture with an executed MTP graph: plain attention, a dense
FFN when there are no experts, NEOX rope (docs/llamacpp-eagle3-mtp.md §3.4). Its MTP block needs
a fused `attn_qkv`, and its iSWA cache needs at least one sliding-window layer.

`agree=True` builds weights whose MTP head predicts exactly what the target says next, and only
through the target's hidden state, so acceptance is known by construction and a drafter that pairs
the hidden states with the wrong positions loses it:

* every layer is the identity (zero `attn_output` and `ffn_down`: only the residual stream
  remains), so the target's pre-norm hidden state at a position is its token's embedding;
* token t embeds as the one-hot vector e_{t mod D} (D = n_embd), and the output head maps e_i to
  token (i + 1) mod D: the target counts, t -> (t mod D) + 1 mod D, whatever the input;
* the MTP's `eh_proj` ignores the token half of its input and maps the hidden half e_i to e_{i+1},
  so the MTP row (token x_k, hidden h_{k-1}) gives e_{x_{k-1} + 1} = e_{x_k} and, through the
  shared head, x_k + 1: the target's next token. Chaining on the MTP's own output state
  (h_nextn = e_{x_k}) stays right at every depth.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from synthetic_gguf import llama_like_writer

ARCH = "mimo2"
N_EMBD = 64
N_HEAD = 2
N_HEAD_KV = 1
HEAD_DIM = N_EMBD // N_HEAD  # 32: a q8_0 KV cache (the default) needs head sizes divisible by 32
N_FF = 128
N_CTX = 1024
N_VOCAB = 256  # with the built-in dummy tokenizer


def _tokenizer_from(path: str | Path) -> list[tuple[str, object, gguf.GGUFValueType, gguf.GGUFValueType | None]]:
    """The tokenizer.* fields of another GGUF, as (key, value, type, array element type)."""
    r = gguf.GGUFReader(str(path))
    out = []
    for key, field in r.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        out.append((key, field.contents(), vtype, sub))
    return out


def write_mimo2_mtp(path: str | Path, vocab_from: str | Path | None = None, seed: int = 0, agree: bool = False,
                    n_layer: int = 2, n_nextn: int = 1) -> Path:
    """Write the model to `path` and return it.

    `vocab_from`: a GGUF whose tokenizer is copied (its vocabulary size is then the model's);
    without it, llama.cpp's dummy "test" tokenizer of 256 tokens. `seed`: the random weights.
    `agree`: the counting model described in the module docstring (100% acceptance)."""
    path = Path(path)
    rng = np.random.default_rng(seed)
    if vocab_from is not None:
        tok_fields = _tokenizer_from(vocab_from)
        n_vocab = next(len(v) for k, v, _, _ in tok_fields if k == "tokenizer.ggml.tokens")
    else:
        tok_fields = [
            ("tokenizer.ggml.model", "test", gguf.GGUFValueType.STRING, None),
            ("tokenizer.ggml.tokens", [f"tok_{i}" for i in range(N_VOCAB)], gguf.GGUFValueType.ARRAY,
             gguf.GGUFValueType.STRING),
            ("tokenizer.ggml.scores", [0.0] * N_VOCAB, gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.FLOAT32),
        ]
        n_vocab = N_VOCAB

    def w(*shape: int, scale: float = 0.05) -> np.ndarray:
        # numpy shape (out, in) is ggml's {in, out}
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def ones(n: int) -> np.ndarray:
        return np.ones((n,), np.float32)

    def zeros(*shape: int) -> np.ndarray:
        return np.zeros(shape, np.float32)

    n_all = n_layer + n_nextn
    wr = llama_like_writer(path, ARCH, n_ctx=N_CTX, n_embd=N_EMBD, n_layer=n_all,  # trunk + nextn blocks
                           n_ff=N_FF, n_head=N_HEAD, n_head_kv=N_HEAD_KV, head_dim=HEAD_DIM, n_vocab=n_vocab)
    wr.add_uint32(f"{ARCH}.attention.key_length", HEAD_DIM)
    wr.add_uint32(f"{ARCH}.attention.value_length", HEAD_DIM)
    wr.add_uint32(f"{ARCH}.expert_feed_forward_length", N_FF)  # required even when dense
    wr.add_uint32(f"{ARCH}.attention.sliding_window", 128)
    wr.add_array(f"{ARCH}.attention.sliding_window_pattern", [1, 0] * (n_layer // 2) + [1] * (n_layer % 2 + n_nextn))
    wr.add_uint32(f"{ARCH}.nextn_predict_layers", n_nextn)
    for key, val, vtype, sub in tok_fields:
        if vtype == gguf.GGUFValueType.ARRAY:
            wr.add_key_value(key, val, vtype, sub_type=sub)
        else:
            wr.add_key_value(key, val, vtype)

    d = N_EMBD
    if agree:
        tok_embd = np.zeros((n_vocab, d), np.float32)
        tok_embd[np.arange(n_vocab), np.arange(n_vocab) % d] = 1.0
        output = np.zeros((n_vocab, d), np.float32)
        output[(np.arange(d) + 1) % d, np.arange(d)] = 2.0  # e_i -> token i+1 (logit 16 after the norm)
        shift = np.zeros((d, d), np.float32)
        shift[(np.arange(d) + 1) % d, np.arange(d)] = 1.0  # e_i -> e_{i+1}
        eh_proj = np.concatenate([np.zeros((d, d), np.float32), shift], axis=1)  # [token half | hidden half]
    else:
        tok_embd = w(n_vocab, d, scale=1.0)
        output = w(n_vocab, d)
        eh_proj = w(d, 2 * d)
    wr.add_tensor("token_embd.weight", tok_embd)
    wr.add_tensor("output_norm.weight", ones(d))
    wr.add_tensor("output.weight", output)
    qkv_out = N_HEAD * HEAD_DIM + 2 * N_HEAD_KV * HEAD_DIM  # rows [Q | K | V]
    for i in range(n_all):
        wr.add_tensor(f"blk.{i}.attn_norm.weight", ones(d))
        wr.add_tensor(f"blk.{i}.attn_qkv.weight", w(qkv_out, d))  # fused: the MTP block requires it
        wr.add_tensor(f"blk.{i}.attn_output.weight", zeros(d, N_HEAD * HEAD_DIM) if agree else w(d, N_HEAD * HEAD_DIM))
        wr.add_tensor(f"blk.{i}.ffn_norm.weight", ones(d))
        wr.add_tensor(f"blk.{i}.ffn_gate.weight", w(N_FF, d))
        wr.add_tensor(f"blk.{i}.ffn_up.weight", w(N_FF, d))
        wr.add_tensor(f"blk.{i}.ffn_down.weight", zeros(d, N_FF) if agree else w(d, N_FF))
        if i >= n_layer:
            wr.add_tensor(f"blk.{i}.nextn.eh_proj.weight", eh_proj if i == n_layer else w(d, 2 * d))
            wr.add_tensor(f"blk.{i}.nextn.enorm.weight", ones(d))
            wr.add_tensor(f"blk.{i}.nextn.hnorm.weight", ones(d))
            wr.add_tensor(f"blk.{i}.nextn.shared_head_norm.weight", ones(d))
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return path


def agree_next(token: int) -> int:
    """What the `agree=True` target says after `token`."""
    return (token % N_EMBD + 1) % N_EMBD
