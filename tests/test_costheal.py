"""A cost curve measured on a busy machine heals: what the online correction learns is written
back for the next process, and a curve whose corrections stay far from 1 is measured again."""

import json
import math
import os
import subprocess
import sys

import pytest

from edgespec.costcache import HEAL_RETRY_S, due
from edgespec.costmodel import EXPLORE_EVERY, EXPLORE_NODES, FAR, KS, MIN_EVIDENCE, QUIET_SHARE, CostModel
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


def test_many_rows_take_the_one_row_correction_as_their_prior():
    """A curve 3x too dear (measured busy): one-row decodes teach it so; before any many-row
    decode, many-row predictions follow that correction, so a draft that pays on the true costs
    pays on the corrected curve too. Many-row evidence then takes over."""
    truth = _curve()
    dear = CostModel(KS, tuple(3 * t for t in truth.ts), truth.attn * 3, 32, attn0=truth.attn0 * 3)
    probs = [0.9 ** i for i in range(1, 9)]
    assert truth.best_size(probs, n_past=200) > 0
    for i in range(60):
        dear.observe(1, 200 + i, truth.predict(1, 200 + i))
    assert dear.ratio[0] < 0.4 and dear.n_obs[1] == 0
    # four rows predicted within 25% of their cost (3x without the prior), so the draft pays
    assert abs(math.log(dear.t(4, 200) / truth.t(4, 200))) < math.log(1.25)
    assert dear.best_size(probs, n_past=200) > 0
    # evidence: four-row decodes that cost what the curve says, one-row ones still a third
    for i in range(200):
        dear.observe(4, 200, dear.predict(4, 200))
    assert abs(dear.many - 1.0) < 0.05
    # the prior survives a restart (written back with the rest of the online state)
    nxt = CostModel(KS, dear.ts, dear.attn, 32, attn0=dear.attn0)
    nxt.restore_online(json.loads(json.dumps(dear.online_state())))
    assert nxt.many == dear.many and nxt.t(4, 200) == dear.t(4, 200)


def test_sizing_explores_until_many_row_evidence_exists():
    """Where nothing is predicted to pay, one node is drafted once every EXPLORE_EVERY plain
    steps (so that the many-row prediction meets evidence), and never again once
    MIN_EVIDENCE many-row decodes are seen; never on a curve that is not corrected online."""
    cm = _curve(4.0)  # many rows 4x dearer: nothing pays
    probs = [0.5, 0.25, 0.12]
    steps, explored = 0, []
    while cm.n_obs[1] < MIN_EVIDENCE:
        n = cm.best_size(probs)
        assert cm.best_size(probs) == n  # the same answer within a step (a drafter may ask twice)
        if n:
            explored.append(steps)
            assert n == EXPLORE_NODES
            cm.observe(1 + n, 0, cm.predict(1 + n))
        else:
            cm.observe(1, 0, cm.predict(1))
        steps += 1
    gaps = [b - a for a, b in zip(explored, explored[1:])]
    assert len(explored) == MIN_EVIDENCE and min(gaps) == EXPLORE_EVERY + 1, gaps
    for _ in range(5 * EXPLORE_EVERY):
        assert cm.best_size(probs) == 0
        cm.observe(1, 0, cm.predict(1))
    assert cm.best_size([]) == 0
    fixed = CostModel(KS, cm.ts, online=False)
    fixed._plain_run = 10 * EXPLORE_EVERY
    assert fixed.best_size(probs) == 0


def test_a_busy_curve_is_due_when_the_machine_is_quiet():
    """Measured busy: due as soon as a check finds the machine quiet, not before (unless it
    stays busy for HEAL_RETRY_S, then all the same); a quiet curve that holds is never due."""
    import time

    busy = _curve()
    busy.share, busy.measured_at = QUIET_SHARE / 2, time.time()
    checks = []

    def quiet_now(answer):
        return lambda: checks.append(answer) or answer

    assert due(busy, quiet_now(False)) == "" and checks == [False]
    assert "CPU" in due(busy, quiet_now(True))
    busy.measured_at = time.time() - HEAL_RETRY_S - 1
    assert "CPU" in due(busy, quiet_now(False))
    fine = _curve()
    fine.share, fine.measured_at = 1.0, time.time()
    checks.clear()
    assert due(fine, quiet_now(True)) == "" and checks == []  # no check where nothing is due


