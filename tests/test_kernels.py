"""edgespec's batch-invariant CPU kernels (edgespec/patches/, kernel_build.py, kernels.py): a batch of
any size up to 32 rows gives each row the bits of a one-row decode on K-quant weights, the build and
the loader refuse what does not fit, and which kernels run is reported."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from edgespec import kernel_build, kernels

from synthetic_kquant import FTYPE_IQ4_XS, FTYPE_Q5_K_M, matmul_mismatches, tensor_types, tiny_q4_k_fixture, write_q4_k_m

# Every row count from 1 to 32 against one-row decodes of the same tokens after a 40-token prefix,
# on the tiny Q4_K_M model's random weights (tests/synthetic_kquant.py): Q4_K repacked (the GEMV for
# 1 row, the several-row GEMV of patches 0004/0005/0007/0010 for 2-8 rows (these rows are 256-512 wide:
# patch 0009's GEMM for 4-8 wide rows is not taken here; kernel_bench --check on the 1.5B covers it),
# the 4-row and 16-row GEMMs above) and Q6_K (output, blk.1.attn_v, blk.1.ffn_down) through the
# several-row dot product of patches 0003/0006/0008 for every chunk of 2 rows or more (a breakpoint
# counts it: 768 calls for a 3-row decode after a 4-token one), the per-row kernel for a 1-row chunk,
# the tiled one above its floor.
_ROWS_CHILD = r"""
import json, sys
import numpy as np
from edgespec import kernels
from edgespec.kv import KVSeq
from edgespec.llama import Context, ContextConfig, Model

m = Model(sys.argv[1])
ctx = Context(m, ContextConfig(512, 512, 2, 1, "q8_0/f16"))
kv = KVSeq(ctx)
rng = np.random.default_rng(7)
prefix = [int(x) for x in rng.integers(1, 255, 40)]
toks = [int(x) for x in rng.integers(1, 255, 32)]
kv.extend(prefix, want_logits=False)
one = [ctx.logits(kv.extend([t])).copy() for t in toks]
diff = {}
for n in range(1, 33):
    kv.truncate(len(prefix))
    kv.extend(toks[:n], all_rows=True)
    diff[n] = max(float(np.max(np.abs(ctx.logits(i) - one[i]))) for i in range(n))
