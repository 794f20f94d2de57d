from edgespec.costmodel import KS, CostModel, flat
from edgespec.drafters.base import Budget, sized
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
    assert sized(d.propose([1, 2, 3, 77], b), b).tokens == []  # 77 was never seen: nothing to draft
    # the same sequence, grown by the tokens committed since: [1, 2] was seen, followed by 3, 77
    draft = sized(d.propose([1, 2, 3, 77, 1, 2], b), b)
    assert draft.tokens[:2] == [3, 77] and draft.is_chain


def test_the_scheduler_sizes_a_drafters_candidates():
    """A drafter proposes candidates with their path chances; the sizing step keeps as many as
    pay (at least n_min), multi takes all of them, and a Draft (a chain sized while drafted)
    passes whole."""
    from dataclasses import replace

    from edgespec.draft import Draft
    from edgespec.drafters.base import Candidates, every

    d = NgramDrafter()
    d.begin([1, 2, 3, 4, 5, 6, 7, 8])
    steep = CostModel(KS, tuple(0.01 * k for k in KS), online=False)  # k rows cost k plain steps
    b = Budget(16, 1, 1, steep, SamplingConfig())
    cands = d.propose([1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3], b)
    assert isinstance(cands, Candidates) and len(cands.path) == 8  # 4 .. 8, 1, 2, 3
    assert sized(cands, b).tokens == []  # nothing pays on this curve
    assert sized(cands, replace(b, n_min=2)).tokens == [4, 5]  # --spec-draft-n-min
    assert sized(cands, replace(b, cost=flat())).tokens == [4, 5, 6, 7, 8, 1, 2, 3]
    draft, path = every(cands)
    assert draft.tokens == [4, 5, 6, 7, 8, 1, 2, 3] and list(path) == list(cands.path)
    chain = Draft.chain([9, 9, 9])
    assert sized(chain, b) is chain and every(chain) == (chain, [])


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


def test_cost_model_learns_the_curves_shape_per_row_count():
    """Decodes of 2 rows keep running 30% over the curve while 4 rows run on it: the one
    correction for many rows follows the common size, the per-count shape fixes the other, and
    a one-token draft is priced at what it costs. Batch mode's decodes (a prediction of their
    own) leave the shape alone."""
    ts = tuple(0.01 + 0.004 * (k - 1) for k in KS)
    cm = CostModel(KS, ts)
    for _ in range(60):
        cm.observe(4, 100, cm.predict(4, 100))
        cm.observe(1, 100, cm.predict(1, 100))
        cm.observe(2, 100, 1.3 * cm.predict(2, 100))
    assert abs(cm.t(2, 100) / cm.predict(2, 100) - 1.3) < 0.05
    assert abs(cm.t(4, 100) / cm.predict(4, 100) - 1.0) < 0.05
    assert abs(cm.t(3, 100) / cm.predict(3, 100) - cm.ratio[1]) < 1e-12  # never seen: the common correction
    before = list(cm.shape)
    cm.observe(3, 0, 0.05, predicted=0.01)  # a multi-sequence decode
    assert cm.shape == before
    # a draft whose one token is accepted 55% of the time: pays on the curve (2 rows = 1.4x
    # one), not at the 2-row cost learned here (1.82x)
    assert CostModel(KS, ts).best_size([0.55]) == 1 and cm.best_size([0.55], n_past=100) == 0


def test_best_size_is_the_plain_scan_of_every_size():
    """best_size inlines t(k) for speed: it must pick what scanning t(k) picks."""
    import random

    rng = random.Random(3)
    cm = CostModel(KS, tuple(0.01 * (1 + 0.4 * k ** 0.9) for k in KS), 1e-7, 32, attn0=5e-8)
    for _ in range(300):
        k = rng.choice([1, 2, 3, 5, 9, 40])
        cm.observe(k, rng.randrange(900), cm.predict(k, 100) * rng.uniform(0.8, 1.6))

    def scan(probs, fixed, per_node, n_past, margin=0.02):
        best_n, best = 0, (1.0 / cm.t(fixed, n_past)) * (1 + margin)
        gain = 1.0
        for n, p in enumerate(probs, start=1):
            gain += p
            rate = gain / (cm.t(fixed + n, n_past) + per_node * n)
            if rate > best:
                best_n, best = n, rate
        return best_n

    for _ in range(3000):
        probs = sorted((rng.random() for _ in range(rng.randrange(70))), reverse=True)
        fixed, per_node, n_past = rng.randint(1, 3), rng.choice([0.0, 1e-4]), rng.randrange(3000)
        assert cm.best_size(probs, fixed, per_node, n_past=n_past) == scan(probs, fixed, per_node, n_past)


def test_a_reply_behind_plain_drafts_only_what_covers_its_risk():
    """`slack`, the plain steps a reply may still lose: a bet that pays on average by a hair goes
    while it fits, and past it only a draft whose expected gain also covers the excess; on a flat
    curve nothing is at risk."""
    from edgespec.costmodel import LOSS_SHARE, loss_slack

    cpu = CostModel(KS, tuple(0.01 * (1 + 0.12 * (k - 1)) for k in KS), online=False)  # 2 rows: 1.12x
    assert cpu.best_size([0.2]) == 1  # 1.2 tokens for 1.12 steps
    assert cpu.best_size([0.2], slack=0.12) == 1  # its loss (0.12 steps) fits
    assert cpu.best_size([0.2], slack=0.0) == 0  # expected gain 0.08 < 0.8 * 0.12 beyond the slack
    assert cpu.best_size([0.3], slack=0.0) == 1  # 0.18 covers 0.7 * 0.12
    # a likely copy risks little: 1.46 expected covers 0.1 * (0.24 + 2) behind, not 0.1 * (0.24 + 20)
    assert cpu.best_size([0.9, 0.8], slack=-2.0) == 2 and cpu.best_size([0.9, 0.8], slack=-20.0) == 0
    assert cpu.best_size([0.2], slack=0.0, n_past=0) == 0 and flat().best_size([0.2], slack=-5.0) == 1
    assert abs(cpu.step_loss(2) - 0.12) < 1e-9 and abs(cpu.step_loss(3, 2) - 0.12 / 1.12) < 1e-9
    assert loss_slack(-1.0, 100) == -1.0 + LOSS_SHARE * 100
    b = Budget(16, 1, 1, cpu, SamplingConfig(), slack=0.0)
    assert not b.may_probe() and Budget(16, 1, 1, cpu, SamplingConfig(), slack=0.2).may_probe()