def test_the_first_measurement_reports_its_progress_and_the_probe(smol):
    """One pass measures the curve and the probe: progress goes out as logging records (seconds
    done of an estimated total, what is measured), the last one complete; the curve covers every
    size, and the probe reads as the engine's own (with the batch-invariant kernels: SmolLM2 Q4_0
    bit-exact at every probed row, at both context lengths)."""
    import logging

    from edgespec.costmeasure import PROBE_ROWS, measure
    from edgespec.kv import KVSeq
    from edgespec.llama import Context, ContextConfig

    lg = logging.getLogger("edgespec.costmeasure")
    seen: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = seen.append
    lg.addHandler(handler)
    level = lg.level
    lg.setLevel(logging.INFO)
    ctx = Context(smol.target, ContextConfig(1024, 64, 2, 1, "q8_0/f16"))
    try:
        cm = measure(ctx, KVSeq(ctx), report=True)
    finally:
        ctx.close()
        lg.removeHandler(handler)
        lg.setLevel(level)
    # the probe reads as the engine's own did when it loaded (same kernels, same K/V types); with
    # edgespec's batch-invariant kernels installed that is every probed row, exact
    from edgespec import kernels

    reading = (smol.cost.max_exact_rows, smol.cost.batch_logit_diff)
    assert cm.ks == KS and (cm.max_exact_rows, cm.batch_logit_diff) == reading
    if kernels.batch_invariant():
        assert reading == (PROBE_ROWS[-1], 0.0)
    # the attention term is measured on a quiet machine only (a busy one leaves it at 0, and its
    # share then stays below QUIET_SHARE): whether this one was quiet is not the test's to choose
    assert cm.share is not None and (cm.attn0 + 8 * cm.attn > 0 or cm.share < QUIET_SHARE)
    bars = [r for r in seen if getattr(r, "total", None) is not None]
    assert len(bars) >= 3 and all(r.progress and r.task == "cost" for r in bars)
    done = [r.done for r in bars]
    assert done == sorted(done) and all(r.total >= r.done for r in bars)
    assert bars[-1].done == bars[-1].total and "measured in" in bars[-1].getMessage()
    assert any("rows" in r.getMessage() for r in bars[:-1])


def _run(env, n, prompt=LONG):
    cmd = [sys.executable, "-m", "edgespec", "run", "-m", "smollm2-135m-instruct:q4_0", "-t", "2", "-c", "2048",
           "--json", "--spec", "lookahead", "-n", str(n), "-p", prompt]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


# Two quiet measurements of SmolLM2's curve on a shared 2-core machine disagree on its shape by up
# to 1.55x: 8 rows at n_past 0 read 2.7-3.5x one row over six `edgespec run`s in a row, 3.1-4.8x over
# three `doctor --remeasure`s, and CI's quiet run 4.25x against its healed one's 2.76x (a slow spell
# slows one-row decodes more than eight-row ones). So the poison is 4x and a healed curve's shape is
# held to within 2x of the clean one's: nearer to it than to the poisoned, by a margin noise keeps.
POISON, SHAPE_NOISE = 4.0, 2.0
# The attention term (a small difference of two times) moves further: six quiet runs in a row here
# read 8 rows' term within 1.14x of each other, but a healed curve in the full suite read it 2.15x
# the clean one's. Poisoned 10x, a healed term is held to within 3x (nearer the clean than the poison).
ATTN_POISON, ATTN_NOISE = 10.0, 3.0

PS = (0.99, 0.95, 0.9, 0.8)  # drafts' per-token acceptance: path confidences p, p^2, ...


def _sizes(cm: CostModel) -> list[int]:
    """Drafting sizes this curve picks: geometric path confidences, at a long context."""
    return [cm.best_size([p ** i for i in range(1, 25)], n_past=600) for p in PS]


def _rate(cm: CostModel, p: float, n: int) -> float:
    """Expected tokens per second of a step that verifies n drafted nodes, on `cm`."""
    return (1 + sum(p ** i for i in range(1, n + 1))) / cm.t(1 + n, 600)


def _stats(env, prompt=LONG, n=96):
    """A lookahead run's stats on a copy-heavy prompt (the answer repeats lines of it)."""
    cmd = [sys.executable, "-m", "edgespec", "run", "-m", "smollm2-135m-instruct:q4_0", "-t", "2", "--json",
           "--spec", "lookahead", "-n", str(n), "-p", prompt]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["stats"]


def _cache(tmp_path, name):
    cache = tmp_path / name
    cache.mkdir()
    os.symlink(cache_root() / "models", cache / "models")
    return {**os.environ, "EDGESPEC_CACHE": str(cache)}, cache / "costs.json"


@pytest.fixture(scope="module")
def quiet_run(tmp_path_factory):
    """Run 1 of both tests below: a lookahead `edgespec run` on the copy-heavy prompt in an empty
    cache, its curve measured at load on the quiet machine: (its stats, the curve's key, the
    curve's record)."""
    env, costs = _cache(tmp_path_factory.mktemp("quiet"), "cache")
    stats = _stats(env)
    (key, rec), = json.loads(costs.read_text()).items()
    return stats, key, rec


