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
    assert d.propose([1, 2, 3, 77], b).tokens == []  # 77 was never seen: nothing to draft
    # the same sequence, grown by the tokens committed since: [1, 2] was seen, followed by 3, 77
    draft = d.propose([1, 2, 3, 77, 1, 2], b)
    assert draft.tokens[:2] == [3, 77] and draft.is_chain


def test_cost_model_sizes_drafts_by_cost():
    cpu = CostModel(KS, tuple(0.005 * (1 + 0.35 * (k - 1)) for k in KS))  # t(8) ~ 3.5 t(1)
    sure = [0.95 ** i for i in range(1, 17)]
    unsure = [0.2 ** i for i in range(1, 17)]
    assert cpu.best_size(sure) >= 3
    assert cpu.best_size(unsure) == 0  # never slower than plain
    assert flat().best_size(unsure) >= 1  # on a GPU-like curve even weak drafts pay
    assert cpu.t(7) > cpu.t(6) and cpu.t(64) > cpu.t(32)


def test_attention_cost_has_a_per_token_intercept():
    """Past n0 cached tokens a decode of k rows pays (attn0 + attn * k) per token: one row alone
    pays more per token than each row of a batch (measured here: 4.0-4.5 us against 3 us)."""
    ts = tuple(0.009 + 0.0017 * (k - 1) for k in KS)
    cm = CostModel(KS, ts, 3e-6, 32, attn0=1.2e-6)
    assert abs(cm.predict(1, 932) - (ts[0] + 900 * 4.2e-6)) < 1e-12
    assert abs(cm.predict(8, 932) - (cm.predict(8, 0) + 900 * (1.2e-6 + 8 * 3e-6))) < 1e-12
    back = CostModel.from_dict(cm.to_dict())
    assert back.attn0 == cm.attn0 and back.attn == cm.attn
    old = {k: v for k, v in cm.to_dict().items() if k != "attn0_us_per_token"}  # a record from before
    assert CostModel.from_dict(old).attn0 == 0.0
