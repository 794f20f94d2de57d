"""A tiny llama-architecture GGUF quantized to Q4_K_M (Q4_K and Q6_K weights), for the exactness
probe's test: the kernels llama.cpp's CPU backend picks for K-quant weights depend on the number
of rows in a batch (docs/exactness.md), which a model of Q4_0/Q8_0 weights never shows.

The gguf package writes float32 weights (gguf-py has no K-quant quantizer); llama.cpp's own
quantizer (`llama_model_quantize`, ftype MOSTLY_Q4_K_M) turns them into K-quants. K-quant blocks
are 256 wide, so every matrix row is a multiple of 256; the CPU's repacked Q4_K layout needs row
counts divisible by 8.
"""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np

from synthetic_gguf import llama_like_writer

ARCH = "llama"
N_EMBD = 256
N_HEAD = 4
N_HEAD_KV = 2
HEAD_DIM = N_EMBD // N_HEAD
N_FF = 512
N_CTX = 1024
N_VOCAB = 256  # llama.cpp's dummy "test" tokenizer
FTYPE_Q4_K_M = 15  # llama_ftype LLAMA_FTYPE_MOSTLY_Q4_K_M
FTYPE_Q5_K_M = 17  # LLAMA_FTYPE_MOSTLY_Q5_K_M: Q5_K and Q6_K weights
FTYPE_IQ4_XS = 30  # LLAMA_FTYPE_MOSTLY_IQ4_XS


def write_f32(path: str | Path, n_layer: int = 2, seed: int = 0, n_ff: int = N_FF) -> Path:
    path = Path(path)
    rng = np.random.default_rng(seed)

    def w(*shape: int, scale: float = 0.06) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)  # numpy (out, in) = ggml {in, out}

    wr = llama_like_writer(path, ARCH, n_ctx=N_CTX, n_embd=N_EMBD, n_layer=n_layer, n_ff=n_ff, n_head=N_HEAD,
                           n_head_kv=N_HEAD_KV, head_dim=HEAD_DIM, n_vocab=N_VOCAB)
    wr.add_key_value("tokenizer.ggml.model", "test", gguf.GGUFValueType.STRING)
    wr.add_key_value("tokenizer.ggml.tokens", [f"tok_{i}" for i in range(N_VOCAB)], gguf.GGUFValueType.ARRAY,
                     sub_type=gguf.GGUFValueType.STRING)
    wr.add_key_value("tokenizer.ggml.scores", [0.0] * N_VOCAB, gguf.GGUFValueType.ARRAY,
                     sub_type=gguf.GGUFValueType.FLOAT32)
    wr.add_tensor("token_embd.weight", w(N_VOCAB, N_EMBD, scale=1.0))
    wr.add_tensor("output_norm.weight", np.ones(N_EMBD, np.float32))
    wr.add_tensor("output.weight", w(N_VOCAB, N_EMBD))
    for i in range(n_layer):
        wr.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(N_EMBD, np.float32))
        wr.add_tensor(f"blk.{i}.attn_q.weight", w(N_HEAD * HEAD_DIM, N_EMBD))
        wr.add_tensor(f"blk.{i}.attn_k.weight", w(N_HEAD_KV * HEAD_DIM, N_EMBD))
        wr.add_tensor(f"blk.{i}.attn_v.weight", w(N_HEAD_KV * HEAD_DIM, N_EMBD))
        wr.add_tensor(f"blk.{i}.attn_output.weight", w(N_EMBD, N_HEAD * HEAD_DIM))
        wr.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(N_EMBD, np.float32))
        wr.add_tensor(f"blk.{i}.ffn_gate.weight", w(n_ff, N_EMBD))
        wr.add_tensor(f"blk.{i}.ffn_up.weight", w(n_ff, N_EMBD))
        wr.add_tensor(f"blk.{i}.ffn_down.weight", w(N_EMBD, n_ff))
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return path


def write_q4_k_m(path: str | Path, n_layer: int = 2, seed: int = 0, ftype: int = FTYPE_Q4_K_M, n_ff: int = N_FF) -> Path:
    """The tiny model, quantized to Q4_K_M (or another llama_ftype) by llama.cpp; returns `path`.
    `n_ff`: the FFN's width (a multiple of 256), the input width of its down projection."""
    import llama_cpp as lc

    from edgespec.llama import backend_init

    path = Path(path)
    src = write_f32(path.with_name(path.stem + ".f32.gguf"), n_layer, seed, n_ff)
    backend_init()
    params = lc.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = 2
    rc = lc.llama_model_quantize(str(src).encode(), str(path).encode(), ctypes.byref(params))
    src.unlink()
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize failed ({rc})")
    return path


def tensor_types(path: str | Path) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}


def tiny_q4_k_fixture(tmp_path_factory):
    """The tiny model quantized to Q4_K_M, written once per test module (a pytest fixture: tests
    take it as `tiny_q4_k = pytest.fixture(scope="module")(tiny_q4_k_fixture)`)."""
    p = write_q4_k_m(tmp_path_factory.mktemp("kquant") / "tiny-q4_k_m.gguf")
    assert {"Q4_K", "Q6_K"} <= set(tensor_types(p).values())
    return p


# The tiny model's tensors of both weight types: Q4_K (repacked) and Q6_K.
CHECK_TENSORS = "blk.0.ffn_gate.weight,blk.1.ffn_down.weight,output.weight,blk.1.attn_v.weight"


def matmul_mismatches(model: str | Path, name: str, folder: str | Path, rows: str, tensors: str = CHECK_TENSORS,
                      types: set[str] | None = None) -> list[dict]:
    """scripts/kernel_bench.py --check with the ggml-cpu build in `folder` on `tensors` of `model`
    (the tiny model's CHECK_TENSORS by default) at `rows` (comma-separated): per tensor, its type,
    whether the build repacked it, and {rows: values differing from one-row products}. The tensors' types must be `types` (default:
    Q4_K, repacked, and Q6_K)."""
    root = Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, str(root / "scripts" / "kernel_bench.py"), str(model), "--lib",
                        f"{name}={folder}", "--tensors", tensors, "--rows", rows, "--rounds", "1",
                        "--reps", "1", "--mb", "1", "--check", "--no-lock", "--json", "/dev/stdout", "--quiet"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)["rounds"][name][0]["tensors"]
    if types is None:
        assert {t["type"] for t in got} == {"q4_K", "q6_K"} and any(t["repacked"] for t in got)
    else:
        assert {t["type"] for t in got} == types
    return [{"name": t["name"], "type": t["type"], "repacked": t["repacked"],
             "diff": {n: v["mismatches"] for n, v in t["ms"].items()}} for t in got]
