"""`edgespec bench` on a two-prompt suite with the real embedded model."""

import json

import pytest

from edgespec.frontends import bench, cli
from edgespec.frontends.bench import run as bench_run
from edgespec.suites import load_suite, parse_jsonl
from edgespec.errors import EdgespecError

SUITE = [
    {"id": "copy", "category": "quote", "max_tokens": 40,
     "messages": [{"role": "user", "content": "Repeat exactly: red green blue, red green blue, red green blue."}]},
    {"id": "chat", "category": "chat", "max_tokens": 40, "prompt": "The three primary colours are"},
]


@pytest.fixture()
def suite_file(tmp_path):
    f = tmp_path / "suite.jsonl"
    f.write_text("".join(json.dumps(x) + "\n" for x in SUITE))
    return f


def test_report_fields(tmp_path, suite_file, capsys):
    out = tmp_path / "out"
    rc = cli.main(["bench", "-m", "smollm2-135m-instruct:q4_0", "-t", "2", "--suite", str(suite_file),
                   "--methods", "none,ngram,lookahead", "-n", "40", "--out", str(out)])
    assert rc == 0
    table = capsys.readouterr().out
    assert "| lookahead | all | 2 |" in table and "Oracle ceiling" in table
    rep = json.loads((out / "report.json").read_text())
    assert rep["mismatches"] == []
    assert {r["method"] for r in rep["records"]} == {"none", "ngram", "lookahead"}
    assert len(rep["records"]) == 6
    # answers this short run in several interleaved rounds (--min-time, 1 s by default): every
    # method as many as plain decoding, their counts and times summed
    for r in rep["records"]:
        assert r["runs"] == next(x["runs"] for x in rep["records"] if x["method"] == "none" and x["id"] == r["id"])
        assert 1 < r["runs"] <= bench_run.MAX_ROUNDS
        assert r["tokens_per_s"] == pytest.approx((r["n_generated"] - r["runs"]) / r["t_gen"], rel=1e-3)
    rows = {(r["method"], r["category"]): r for r in rep["summary"]}
    assert set(rows) >= {("none", "quote"), ("none", "chat"), ("lookahead", "all"), ("ngram", "quote")}
    # the lookahead row is the geometric mean of its per-prompt ratios against none's same run
    plain = {r["id"]: r["tokens_per_s"] for r in rep["records"] if r["method"] == "none"}
    ratios = [r["tokens_per_s"] / plain[r["id"]] for r in rep["records"] if r["method"] == "lookahead"]
    assert rows[("lookahead", "all")]["speedup"] == pytest.approx(bench.geomean(ratios), abs=1e-3)
    assert rows[("lookahead", "all")]["speedup_min"] == pytest.approx(min(ratios), abs=1e-3)
    for r in rep["summary"]:
        for key in ("tokens_per_s", "speedup", "speedup_min", "speedup_max", "efficiency", "acceptance_rate",
                    "mean_accepted_length", "acceptance_by_position", "draft_share", "verify_share", "all_match"):
            assert key in r
        assert r["all_match"] is True
    c = rep["ceiling"]
    assert (c["draft_len"] == 0) == (c["speedup"] == 1.0) and c["n_past"] > 0
    assert rows[("lookahead", "quote")]["acceptance_rate"] is not None
    assert (out / "report.png").read_bytes()[:4] == b"\x89PNG"
    tc = rep["text_ceiling"]
    assert set(tc["speedup"]) == {"quote", "chat", "all"} and tc["speedup"]["quote"] >= 1.0
    assert set(tc["reached"]) == {"ngram", "lookahead"}
    assert tc["reached"]["lookahead"]["all"] == pytest.approx(
        rows[("lookahead", "all")]["speedup"] / tc["speedup"]["all"], abs=2e-3)
    assert "Text ceiling" in table and "lookahead reached" in table