@pytest.mark.slow
def test_a_poisoned_curve_heals_within_two_runs(tmp_path, quiet_run):
    """Each `edgespec run` a process of its own, as users run it. The curve a quiet run measured
    (run 1, `quiet_run`) is poisoned as a busy machine leaves it (every k >= 2 4x too dear,
    attention 10x). Run 2 generates with it and writes back what its online correction learned;
    run 3 loads it, finds it far off and measures it again before generating: its drafting sizes
    are those of a clean curve again."""
    env, costs = _cache(tmp_path, "cache")
    _, key, clean_rec = quiet_run
    clean = CostModel.from_dict(clean_rec)
    poisoned = dict(clean_rec, ms=[ms * (POISON if k >= 2 else 1.0) for k, ms in zip(clean_rec["k"], clean_rec["ms"])],
                    attn_us_per_row_per_token=clean_rec["attn_us_per_row_per_token"] * ATTN_POISON,
                    attn0_us_per_token=clean_rec["attn0_us_per_token"] * ATTN_POISON, cpu_share=1.0, online={})
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
            assert abs(math.log(h / c)) < math.log(SHAPE_NOISE) < math.log(POISON), (n_past, k, h, c, clean_rec["cpu_share"])
    h, c, b = (m.attn0 + 8 * m.attn for m in (healed, clean, bad))  # attention of 8 rows per cached token
    assert abs(math.log(h / c)) < math.log(ATTN_NOISE) < 0.5 * abs(math.log(b / c)), (h, c, b)
    # the sizes the healed curve drafts pay as the clean curve's would (sizes jump at the margins:
    # 0 and 3 nodes can be worth the same), priced on the clean curve
    for p, h, c in zip(PS, _sizes(healed), _sizes(clean)):
        assert _rate(clean, p, h) >= 0.9 * _rate(clean, p, c), (p, h, c, _sizes(bad))


@pytest.mark.slow
def test_a_curve_measured_busy_drafts_from_the_first_quiet_run(tmp_path, quiet_run):
    """Issue 46: the curve measured while busy loops hold every core; the loops stopped; then
    each `edgespec run` (a process of its own) on a copy-heavy prompt drafts, from the first
    one (its curve measured again at load: the machine is quiet now), and gets as many tokens
    from its drafts as a run on a curve measured quiet, within 10%."""
    busy_env, costs = _cache(tmp_path, "busy")
    loops = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(max(2, len(os.sched_getaffinity(0))))]
    # OpenMP's threads wait for each other at every op by spinning: with the loops holding the
    # cores, a thread spins while the one it waits for is descheduled, and the doctor took 295 s
    # on 2 cores in one run of two (11.7 s with OMP_WAIT_POLICY=PASSIVE, the waits asleep). The
    # measurement is busy either way (its threads get a low share of the CPU), which is what this
    # test needs; the runs after it keep the default policy.
    busy_doctor_env = {**busy_env, "OMP_WAIT_POLICY": "PASSIVE"}
    try:
        r = subprocess.run([sys.executable, "-m", "edgespec", "doctor", "-m", "smollm2-135m-instruct:q4_0", "-t", "2",
                            "--json"], capture_output=True, text=True, env=busy_doctor_env, timeout=600)
    finally:
        for p in loops:
            p.kill()
            p.wait()
    assert r.returncode == 0, r.stderr
    (busy_rec,) = json.loads(costs.read_text()).values()
    if busy_rec["cpu_share"] >= QUIET_SHARE:
        pytest.skip(f"busy loops left the measurement {busy_rec['cpu_share']:.0%} of the CPU (more cores than loops)")
    quiet = quiet_run[0]
    assert quiet["n_drafted"] > 0
    runs = [_stats(busy_env) for _ in range(2)]
    (healed,) = json.loads(costs.read_text()).values()
    assert healed["cpu_share"] >= QUIET_SHARE and healed["measured_at"] > busy_rec["measured_at"]
    for st in runs:
        assert st["n_generated"] == quiet["n_generated"]
        assert st["n_drafted"] > 0 and st["n_accept"] > 0, st
        # the same greedy output with about as many tokens from drafts as on a quiet curve, in
        # about as few target decodes: run to run, quiet curves' shapes move (above, SHAPE_NOISE)
        # and sizes at the margins with them (six quiet runs in a row here kept 50-53 draft
        # tokens in 43-46 steps, CI's quiet run 61)
        assert st["n_accept"] >= 0.8 * quiet["n_accept"], (st, quiet)
        assert st["n_steps"] <= 1.35 * quiet["n_steps"], (st, quiet)