print(json.dumps({"kernels": kernels.info()["kernels"], "diff": diff}))
"""


def _rows(model, stock: bool) -> dict:
    env = {**os.environ}
    if stock:
        env["EDGESPEC_KERNELS"] = "stock"
    r = subprocess.run([sys.executable, "-c", _ROWS_CHILD, str(model)], capture_output=True, text=True, timeout=300,
                       env=env)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    d["diff"] = {int(k): v for k, v in d["diff"].items()}
    return d


tiny_q4_k = pytest.fixture(scope="module", name="tiny_q4_k")(tiny_q4_k_fixture)


def test_the_installed_build_is_loaded():
    """CI (and anyone who sets EDGESPEC_REQUIRE_KERNELS=1) installs with the build: it must load."""
    info = kernels.info()
    if os.environ.get("EDGESPEC_REQUIRE_KERNELS") != "1" and info["kernels"] != "batch-invariant":
        pytest.skip(f"the batch-invariant kernels are not loaded here: {info['why']}")
    assert info["kernels"] == "batch-invariant", info
    assert info["patches"] == kernel_build.patch_digest()


def test_every_row_count_is_bit_identical_to_one_row(tiny_q4_k):
    """Patched: batches of 1 to 32 rows equal one-row decodes to the bit. Stock (the same process
    setup with EDGESPEC_KERNELS=stock): they do not from 4 rows (the repacked Q4_K GEMM), which is
    what the patch changes."""
    if not kernels.batch_invariant():
        pytest.skip(f"the batch-invariant kernels are not loaded here: {kernels.info()['why']}")
    patched = _rows(tiny_q4_k, stock=False)
    assert patched["kernels"] == "batch-invariant"
    assert all(d == 0.0 for d in patched["diff"].values()), patched["diff"]
    stock = _rows(tiny_q4_k, stock=True)
    assert stock["kernels"] == "stock"
    assert all(stock["diff"][n] == 0.0 for n in (1, 2, 3))
    assert any(stock["diff"][n] > 0.0 for n in range(4, 33)), stock["diff"]




def test_matmul_rows_are_bit_identical_to_one_row(tiny_q4_k):
    """The matrix products alone, through ggml (scripts/kernel_bench.py --check): every output value
    of a product with N rows has the bits of the one-row product of its row, for each weight type
    the tiny model holds (Q4_K repacked, Q6_K), at every row count the several-row kernels take
    (1-8: each a call of its own size, for the Q4_K GEMV and the Q6_K dot product) and two above (16:
    the 16-row GEMM; 33: past the tiled kernel's floor, which edgespec sets to 33, so that one is
    expected to differ and shows the check can fail)."""
    if not kernels.batch_invariant():
        pytest.skip(f"the batch-invariant kernels are not loaded here: {kernels.info()['why']}")
    if shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler to build the matmul harness")
    lib = Path(kernels.info()["path"]).parent
    for t in matmul_mismatches(tiny_q4_k, "patched", lib, "1,2,3,4,5,6,7,8,16,33"):
        diff = t["diff"]
        assert all(diff[n] == 0 for n in diff if n != "33"), (t["name"], diff)
        if t["type"] == "q6_K":
            assert diff["33"] > 0, (t["name"], diff)  # the tiled kernel: the check does see a difference


def test_q4_1_rows_are_bit_identical_to_one_row():
    """The default SmolLM2 file is Q4_1 in its body (Q8_0 output): repacked at load on AVX2 (patch
    0012; 0011's several-row dot product where it is not), every row count from 1 to 32 decodes to
    the bits of one-row decodes, and the product alone (kernel_bench --check on a Q4_1 tensor, in
    the repacking buffer as a model load puts it) has them at 1-8 rows, one call each, 16 and 33."""
    if not kernels.batch_invariant():
        pytest.skip(f"the batch-invariant kernels are not loaded here: {kernels.info()['why']}")
    from edgespec.models import resolve

    _exact_decodes_and_product(resolve("smollm2-135m-instruct", quiet=True), "1,2,3,4,5,6,7,8,16,33",
                               "blk.3.ffn_up.weight", "q4_1")


def _exact_decodes_and_product(model, rows: str, tensor: str, qtype: str) -> None:
    """Whole decodes of 1-32 rows with the bits of one-row decodes; the product of `tensor` (of
    type `qtype`, repacked where the CPU has AVX2) alone with the bits of one-row products at `rows`."""
    patched = _rows(model, stock=False)
    assert patched["kernels"] == "batch-invariant"
    assert all(d == 0.0 for d in patched["diff"].values()), patched["diff"]
    if shutil.which(os.environ.get("CC", "cc")) is None:
        return
    lib = Path(kernels.info()["path"]).parent
    (t,) = matmul_mismatches(model, "patched", lib, rows, tensor, {qtype})
    assert all(n == 0 for n in t["diff"].values()), t
    assert t["repacked"] == ("avx2" in (kernel_build.cpu_flags() or set())), t


@pytest.mark.parametrize("ftype,qtype,ggml_name", [(FTYPE_Q5_K_M, "Q5_K", "q5_K"), (FTYPE_IQ4_XS, "IQ4_XS", "iq4_xs")],
                         ids=["q5_k_m", "iq4_xs"])
def test_q5_k_and_iq4_xs_rows_are_bit_identical_to_one_row(tmp_path, ftype, qtype, ggml_name):
    """Q5_K_M files (Q5_K, Q6_K) and IQ4_XS files: through the several-row dot products of patch
    0013 (Q5_K), 0014 (IQ4_XS) and 0003 (Q6_K), every row count from 1 to 32 decodes to the bits of
    one-row decodes on the tiny model's random weights, and the Q5_K or IQ4_XS products alone have
    them at 1-8 and 16 rows (at 33 the tiled kernel takes over and differs: the check sees it). The
    stock kernels differ from 8 rows (their tiled floor)."""
    if not kernels.batch_invariant():
        pytest.skip(f"the batch-invariant kernels are not loaded here: {kernels.info()['why']}")
    model = write_q4_k_m(tmp_path / f"tiny-{qtype.lower()}.gguf", ftype=ftype)
    assert qtype in set(tensor_types(model).values())
    patched = _rows(model, stock=False)
    assert patched["kernels"] == "batch-invariant"
    assert all(d == 0.0 for d in patched["diff"].values()), patched["diff"]
    stock = _rows(model, stock=True)
    assert any(stock["diff"][n] > 0.0 for n in range(8, 33)), stock["diff"]
    if shutil.which(os.environ.get("CC", "cc")) is None:
        return
    lib = Path(kernels.info()["path"]).parent
    for t in matmul_mismatches(model, "patched", lib, "1,2,3,4,5,6,7,8,16,33", "blk.0.ffn_up.weight,blk.0.ffn_gate.weight",
                               {ggml_name}):
        assert all(t["diff"][n] == 0 for n in t["diff"] if n != "33"), t
        assert t["diff"]["33"] > 0, t


def test_wide_q4_k_rows_are_bit_identical_to_one_row(tmp_path):
    """Q4_K rows wider than the L1 cache holds for the rows of a product (patch 0015: an 8960-wide
    ffn_down, 35 blocks, taken in 2 passes from 4 rows and 3 from 8, the accumulators kept in
    memory between them): the product alone has the one-row GEMV's bits at 1-8 and 16 rows, and a
    whole decode at every row count from 1 to 32."""
    if not kernels.batch_invariant():
        pytest.skip(f"the batch-invariant kernels are not loaded here: {kernels.info()['why']}")
    model = write_q4_k_m(tmp_path / "tiny-wide-q4_k_m.gguf", n_layer=2, n_ff=8960)
    assert tensor_types(model)["blk.0.ffn_down.weight"] == "Q4_K"
    _exact_decodes_and_product(model, "1,2,3,4,5,6,7,8,16", "blk.0.ffn_down.weight", "q4_K")


def _q4_1_blocks(model, name: str) -> tuple[np.ndarray, int, int]:
    from gguf import GGUFReader

    (t,) = [t for t in GGUFReader(model).tensors if t.name == name]
    k, n = int(t.shape[0]), int(t.shape[1])
    return np.asarray(t.data).view(np.uint8).reshape(n, k // 32, 20), k, n


def _q4_1x8(blocks: np.ndarray) -> np.ndarray:
    """block_q4_1x8 as patch 0012's repack.h lays it out: per group of 8 weight rows and block, the
    8 scales, the 8 mins, then 4 vectors of 32 bytes, vector v holding row j's quant bytes 4v..4v+3
    at 4j..4j+3."""
    n, nb, _ = blocks.shape
    g = blocks.reshape(n // 8, 8, nb, 20).transpose(0, 2, 1, 3)  # group, block, row, bytes
    out = np.empty((n // 8, nb, 160), np.uint8)
    out[..., 0:16] = g[..., 0:2].reshape(n // 8, nb, 16)
    out[..., 16:32] = g[..., 2:4].reshape(n // 8, nb, 16)
    qs = g[..., 4:].reshape(n // 8, nb, 8, 4, 4)  # row, vector, byte
    out[..., 32:] = qs.transpose(0, 1, 3, 2, 4).reshape(n // 8, nb, 128)
    return np.ascontiguousarray(out)


def test_repacked_q4_1_products_are_the_exact_sums():
    """Bit-identical rows say nothing of whether a row is right. Patch 0012's GEMV on SmolLM2's own
    Q4_1 weights, laid out as its repack does, against Q8_1 activations that ggml quantized: each
    value equals the float64 sum of d_w * d_a * (integer dot product) + m_w * s_a over the blocks to
    float precision, for one row and for eight (the one-row dot product, for scale, is as close)."""
    import ctypes

    if not kernels.batch_invariant():
        pytest.skip(f"the batch-invariant kernels are not loaded here: {kernels.info()['why']}")
    if "avx2" not in (kernel_build.cpu_flags() or set()):
        pytest.skip("patch 0012's kernel is x86 AVX2 only")
    from edgespec.models import resolve

    lib = ctypes.CDLL(kernels.info()["path"])
    lib.ggml_cpu_init()
    blocks, k, n = _q4_1_blocks(resolve("smollm2-135m-instruct", quiet=True), "blk.3.ffn_up.weight")
    nb, rows = k // 32, 8
    rng = np.random.default_rng(5)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    q = np.zeros((rows, nb * 36), np.uint8)
    for r in range(rows):
        lib.quantize_row_q8_1(x[r].ctypes.data_as(ctypes.c_void_p), q[r].ctypes.data_as(ctypes.c_void_p),
                              ctypes.c_int64(k))
    qa = q.reshape(rows, nb, 36)
    d_a = qa[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float64)
    s_a = qa[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
    a = qa[..., 4:].view(np.int8).astype(np.float64)
    d_w = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float64)
    m_w = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
    w = np.concatenate([blocks[..., 4:] & 15, blocks[..., 4:] >> 4], axis=2).astype(np.float64)
    exact = np.einsum("nbk,rbk,nb,rb->rn", w, a, d_w, d_a) + np.einsum("nb,rb->rn", m_w, s_a)
    packed = _q4_1x8(blocks)
    for nr in (1, rows):
        out = np.zeros((nr, n), np.float32)
        lib.ggml_gemv_q4_1_8x8_q8_1_rows(ctypes.c_int(k), out.ctypes.data_as(ctypes.c_void_p), ctypes.c_size_t(n),
                                         packed.ctypes.data_as(ctypes.c_void_p), q.ctypes.data_as(ctypes.c_void_p),
                                         ctypes.c_size_t(nb * 36), ctypes.c_int(nr), ctypes.c_int(n))
        err = np.abs(out - exact[:nr]).max() / np.abs(exact[:nr]).max()
        assert err < 1e-6, (nr, err)


@pytest.mark.parametrize("variant", ["q4_0", "q8_0"])
def test_q4_0_and_q8_0_rows_are_bit_identical_to_one_row(variant):
    """The catalog's other SmolLM2 files, which no patch of ours touches: on x86 ggml repacks Q4_0
    at load (its interleaved GEMV/GEMM) and runs Q8_0 (their output layer too) through llamafile's
    tinyBLAS from 2 rows, the one-row dot product for one; every row count from 1 to 32 decodes to
    the bits of one-row decodes all the same (docs/laptop.md has what their rows cost)."""
    if not kernels.batch_invariant():
        pytest.skip(f"the batch-invariant kernels are not loaded here: {kernels.info()['why']}")
    from edgespec.models import resolve

    patched = _rows(resolve(f"smollm2-135m-instruct:{variant}", quiet=True), stock=False)
    assert patched["kernels"] == "batch-invariant"
    assert all(d == 0.0 for d in patched["diff"].values()), patched["diff"]


def test_stock_is_reported_with_its_reason():
    r = subprocess.run([sys.executable, "-m", "edgespec.frontends.cli", "kernels", "--json"], capture_output=True,
                       text=True, timeout=120, env={**os.environ, "EDGESPEC_KERNELS": "stock"})
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["kernels"] == "stock" and d["why"] == "EDGESPEC_KERNELS=stock"
    assert d["patches"] == [p.name for p in kernel_build.patches()]


def test_a_build_that_does_not_fit_is_not_loaded(tmp_path, monkeypatch):
    """The loader's checks, on manifests laid out by hand: a failed build, other patches, another
    llama-cpp-python, a missing library; each says why in one line."""
    lib_dir = kernels._llama_lib_dir()
    assert lib_dir is not None
    (tmp_path / kernel_build.LIB).write_bytes((lib_dir / kernel_build.LIB).read_bytes())  # a real ELF: $ORIGIN only
    # the ggml version of the installed llama-cpp-python (its libggml-base.so.X.Y.Z)
    ggml = next(lib_dir.glob("libggml-base.so.*.*.*")).name[len("libggml-base.so."):]
    good = {"format": kernel_build.MANIFEST_FORMAT, "llama_cpp_python": kernel_build.LLAMA_CPP_PYTHON,
            "ggml": ggml, "patches": kernel_build.patch_digest()}

    def why(**change) -> str:
        (tmp_path / kernel_build.MANIFEST).write_text(json.dumps({**good, **change}))
        return kernels._usable(tmp_path, lib_dir)

    assert why() == ""
    assert "failed" in why(error="cmake configure failed (exit 1)")
    assert "other patches" in why(patches="0" * 16)
    assert "built for llama-cpp-python 0.0.1" in why(llama_cpp_python="0.0.1")
    assert "ggml is not 9.9.9" in why(ggml="9.9.9")
    (tmp_path / kernel_build.LIB).unlink()
    assert "no build" in why()


def test_cmake_args_follow_llama_cpp_pythons_build():
    """The user's CMAKE_ARGS (as llama-cpp-python took them) come through; other backends are off
    here (llama-cpp-python builds them); dynamically loaded CPU variants are refused."""
    args = kernel_build.cmake_args({"CMAKE_ARGS": "-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_CUDA=on"})
    assert "-DGGML_NATIVE=OFF" in args and "-DGGML_AVX2=ON" in args
    assert args.index("-DGGML_CUDA=OFF") > args.index("-DGGML_CUDA=on")  # the later one wins in CMake
    assert "-DCMAKE_BUILD_TYPE=Release" in args and "-DBUILD_SHARED_LIBS=ON" in args
    with pytest.raises(kernel_build.BuildError, match="GGML_BACKEND_DL"):
        kernel_build.cmake_args({"CMAKE_ARGS": "-DGGML_BACKEND_DL=ON"})



SAPPHIRE = {"sse4_2", "avx", "avx2", "bmi2", "fma", "f16c", "avx_vnni", "avx512f", "avx512cd", "avx512vl", "avx512dq",
            "avx512bw", "avx512vbmi", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_int8", "amx_bf16"}


def test_a_trapped_amx_is_left_out_of_a_native_build(monkeypatch):
    """A virtual machine that reports AMX but traps it: the kernels are built for the extensions it
    reports without AMX (a native build died of SIGILL in every model command there). Where AMX runs,
    where the CPU does not report it, and where CMAKE_ARGS chose the instruction sets, nothing changes."""
    probed = []

    def probe(result):
        return lambda: probed.append(1) or result

    assert kernel_build.trapped_amx([], SAPPHIRE, probe(False))
    assert not kernel_build.trapped_amx([], SAPPHIRE, probe(True))
    assert not kernel_build.trapped_amx([], SAPPHIRE, probe(None))  # no compiler knows AMX: no build uses it
    assert len(probed) == 3
    assert not kernel_build.trapped_amx([], SAPPHIRE - {"amx_tile"}, probe(False))
    assert not kernel_build.trapped_amx(["-DGGML_NATIVE=OFF", "-DGGML_AVX2=ON"], SAPPHIRE, probe(False))
    assert not kernel_build.trapped_amx(["-DGGML_AMX_TILE=OFF"], SAPPHIRE, probe(False))
    assert len(probed) == 3  # the probe runs only where it decides something

    monkeypatch.setattr(kernel_build, "cpu_flags", lambda: set(SAPPHIRE))
    args = kernel_build.cmake_args({"CMAKE_ARGS": "-DGGML_RPC=ON"}, amx_check=lambda user: True)
    for on in ("AVX", "AVX2", "FMA", "F16C", "BMI2", "AVX_VNNI", "AVX512", "AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16"):
        assert f"-DGGML_{on}=ON" in args, on
    for off in ("NATIVE", "AMX_TILE", "AMX_INT8", "AMX_BF16"):
        assert f"-DGGML_{off}=OFF" in args, off
    plain = kernel_build.without_amx({"sse4_2", "avx", "avx2", "fma", "f16c", "avx512_vnni"})  # no AVX-512 F
    assert "-DGGML_AVX2=ON" in plain and "-DGGML_AVX512=OFF" in plain and "-DGGML_AVX512_VNNI=OFF" in plain


@pytest.mark.skipif(kernel_build.unsupported() != "", reason="x86-64 Linux only")
def test_the_amx_probe_tells_a_cpu_that_does_not_run_it():
    """The probe compiles and runs AMX for real: where this CPU does not report AMX, it must say AMX
    does not run (the instructions trap here, as on the virtual machines it is for)."""
    flags = kernel_build.cpu_flags() or set()
    result = kernel_build.amx_runs()
    if "amx_tile" in flags:
        assert result in (True, False, None)
    else:
        assert result in (False, None)  # None: no compiler here knows AMX

def test_the_patches_say_why():
    """Each patch carries its reason and the commit it is made against, as ollama's do."""
    ps = kernel_build.patches()
    assert [p.name[:4] for p in ps] == ["0001", "0002", "0003", "0004", "0005", "0006", "0007", "0008", "0009", "0010",
                                        "0011", "0012", "0013", "0014", "0015"]
    for p in ps:
        head = p.read_text().split("\n---\n", 1)[0]
        assert "Subject: [PATCH]" in head and "0c1e57098" in head and len(head.splitlines()) > 8
