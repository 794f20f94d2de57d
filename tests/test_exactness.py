"""The exactness policy, covered without a GPU: a simulated backend whose batches are not
bit-exact (a cost/exactness profile injected into the real engine, or into the cost cache the
CLI reads) keeps speculation on under `batched`, turns it off under `strict`, and says which
policy is in force in the stats."""

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from dataclasses import replace

import pytest

from edgespec.costmodel import BATCHED_ROWS, flat, resolve_policy, verify_rows
from edgespec.models import cache_root

from conftest import GREEDY, PROMPTS
from synthetic_kquant import tiny_q4_k_fixture

COPY = PROMPTS[3]


@pytest.mark.parametrize("requested,rows,gpu,policy", [
    ("auto", 32, False, "strict"), ("auto", 1, False, "strict"),  # a CPU: strict whatever the probe says
    ("auto", 1, True, "batched"), ("auto", 3, True, "batched"),  # a GPU with (almost) no exact batches
    ("auto", 4, True, "strict"), ("auto", 32, True, "strict"),  # a GPU whose batches agree: keep bit-exact
    ("strict", 1, True, "strict"), ("batched", 32, False, "batched"),
])
def test_policy_follows_the_probe_and_the_backend(requested, rows, gpu, policy):
    assert resolve_policy(requested, rows, gpu) == policy


def test_rows_per_verification_follow_the_policy():
    c = flat(0.01, max_exact_rows=3)
    assert verify_rows(c, "strict") == 3 and verify_rows(c, "batched") == BATCHED_ROWS


def _run(engine, method="lookahead"):
    gen = engine.start(engine.prompt_tokens(COPY), 96, GREEDY, method)
    for _ in gen:
        pass
    return gen


@pytest.fixture
def gpu_like(smol):
    """The real engine made to look like a GPU backend whose batches differ from one-row decodes:
    rows cost as much as one, nothing beyond one row bit-exact, a near-tie margin of 0.03."""
    saved = (smol.cost, smol.on_gpu, smol.cfg)
    smol.cost = flat(0.01, max_exact_rows=1, batch_logit_diff=0.03)
    smol.on_gpu = True
    yield smol
    smol.cost, smol.on_gpu, smol.cfg = saved


def test_simulated_gpu_keeps_speculating_under_batched(gpu_like, smol):
    eng = gpu_like
    plain = _run(eng, "none")
    eng.cfg = replace(eng.cfg, exactness="auto")
    info = eng.exactness_info()
    assert info["policy"] == "batched" and info["backend"] == "gpu" and info["max_verify_rows"] == BATCHED_ROWS
    assert info["batch_logit_diff"] == 0.03 and "near-ties" in info["guarantee"]
    g = _run(eng)
    assert g.stats.n_drafted > 0  # verifications of more than one row, where none is bit-exact
    # on this CPU the batches are in fact exact, so the output is still plain decoding's
    assert g.tokens == plain.tokens


def test_simulated_gpu_under_strict_does_not_draft_and_says_so(gpu_like, caplog):
    eng = gpu_like
    eng.cfg = replace(eng.cfg, exactness="strict")
    info = eng.exactness_info()
    assert info["policy"] == "strict" and info["max_verify_rows"] == 1 and "speculation is off" in info["guarantee"]
    lg = logging.getLogger("edgespec")
    lg.addHandler(caplog.handler)
    try:
        eng.exactness.warn(eng.target.path.name, eng.cfg.kv_type)
    finally:
        lg.removeHandler(caplog.handler)
    assert "speculation is off" in caplog.text and "--exactness batched" in caplog.text
    g = _run(eng)
    assert g.stats.n_drafted == 0


def test_drafts_grow_where_rows_are_cheap(smol):
    """The same drafter drafts wider and deeper on a flat (GPU-like) cost curve than on this CPU's."""
    saved = smol.cost
    try:
        cpu = _run(smol)
        smol.cost = flat(0.01, saved.max_exact_rows)
        gpu = _run(smol)
    finally:
        smol.cost = saved
    assert gpu.stats.n_drafted / gpu.stats.n_steps > cpu.stats.n_drafted / max(1, cpu.stats.n_steps)