def test_mismatch_is_flagged(suite_file, monkeypatch, capsys):
    real = bench_run.run_method

    def broken(eng, tokens, n, method, **kw):
        g = real(eng, tokens, n, method, **kw)
        if method == "ngram":  # a deliberately broken method: one token changed
            g.tokens[len(g.tokens) // 2] += 1
        return g

    monkeypatch.setattr(bench_run, "run_method", broken)
    rc = cli.main(["bench", "-m", "smollm2-135m-instruct:q4_0", "-t", "2", "--suite", str(suite_file),
                   "--methods", "none,ngram", "-n", "24", "--min-time", "0"])
    assert rc == 3
    captured = capsys.readouterr()
    assert "**NO**" in captured.out
    assert "differ from plain greedy decoding" in captured.err


def test_rounds_merge_into_one_record():
    """A repeat's rounds (--min-time): counts and times summed, rates from the sums, each run's
    first token (it comes with the prompt) left out of the rate as in one run's."""
    from edgespec.events import Stats

    runs = [Stats(n_generated=15, n_steps=16, t_gen=0.10, finish_reason="stop"),
            Stats(n_generated=15, n_steps=14, t_gen=0.12, n_drafted=3, n_accept=2, finish_reason="stop")]
    rec = bench_run.merge_runs(runs)
    assert rec["runs"] == 2 and rec["n_generated"] == 30 and rec["n_steps"] == 30
    assert rec["tokens_per_s"] == pytest.approx(28 / 0.22, rel=1e-3) and rec["finish_reason"] == "stop"
    theirs = [{"method": "llama.cpp:lookup", "tokens_per_s": 100.0, "n_generated": 10, "same_as_own_plain": True},
              {"method": "llama.cpp:lookup", "tokens_per_s": 50.0, "n_generated": 10, "same_as_own_plain": False}]
    one = bench_run.merge_llama_runs(theirs)
    assert one["tokens_per_s"] == pytest.approx(20 / 0.3, rel=1e-3) and one["runs"] == 2
    assert one["same_as_own_plain"] is False
    assert bench_run.merge_llama_runs(theirs[:1]) == theirs[0]


def test_suite_parsing(tmp_path):
    assert len(load_suite(None)) >= 4
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x"}\n')
    with pytest.raises(EdgespecError, match="needs 'messages' or 'prompt'"):
        load_suite(str(bad))
    assert parse_jsonl('{"prompt": "hi"}\n\n', "t")[0]["category"] == "default"
    assert bench.parse_eval_tps("llama_perf:        eval time =     100.00 ms /    10 runs") == pytest.approx(100.0)
    assert bench.parse_eval_tps("decoded   65 tokens in    0.500 seconds, speed: 130 t/s") == pytest.approx(130.0)
    # wall time as ours is counted: llama-completion's eval time leaves out sampling and the loop
    from edgespec.frontends.bench.llamacpp import parse_gen_tps

    log = ("common_perf_print:    sampling time =       3.18 ms\n"
           "common_perf_print: prompt eval time =      21.92 ms /     6 tokens\n"
           "common_perf_print:        eval time =     119.74 ms /    12 runs\n"
           "common_perf_print:       total time =     146.09 ms /    18 tokens\n")
    assert parse_gen_tps(log) == pytest.approx(12 / 0.12417)
    assert bench.parse_eval_tps(log) == pytest.approx(12 / 0.11974)
    # counted as ours: an answer that ended on its own leaves out the decode yielding only the end token
    assert parse_gen_tps(log + "Hello there. [end of text]\n") == pytest.approx(11 / 0.12417)
    # llama-lookup's count holds the first token and the end token (or runs to -n + 1 tokens)
    dec = "decoded   46 tokens in    0.500 seconds, speed: 92 t/s"
    assert parse_gen_tps(dec, 64) == pytest.approx(44 / 0.5)  # ended on its own: 45 text tokens
    assert parse_gen_tps(dec, 45) == pytest.approx(45 / 0.5)  # ran to the limit: -n + 1 tokens


def test_llama_lookup_is_checked_against_llama_completion():
    """llama-lookup's answer is compared with llama-completion's (both echo the prompt first,
    with special tokens or without), and the report says in how many runs it kept it."""
    from edgespec.frontends.bench.llamacpp import answer_text, same_answer
    from edgespec.frontends.bench.report import render_markdown
    from edgespec.frontends.bench.stats import summarize
    from edgespec.costmodel import flat

    forms = ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "user\nhi\nassistant\n")
    plain = answer_text("user\nhi\nassistant\nHello there, friend.", forms)
    lookup = answer_text("\n\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nHello there, friend.<|im_end|>", forms)
    assert plain == "Hello there, friend." and lookup == plain
    # an answer that ended on its own: each tool marks the end its own way
    assert answer_text("user\nhi\nassistant\nHello. [end of text]\n\n", forms) == "Hello."
    assert answer_text("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nHello.<|im_end|>\n", forms) == "Hello."
    assert answer_text("something else", forms) is None
    assert same_answer(plain, lookup) and same_answer("Hello there", "Hello there, friend.")
    assert not same_answer(plain, "Hello here, friend.")
    assert not same_answer("", plain * 10)  # an empty or cut-off answer is not the same answer
    recs = [{"id": f"p{i}", "category": "c", "method": m, "repeat": 0, "tokens_per_s": 10.0, "match": None,
             **({"same_as_own_plain": i == 0} if m == "llama.cpp:lookup" else {})}
            for i in range(2) for m in ("llama.cpp:completion", "llama.cpp:lookup")]
    report = summarize(recs, ["llama.cpp:lookup", "llama.cpp:completion"], flat(), 100)
    assert report["llama_cpp_lookup_exact"] == {"same": 1, "runs": 2, "differ": ["p1"]}
    assert "llama-lookup kept llama-completion's answer" in render_markdown(report)
    assert "in 1 of 2 runs (another answer on p1)" in render_markdown(report)


