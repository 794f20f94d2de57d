"""`sampling.warp` against a direct computation and against llama.cpp's own sampler chain on the
same logits; the shared validation of sampling settings."""

import ctypes

import numpy as np
import pytest

from edgespec.sampling import SamplingConfig, SamplingError, make_sampling, pick, sample, warp


def direct(logits, top_k, top_p, min_p, temp):
    """The same chain written the slow, obvious way: sort, cut, renormalize at each stage."""
    x = np.asarray(logits, dtype=np.float64)
    order = sorted(range(len(x)), key=lambda i: -x[i])
    if top_k > 0:
        order = order[:top_k]
    p = np.exp(x[order] - x[order[0]])
    p /= p.sum()
    if top_p < 1.0:
        keep, total = 0, 0.0
        for pi in p:
            keep += 1
            total += pi
            if total >= top_p:
                break
        order, p = order[:keep], p[:keep]
    if min_p > 0.0:
        kept = [i for i, pi in zip(order, p) if pi >= min_p * p[0]]
        order = kept or order[:1]
    z = x[order] / temp
    q = np.exp(z - z.max())
    out = np.zeros(len(x))
    out[order] = q / q.sum()
    return out


SETTINGS = [
    (40, 0.95, 0.05, 0.8), (0, 1.0, 0.0, 1.0), (5, 1.0, 0.0, 1.3), (0, 0.5, 0.0, 0.7), (0, 1.0, 0.2, 1.0),
    (10, 0.9, 0.1, 2.0), (1, 1.0, 0.0, 1.0), (3, 0.99, 0.3, 0.5),
]


@pytest.mark.parametrize("top_k,top_p,min_p,temp", SETTINGS)
def test_warp_matches_a_direct_computation(top_k, top_p, min_p, temp):
    rng = np.random.default_rng(7)
    for _ in range(20):
        logits = (rng.standard_normal(300) * rng.uniform(0.5, 4.0)).astype(np.float32)
        got = warp(logits, SamplingConfig(temp, top_k, top_p, min_p))
        want = direct(logits, top_k, top_p, min_p, temp)
        assert np.array_equal(got > 0, want > 0)
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)
        assert got.sum() == pytest.approx(1.0)


def llama_cpp_chain(logits, top_k, top_p, min_p, temp) -> dict[int, float]:
    """Token -> logit after llama.cpp's top-k, top-p, min-p and temperature samplers."""
    import llama_cpp as lc

    n = len(logits)
    arr = (lc.llama_token_data * n)(*[lc.llama_token_data(i, float(v), 0.0) for i, v in enumerate(logits)])
    cur = lc.llama_token_data_array(arr, n, -1, False)
    chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
    for smpl in (lc.llama_sampler_init_top_k(top_k), lc.llama_sampler_init_top_p(top_p, 1),
                 lc.llama_sampler_init_min_p(min_p, 1), lc.llama_sampler_init_temp(temp)):
        lc.llama_sampler_chain_add(chain, smpl)
    try:
        lc.llama_sampler_apply(chain, ctypes.byref(cur))
        return {int(arr[i].id): float(arr[i].logit) for i in range(cur.size)}
    finally:
        lc.llama_sampler_free(chain)


@pytest.mark.parametrize("top_k,top_p,min_p,temp", SETTINGS)
def test_warp_matches_llama_cpp_sampler_chain(top_k, top_p, min_p, temp):
    rng = np.random.default_rng(11)
    for _ in range(10):
        logits = (rng.standard_normal(500) * rng.uniform(0.5, 4.0)).astype(np.float32)
        survivors = llama_cpp_chain(logits, top_k, top_p, min_p, temp)
        got = warp(logits, SamplingConfig(temp, top_k, top_p, min_p))
        assert set(np.flatnonzero(got)) == set(survivors), "a different set of tokens survives the cuts"
        ids = np.array(sorted(survivors))
        z = np.array([survivors[i] for i in ids], dtype=np.float64)
        want = np.exp(z - z.max())
        np.testing.assert_allclose(got[ids], want / want.sum(), rtol=1e-5)


def test_pick_and_sample():
    logits = np.array([0.0, 3.0, 1.0], dtype=np.float32)
    assert pick(logits, SamplingConfig(temp=0.0), np.random.default_rng(0)) == 1
    rng = np.random.default_rng(0)
    draws = [sample(np.array([0.2, 0.0, 0.8]), rng) for _ in range(4000)]
    assert 1 not in draws
    assert abs(draws.count(2) / 4000 - 0.8) < 0.03
    assert sample(np.zeros(3), rng) == 0  # all-zero: the argmax, never an index past the end


@pytest.mark.parametrize("kwargs,needle", [
    ({"temp": -0.1}, "temperature"), ({"temp": float("nan")}, "temperature"), ({"temp": 2.5}, "temperature"),
    ({"top_k": -3}, "top_k"), ({"top_k": 2.5}, "top_k"), ({"top_p": 2.0}, "top_p"), ({"top_p": 0.0}, "top_p"),
    ({"min_p": -0.1}, "min_p"), ({"min_p": 1.5}, "min_p"), ({"seed": -2}, "seed"), ({"seed": 1.5}, "seed"),
    ({"seed": True}, "seed"),
])
def test_bad_settings_are_refused(kwargs, needle):
    with pytest.raises(SamplingError, match=needle):
        make_sampling(**kwargs)


def test_seed_minus_one_means_random():
    assert make_sampling(temp=0.8, seed=-1).seed is None
    assert make_sampling(temp=0.8, seed=0).seed == 0
    assert make_sampling(temp=0.8, top_k=0, top_p=1, min_p=0).top_k == 0