def test_run_json_reports_the_policy_with_an_injected_profile(tmp_path):
    """The CLI reads an exactness profile from the cost cache: every entry made non-exact (and
    flat, so that only the policy decides whether anything is drafted)."""
    cache = tmp_path / "cache"
    cache.mkdir()
    os.symlink(cache_root() / "models", cache / "models")
    if (cache_root() / "costs.json").exists():
        shutil.copy(cache_root() / "costs.json", cache / "costs.json")
    env = {**os.environ, "EDGESPEC_CACHE": str(cache)}
    base = [sys.executable, "-m", "edgespec", "run", "-m", "smollm2-135m-instruct:q4_0", "-t", "2", "-c", "1024",
            "--json", "--spec", "lookahead", "-p", COPY]
    r = subprocess.run(base + ["-n", "1"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    costs = json.loads((cache / "costs.json").read_text())
    for rec in costs.values():
        rec["max_exact_rows"], rec["batch_logit_diff"] = 1, 0.02
        # rows as cheap as one (a GPU's curve), so that `batched` drafts whatever this shared
        # machine's timing was when the curve was measured; quiet and fresh, so not measured again
        rec["ms"] = [rec["ms"][0]] * len(rec["ms"])
        rec["attn_us_per_row_per_token"] = rec["attn0_us_per_token"] = 0.0
        rec["cpu_share"], rec["measured_at"] = 1.0, time.time()
        rec.pop("online", None)
    (cache / "costs.json").write_text(json.dumps(costs))
    out = {}
    for policy in ("batched", "strict"):  # batched first: on the injected curve as it was written
        r = subprocess.run(base + ["-n", "64", "--exactness", policy], capture_output=True, text=True, env=env,
                           timeout=300)
        assert r.returncode == 0, r.stderr
        out[policy] = json.loads(r.stdout)
        ex = out[policy]["stats"]["exactness"]
        assert ex["policy"] == policy and ex["requested"] == policy and ex["max_exact_rows"] == 1
    assert "speculation is off" in subprocess.run(base + ["-n", "1", "--exactness", "strict"], capture_output=True,
                                                  text=True, env=env, timeout=300).stderr
    assert out["strict"]["stats"]["n_drafted"] == 0 and out["batched"]["stats"]["n_drafted"] > 0
    assert out["strict"]["token_ids"] == out["batched"]["token_ids"]  # this CPU's batches are exact anyway


def test_doctor_reports_backend_curve_probe_and_policy():
    r = subprocess.run([sys.executable, "-m", "edgespec", "doctor", "-m", "smollm2-135m-instruct:q4_0", "-t", "2",
                        "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert any(dev["type"] == "cpu" for dev in d["devices"]) and d["layers"] == 30
    assert d["exactness"]["policy"] == "strict" and d["exactness"]["max_exact_rows"] >= 2
    assert d["cost"]["k"][0] == 1 and isinstance(d["gpu_offload_supported"], bool)
    assert d["auto"] == ["lookahead"] and {"none", "lookahead", "auto"} <= set(d["methods"])  # no -md, no nextn
    r = subprocess.run([sys.executable, "-m", "edgespec", "doctor", "-m", "smollm2-135m-instruct:q4_0", "-t", "2"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "exactness probe" in r.stdout and "policy: strict" in r.stdout
    assert "auto drafts with lookahead" in r.stdout


def test_doctor_remeasures_the_cost_curve_on_request():
    from edgespec.models import cache_root

    costs = cache_root() / "costs.json"
    cmd = [sys.executable, "-m", "edgespec", "doctor", "-m", "smollm2-135m-instruct:q4_0", "-t", "2", "--json"]
    assert subprocess.run(cmd, capture_output=True, timeout=300).returncode == 0  # measured once, cached
    before = costs.stat().st_mtime_ns
    assert subprocess.run(cmd, capture_output=True, timeout=300).returncode == 0
    assert costs.stat().st_mtime_ns == before  # read from the cache
    r = subprocess.run(cmd + ["--remeasure"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert costs.stat().st_mtime_ns != before  # measured again and written back
    d = json.loads(r.stdout)
    assert d["cost"]["k"][0] == 1 and d["exactness"]["max_exact_rows"] >= 2
    key = next(k for k in json.loads(costs.read_text()) if "smollm2-135m-instruct.q4_0" in k and "|t2|" in k
               and "kvq8_0/f16" in k)
    assert json.loads(costs.read_text())[key]["ms"] == d["cost"]["ms"]


def test_probe_finds_the_f16_split_path_and_keeps_q8_0_k_exact(smol):
    """llama.cpp's CPU attention takes a split-KV path for one row past 512 cells when K and V
    are both f16: the probe's long-context stage sees it. K and V of different types (the
    q8_0/f16 default) keep one path for every row count, at long contexts too."""
    from edgespec.costmeasure import probe_exactness
    from edgespec.kv import KVSeq
    from edgespec.llama import Context, ContextConfig

    found = {}
    for kv in ("f16", "q8_0/f16"):
        ctx = Context(smol.target, ContextConfig(1024, 64, 2, 1, kv))
        try:
            found[kv] = probe_exactness(ctx, KVSeq(ctx))
        finally:
            ctx.close()
    assert found["f16"][0] == 1 and found["f16"][1] > 0
    # q8_0/f16 at long contexts reads as the engine's own probe did when it loaded (same kernels,
    # same K/V types); with edgespec's batch-invariant kernels installed that is every probed row, exact
    from edgespec import kernels
    from edgespec.costmeasure import PROBE_ROWS

    reading = (smol.cost.max_exact_rows, smol.cost.batch_logit_diff)
    assert smol.cfg.kv_type == "q8_0/f16" and found["q8_0/f16"] == reading
    if kernels.batch_invariant():
        assert reading == (PROBE_ROWS[-1], 0.0)


def test_logits_views_stay_true_as_the_output_buffer_grows(smol):
    """`Context.logits` keeps a view per row address: whatever the last decode's row count (the
    buffer llama.cpp reallocates to hold more outputs), each row equals the binding's own read."""
    import ctypes

    import numpy as np
    from edgespec.kv import KVSeq
    from edgespec.llama import Context, ContextConfig, lc

    ctx = Context(smol.target, ContextConfig(256, 64, 2, 1, "q8_0/f16"))
    try:
        kv = KVSeq(ctx)
        toks = smol.prompt_tokens(COPY)[:40]
        n_vocab = smol.target.n_vocab

        def theirs(i):
            return np.ctypeslib.as_array(ctypes.cast(lc.llama_get_logits_ith(ctx.ptr, i), ctypes.POINTER(ctypes.c_float)),
                                         shape=(n_vocab,))

        for rows in (1, 24, 1, 40, 3):
            kv.reset()
            kv.extend(toks[:rows], all_rows=True)
            for i in range(rows):
                mine = ctx.logits(i)
                assert mine.shape == (n_vocab,) and np.array_equal(mine, theirs(i)), (rows, i)
    finally:
        ctx.close()


_KQUANT_CHILD = r"""
import json, sys
import numpy as np
from edgespec.engine import Engine, EngineConfig

path, exactness, exact_kernels = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
eng = Engine(EngineConfig(model=path, n_ctx=1024, threads=2, max_branches=1, exactness=exactness,
                          exact_kernels=exact_kernels))
info = eng.exactness_info()
kv, ctx = eng.kv, eng.ctx
rng = np.random.default_rng(5)
prefix = [int(x) for x in rng.integers(1, 255, 40)]
toks = [int(x) for x in rng.integers(1, 255, 33)]
kv.extend(prefix, want_logits=False)
one = [ctx.logits(kv.extend([t])).copy() for t in toks]
same = {}
for n in sorted({2, 3, 4, 5, 8, 16, 32, min(33, info["max_verify_rows"])}):
    kv.truncate(len(prefix))
    kv.extend(toks[:n], all_rows=True)
    same[n] = all(np.array_equal(ctx.logits(i), one[i]) for i in range(n))
print(json.dumps({**info, "same": same}))
"""


def _kquant_engine(model, exactness, exact_kernels, cache, stock=False):
    """The exactness info of an engine on `model` (a process of its own: llama.cpp reads its CPU
    kernel switches once per process, and which ggml-cpu is loaded is decided at import) and
    whether batches of n rows equal one-row decodes. `stock`: llama.cpp's own kernels
    (EDGESPEC_KERNELS=stock), else the patched build where one is installed."""
    env = {**os.environ, "EDGESPEC_CACHE": str(cache)}
    if stock:
        env["EDGESPEC_KERNELS"] = "stock"
    r = subprocess.run([sys.executable, "-c", _KQUANT_CHILD, str(model), exactness, str(int(exact_kernels))],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    d["same"] = {int(k): v for k, v in d["same"].items()}
    return d


tiny_q4_k = pytest.fixture(scope="module", name="tiny_q4_k")(tiny_q4_k_fixture)


def test_kquant_probe_and_policy_agree(tiny_q4_k, tmp_path):
    """A Q4_K_M model on this CPU with llama.cpp's stock kernels: with --exact-kernels under strict
    exactness the engine takes the per-row kernels and its probe reads at least 16 exact rows; with
    the default kernels the probe reads the repacked GEMM's limit. Either way the probe is the truth
    (a batch of the probed size equals one-row decodes, the next size does not) and strict verifies
    no more rows than it found."""
    strict = _kquant_engine(tiny_q4_k, "auto", True, tmp_path, stock=True)
    assert strict["policy"] == "strict" and strict["kernels"] == "per-row"
    assert strict["max_exact_rows"] >= 16 and strict["max_verify_rows"] == strict["max_exact_rows"]
    assert all(ok for n, ok in strict["same"].items() if n <= strict["max_exact_rows"])

    for requested, kernels in (("auto", False), ("batched", True)):  # batched keeps the default kernels
        fast = _kquant_engine(tiny_q4_k, requested, kernels, tmp_path, stock=True)
        assert fast["kernels"] == "stock"
        cap = fast["max_exact_rows"]
        assert cap < 16  # the repacked Q4_K GEMM (4 rows and more) differs from its one-row GEMV
        assert all(ok for n, ok in fast["same"].items() if n <= cap)
        assert not fast["same"][min(n for n in fast["same"] if n > cap)]
        if requested == "auto":
            assert fast["policy"] == "strict" and fast["max_verify_rows"] == cap
        else:
            assert fast["policy"] == "batched" and fast["max_verify_rows"] > cap


def test_kquant_batch_invariant_kernels(tiny_q4_k, tmp_path):
    """With edgespec's patched ggml-cpu (edgespec/patches/, built at install) the same Q4_K_M model
    keeps every batch of up to 32 rows bit-identical to one-row decodes with the fast default
    kernels (weights repacked), so strict verifies 32 rows; --exact-kernels then changes nothing."""
    from edgespec import kernels

    if not kernels.batch_invariant():
        pytest.skip(f"edgespec's batch-invariant kernels are not loaded here: {kernels.info()['why']}")
    for exact in (False, True):
        d = _kquant_engine(tiny_q4_k, "auto", exact, tmp_path)
        assert d["kernels"] == "batch-invariant" and d["policy"] == "strict"
        assert d["max_exact_rows"] == 32 and d["max_verify_rows"] == 32
        assert all(d["same"].values()), d["same"]
