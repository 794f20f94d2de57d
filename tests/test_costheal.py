"""A cost curve measured on a busy machine heals: what the online correction learns is written
back for the next process, and a curve whose corrections stay far from 1 is measured again."""

import json
import math
import os
import subprocess
import sys

import pytest

from edgespec.costmodel import FAR, KS, MIN_EVIDENCE, CostModel
from edgespec.models import cache_root

from conftest import PROMPTS

# a long prompt (~900 tokens), so each decode's attention term is a large part of its cost
LONG = PROMPTS[4]


def _curve(scale_k: float = 1.0, scale_attn: float = 1.0) -> CostModel:
    """A 2-core-CPU-like curve (t(8) ~ 3.5 t(1)), every k >= 2 and the attention term scaled."""
    ts = tuple(0.01 * (1 + 0.35 * (k - 1)) * (scale_k if k >= 2 else 1.0) for k in KS)
    return CostModel(KS, ts, attn=2e-7 * scale_attn, n0=32, attn0=4e-6 * scale_attn)


def test_online_state_round_trips_and_far_off_needs_evidence():
    truth, poisoned = _curve(), _curve(2.5, 10.0)
    for i in range(MIN_EVIDENCE - 1):
        n_past = 100 + 20 * i
        poisoned.observe(1, n_past, truth.predict(1, n_past))
        poisoned.observe(4, n_past, truth.predict(4, n_past))
    assert poisoned.far_off() == ""  # not yet enough decodes to judge
    poisoned.observe(1, 600, truth.predict(1, 600))
    poisoned.observe(4, 600, truth.predict(4, 600))
    why = poisoned.far_off()
    assert "decodes ran" in why and poisoned.ratio[0] < 1 / FAR
    # written back and read by the next process: it starts from what was learned
    nxt = _curve(2.5, 10.0)
    nxt.restore_online(json.loads(json.dumps(poisoned.online_state())))
    assert nxt.ratio == poisoned.ratio and nxt.n_obs == poisoned.n_obs and nxt.far_off() == why
    assert abs(nxt.t(4, 300) - poisoned.t(4, 300)) < 1e-12
    nxt.restore_online({"ratio": "garbage"})  # an unreadable record changes nothing
    assert nxt.ratio == poisoned.ratio
    # a right curve under the same decodes holds
    right = _curve()
    for i in range(3 * MIN_EVIDENCE):
        right.observe(1, 100 + 10 * i, truth.predict(1, 100 + 10 * i) * 1.05)
    assert right.far_off() == ""


def test_a_wrong_attention_term_is_found_even_where_the_level_holds():
    """Attention 3x too dear with the level 1.6x too cheap: short and long contexts' decodes
    average out near the curve, but they disagree with each other."""
    truth = _curve()
    wrong = CostModel(KS, tuple(t * 0.75 for t in truth.ts), attn=truth.attn * 3, n0=32, attn0=truth.attn0 * 3)
    for i in range(MIN_EVIDENCE):
        for n_past in (40, 2000):
            wrong.observe(1, n_past, truth.predict(1, n_past))
    assert "attention term is off" in wrong.far_off()
    assert "CPU" in (lambda c: (setattr(c, "share", 0.5), c.far_off())[1])(_curve())  # a disturbed measurement


def _run(env, n, prompt=LONG):
    cmd = [sys.executable, "-m", "edgespec", "run", "-m", "smollm2-135m-instruct:q4_0", "-t", "1", "-c", "2048",
           "--json", "--spec", "lookahead", "-n", str(n), "-p", prompt]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


PS = (0.99, 0.95, 0.9, 0.8)  # drafts' per-token acceptance: path confidences p, p^2, ...


def _sizes(cm: CostModel) -> list[int]:
    """Drafting sizes this curve picks: geometric path confidences, at a long context."""
    return [cm.best_size([p ** i for i in range(1, 25)], n_past=600) for p in PS]


def _rate(cm: CostModel, p: float, n: int) -> float:
    """Expected tokens per second of a step that verifies n drafted nodes, on `cm`."""
    return (1 + sum(p ** i for i in range(1, n + 1))) / cm.t(1 + n, 600)


@pytest.mark.slow
def test_a_poisoned_curve_heals_within_two_runs(tmp_path):
    """Each `edgespec run` a process of its own, as users run it. Run 1 measures the curve; it is
    then poisoned as a busy machine leaves it (every k >= 2 2.5x too dear, attention 10x). Run 2
    generates with it and writes back what its online correction learned; run 3 loads it, finds
    it far off and measures it again before generating: its drafting sizes are those of a clean
    curve again."""
    cache = tmp_path / "cache"
    cache.mkdir()
    os.symlink(cache_root() / "models", cache / "models")
    env = {**os.environ, "EDGESPEC_CACHE": str(cache)}
    costs = cache / "costs.json"
    _run(env, 1)
    (key, clean_rec), = json.loads(costs.read_text()).items()
    clean = CostModel.from_dict(clean_rec)
    poisoned = dict(clean_rec, ms=[ms * (2.5 if k >= 2 else 1.0) for k, ms in zip(clean_rec["k"], clean_rec["ms"])],
                    attn_us_per_row_per_token=clean_rec["attn_us_per_row_per_token"] * 10,
                    attn0_us_per_token=clean_rec["attn0_us_per_token"] * 10, cpu_share=1.0, online={})
    costs.write_text(json.dumps({key: poisoned}))
    bad = CostModel.from_dict(poisoned)

    _run(env, 128)  # run 2: generates on the poisoned curve, learns, writes back
    rec = json.loads(costs.read_text())[key]
    assert rec["ms"] == poisoned["ms"]  # not measured again during a generation
    learned = CostModel.from_dict(rec)
    learned.restore_online(rec["online"])
    assert sum(learned.n_obs) >= MIN_EVIDENCE and learned.far_off(), rec["online"]

    out = _run(env, 8)  # run 3: measured again at load, before generating
    rec = json.loads(costs.read_text())[key]
    healed = CostModel.from_dict(rec)
    assert out["stats"]["cost_ms"]["ms"] == rec["ms"] and rec["ms"] != poisoned["ms"] and rec["measured_at"] > clean_rec["measured_at"]
    for n_past in (0, 600):  # the shape of a clean curve, within what noise on a shared machine moves
        for k in (2, 4, 8, 16):
            h, c = (m.t(k, n_past) / m.t(1, n_past) for m in (healed, clean))
            assert abs(math.log(h / c)) < math.log(1.5), (n_past, k, h, c)
    h, c, b = (m.attn0 + 8 * m.attn for m in (healed, clean, bad))  # attention of 8 rows per cached token
    assert abs(math.log(h / c)) < math.log(2) < abs(math.log(b / c)), (h, c, b)
    # the sizes the healed curve drafts pay as the clean curve's would (sizes jump at the margins:
    # 0 and 3 nodes can be worth the same), priced on the clean curve
    for p, h, c in zip(PS, _sizes(healed), _sizes(clean)):
        assert _rate(clean, p, h) >= 0.9 * _rate(clean, p, c), (p, h, c, _sizes(bad))
