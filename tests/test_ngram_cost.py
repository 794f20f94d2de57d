from edgespec.costmodel import KS, CostModel, flat
from edgespec.drafters.base import Budget
from edgespec.drafters.ngram import NgramDrafter, NgramIndex
from edgespec.sampling import SamplingConfig


def test_ngram_index_prefers_longest_latest_match():
    idx = NgramIndex(1, 3)
    toks = [1, 2, 3, 4, 9, 2, 3, 5, 1, 2, 3]
    n, cont = idx.lookup(toks, 4)
    assert n == 3 and cont == [4, 9, 2, 3]
    n, cont = idx.lookup([8, 2, 3], 2)
    assert n == 2


def test_ngram_no_match_drafts_nothing():
    d = NgramDrafter()
    d.begin([1, 2, 3])
    b = Budget(16, 8, 1, flat(), SamplingConfig())
    assert d.propose([1, 2, 3, 77], b).tokens == []
    draft = d.propose([1, 2, 3, 1, 2], b)
    assert draft.tokens[:1] == [3] and draft.is_chain


def test_cost_model_sizes_drafts_by_cost():
    cpu = CostModel(KS, tuple(0.005 * (1 + 0.35 * (k - 1)) for k in KS))  # t(8) ~ 3.5 t(1)
    sure = [0.95 ** i for i in range(1, 17)]
    unsure = [0.2 ** i for i in range(1, 17)]
    assert cpu.best_size(sure) >= 3
    assert cpu.best_size(unsure) == 0  # never slower than plain
    assert flat().best_size(unsure) >= 1  # on a GPU-like curve even weak drafts pay
    assert cpu.t(7) > cpu.t(6) and cpu.t(64) > cpu.t(32)


def test_online_correction_learns_weights_and_attention_apart():
    """Decodes that cost 1.2x the load curve's weights part and 0.65x its attention part: the
    correction finds both from plain steps at growing context and a few multi-row steps."""
    import random

    cm = CostModel(KS, tuple(0.004 + 0.003 * k for k in KS), 10e-6, 32, 32)

    def true(k, n):
        return (1.2 if k <= 1 else 1.1) * cm.predict(k, 0) + 0.65 * cm.attn * k * max(0, n - 32)

    rnd = random.Random(1)
    n = 300
    for _ in range(300):
        k = 1 if rnd.random() < 0.8 else rnd.choice([2, 3, 4, 6])
        cm.observe(k, n, true(k, n) * rnd.uniform(0.85, 1.15))
        n = n + k if n < 1200 else 300
    for k, n in ((1, 300), (4, 900), (8, 900)):
        assert abs(cm.t(k, n) / true(k, n) - 1) < 0.06
    assert abs(cm.predict(4, 900) / true(4, 900) - 1) > 0.2  # the uncorrected curve was far off
    cm.observe(1, 100, 100.0)  # one outlier (a stall elsewhere) moves it only boundedly
    assert cm.t(1, 300) < 3.5 * true(1, 300)