def test_external_suites_from_wheels():
    mt = load_suite("mtbench")
    assert len(mt) == 80 and mt[0]["category"].startswith("mtbench-")
    he = load_suite("humaneval", limit=3)
    assert len(he) == 3 and "def " in he[0]["messages"][0]["content"]


def test_oracle_ceiling_on_known_cost_curves():
    from edgespec.costmodel import KS, CostModel, flat

    # verifying k tokens costs more than k times one: no drafter can gain anything
    top, k = bench.ceiling(CostModel(KS, tuple(0.01 * k ** 1.1 for k in KS)), 0)
    assert (top, k) == (1.0, 0)
    # a flat curve: an always-right draft of 31 tokens gives 32 tokens per step
    top, k = bench.ceiling(flat(0.01), 0)
    assert k == 31 and top == pytest.approx(32.0)
    # t(k) = t(1) * (1 + (k - 1) / 4): (k + 1) / (1 + k / 4) grows with k, to 32 / 8.75
    top, k = bench.ceiling(CostModel(KS, tuple(0.01 * (1 + (k - 1) / 4) for k in KS)), 0)
    assert k == 31 and top == pytest.approx(32 / 8.75)
    # the probe's limit caps the draft
    top, k = bench.ceiling(flat(0.01, max_exact_rows=4), 0)
    assert k == 3 and top == pytest.approx(4.0)


def test_ceilings_use_the_curve_as_corrected_over_the_whole_run():
    from edgespec.costmodel import KS, CostModel

    cost = CostModel(KS, tuple(0.01 * (1 + (k - 1) / 4) for k in KS))
    cost.ratio = [1.0, 0.5]  # as the run's last decodes left it: many rows looked cheap
    curve = bench_run.run_curve(cost, [(1.0, 1.0), (1.0, 1.2), (1.0, 0.5)])
    assert curve.ratio == [1.0, pytest.approx(0.9)] and cost.ratio == [1.0, 0.5]
    assert bench.ceiling(curve, 0)[0] == pytest.approx(bench.ceiling(cost, 0)[0] * 0.5 / 0.9)
    assert bench_run.run_curve(cost, []) is cost


def test_text_ceiling_counts_only_what_the_text_holds():
    from edgespec.costmodel import KS, CostModel, flat

    cost = flat(0.01)  # verifying k rows costs one: a right draft of any length is free
    prompt = list(range(100, 140))
    # an output that copies the prompt: after the first token every later one is draftable
    plain, best = bench.text_ceiling(cost, prompt, prompt[:30])
    # 29 tokens after the first: a 23-token draft (the rest of a 24-token branch) and its bonus
    # token, then the last 5 in one more step
    assert plain == pytest.approx(29 * 0.01) and best == pytest.approx(0.02)
    # an output found nowhere before it: nothing to draft, the ceiling is plain decoding
    plain, best = bench.text_ceiling(cost, prompt, list(range(500, 530)))
    assert best == pytest.approx(plain)
    # a copy of 10 tokens inside new text: one step for the copy on a flat curve
    out = list(range(500, 510)) + prompt[5:15] + list(range(600, 610))
    plain, best = bench.text_ceiling(cost, prompt, out)
    assert plain == pytest.approx(29 * 0.01)
    # position 10 (prompt[5]) follows 509, new: plain; then prompt[6..14] (9 tokens) in one draft
    assert best == pytest.approx((29 - 9) * 0.01)
    # where k rows cost k steps nothing pays, even on a copy
    linear = CostModel(KS, tuple(0.01 * k for k in KS), online=False)
    plain, best = bench.text_ceiling(linear, prompt, prompt[:30])
    assert best == pytest.approx(plain)
    # at most `limit` rows per verification
    plain, best = bench.text_ceiling(cost, prompt, prompt[:30], limit=4)
    assert best == pytest.approx(8 * 0.01)  # 3 drafted and the bonus token per step: 29 in 8 steps


def test_speedup_intervals_and_the_comparison_with_llama_cpp():
    from edgespec.costmodel import flat
    from edgespec.frontends.bench.stats import geomean_interval

    # two ratios: Student's t with one degree of freedom on their logarithms
    lo, hi = geomean_interval([1.0, 1.21])
    assert (lo, hi) == (pytest.approx(0.3277, abs=1e-3), pytest.approx(3.6926, abs=1e-3))
    assert geomean_interval([1.1] * 5) == (pytest.approx(1.1), pytest.approx(1.1))  # no spread, no doubt
    assert geomean_interval([1.1]) is None

    tps = {"none": (100, 90, 110), "lookahead": (130, 120, 150), "llama.cpp:completion": (98, 92, 100),
           "llama.cpp:lookup": (115, 100, 125)}
    records = [{"id": pid, "category": cat, "method": m, "repeat": rep, "tokens_per_s": v[rep] * scale}
               for pid, cat, scale in (("p1", "code", 1.0), ("p2", "rag", 0.8))
               for m, v in tps.items() for rep in range(3)]
    rep = bench.summarize(records, ["none", "lookahead", "llama.cpp:lookup", "llama.cpp:completion"], flat(0.01), 100)
    vs = {(v["method"], v["versus"], v["category"]): v for v in rep["versus_llama_cpp"]}
    assert set(vs) == {(m, peer, c) for m, peer in (("none", "llama.cpp:completion"), ("lookahead", "llama.cpp:lookup"))
                       for c in ("code", "rag", "all")}
    mine = [a / b for a, b in zip(tps["lookahead"], tps["llama.cpp:lookup"])]
    got = vs[("lookahead", "llama.cpp:lookup", "all")]
    assert got["runs"] == 6 and got["ratio"] == pytest.approx(bench.geomean(mine), abs=1e-3)
    assert got["ci"][0] <= got["ratio"] <= got["ci"][1]
    assert vs[("none", "llama.cpp:completion", "code")]["ratio"] == pytest.approx(
        bench.geomean([a / b for a, b in zip(tps["none"], tps["llama.cpp:completion"])]), abs=1e-3)
    row = next(r for r in rep["summary"] if r["method"] == "lookahead" and r["category"] == "all")
    assert row["speedup_ci"][0] <= row["speedup"] <= row["speedup_ci"][1]
    table = bench.render_markdown(rep)
    assert "| 95% interval |" in table
    assert f"- lookahead / lookup: {got['ratio']:.2f}x ({got['ci'][0]:.2f}-{got['ci'][1]:.2f}) over all; code " in table
    assert "- none / completion: " in table
