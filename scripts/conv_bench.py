"""Chat as `edgespec chat` runs it: the default (`auto` with the reply history) against
`--spec none`, on first-turn chat prompts, summaries of the prompt's text and two-turn revisions
of the last reply, alternated, each conversation's last turn timed (`--no-ledger-arm`: a third arm,
the default without the per-reply loss bound of CostModel.best_size; `--uncharged-arm`: a third
arm, the bound's ledger blind to drafting time as before sequential.CHARGE_DRAFTING; `--unweighed-arm`: a third
arm, the draft model's gate blind to its runs that draft nothing (draft_model.WEIGH_HITS); `--whole-catch-up-arm`:
a third arm, the ledger charging a draft model's catch-up whole (sequential.SPREAD_CATCH_UP); `--same-state`: every
arm of a case starts from the drafters' learned state as the case began; `--aa-arm`: a second plain arm,
timed against the first, to show the timing noise). Each case also splits the default's ratio:
`curve_ratio` (its verifications as the cost curve predicts them, what the gate and the loss bound
see), `verify_ratio` (the verifications as timed) and `other_share` (the rest of its time: drafting,
the draft model's catch-up, Python).

    python scripts/conv_bench.py -m qwen2.5-coder-1.5b-instruct -t 2 --lock /tmp/edgespec-cpu.lock \\
        --prompts ../shared/bench/prompts.jsonl --json out.json

With `--lock FILE` each case's runs hold that lock (other jobs on a shared machine wait between
cases rather than during one).

One engine (the catalog's draft when cached, as `chat` pairs it); every conversation starts with
the KV cache reset and an empty reply history of its own (no earlier run of the same prompt to
copy from: a revision copies only the reply of its own first turn); the sources' calibrations
and the cost curve are kept across conversations, as one user's process keeps them. Each case
runs `--repeats` times per arm, arms alternated (none first, then default, then none, ...), and
the figure is the ratio of the last turn's decode rate (tokens after the first per second),
per case the median of its pairs. Greedy; the outputs of both arms are compared token for token.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import fcntl
import json
import math
import statistics
import tempfile
from pathlib import Path

from edgespec import costmodel
from edgespec.drafters import draft_model
from edgespec.engine import Engine, EngineConfig
from edgespec.frontends.session import ChatSession
from edgespec.schedulers import sequential
from edgespec.sampling import SamplingConfig

REVISIONS = [
    ("revise-formal", "Give me four tips for writing clear emails.", "Rewrite your answer in a formal tone."),
    ("revise-number", "List the main steps to make a cup of tea.", "Number every item of your answer."),
    ("revise-repeat", "Explain what a Python list comprehension is, with an example.",
     "Repeat your answer exactly, with a title line added at the top."),
    ("revise-shorten", "Describe how a hash table works.", "Shorten your answer, keeping its sentences as they are."),
]


def cases(prompts_file: str | None, code: bool = False) -> list[tuple[str, str, list[str]]]:
    """(id, group, user turns); with `code`, the code edits too."""
    out = []
    if prompts_file:
        for line in Path(prompts_file).read_text().splitlines():
            d = json.loads(line)
            turns = [m["content"] for m in d["messages"] if m["role"] == "user"]
            if len(turns) != 1:
                continue
            cat = d["category"]
            grp = ("chat" if cat.startswith("chat") else "summary" if cat in ("quote-summarize", "rag", "extraction")
                   else "code" if cat == "code-edit" and code else "")
            if grp:
                out.append((d["id"], grp, turns))
    out += [(i, "revision", [a, b]) for i, a, b in REVISIONS]
    return out


# The third arms: the default with one of its switches set otherwise (module, name, value, the
# summary's label, what it means).
THIRD_ARMS = {
    "no-ledger": (costmodel, "LOSS_SHARE", math.inf, "no ledger", "no per-reply loss bound"),
    "uncharged": (sequential, "CHARGE_DRAFTING", False, "drafting uncharged", "its ledger blind to drafting time"),
    "unweighed": (draft_model, "WEIGH_HITS", False, "runs that draft nothing unweighed",
                  "the draft model's gate blind to the share of its runs that drafted"),
    "whole-catch-up": (sequential, "SPREAD_CATCH_UP", False, "catch-ups charged whole",
                       "the ledger charging a draft model's catch-up whole"),
}


def _snapshot(engine: Engine) -> dict:
    """The drafters' learned state on the engine (side contexts holding plain values)."""
    return {k: copy.deepcopy(v.value) for k, v in engine.side.items() if k != "history" and hasattr(v, "value")}


def _restore(engine: Engine, snap: dict) -> None:
    for k, v in snap.items():
        if k in engine.side:
            engine.side[k].value = copy.deepcopy(v)


def run(engine: Engine, method: str, turns: list[str], n: int, history: bool) -> tuple[list[int], float, dict]:
    engine.kv.reset()
    engine.side.release("history")  # an empty history of its own (see the module's doc)
    if history:
        Path(engine.cfg.history).unlink(missing_ok=True)
    s = ChatSession(engine, method, SamplingConfig(temp=0.0), n)
    r = None
    for i, t in enumerate(turns):
        steps = []  # the last turn's verifications: (rows, cached tokens, seconds, the curve's seconds)
        cost = engine.cost
        observe = cost.observe
        if i == len(turns) - 1:
            def record(k, n_past, seconds, predicted=None):
                steps.append((k, n_past, seconds, cost.t(k, n_past)))
                observe(k, n_past, seconds, predicted)
            cost.observe = record
        try:
            r = s.send(t)
        finally:
            cost.__dict__.pop("observe", None)
    st = r.stats
    return r.tokens, st.tokens_per_s, {"by_source": st.by_source, "mal": round(st.mean_accepted_length, 3),
                                       "tokens": st.n_generated, "steps": steps, "t_gen": st.t_gen,
                                       "t_draft": st.t_draft}


def split(plain: dict, spec: dict) -> dict:
    """Where the default's ratio came from, per token: its verifications' time as the cost curve
    predicted it (what the gate and the loss bound saw), as measured, and the rest of its time
    (drafting, the draft model's catch-up, Python), each against the plain run's."""
    def per_token(info, i):
        return sum(s[i] for s in info["steps"]) / max(1, info["tokens"])
    out = {"curve_ratio": per_token(plain, 3) / per_token(spec, 3) if spec["steps"] else float("nan"),
           "verify_ratio": per_token(plain, 2) / per_token(spec, 2) if spec["steps"] else float("nan"),
           "other_share": 1 - sum(s[2] for s in spec["steps"]) / spec["t_gen"] if spec["t_gen"] else float("nan"),
           "plain_other_share": (1 - sum(s[2] for s in plain["steps"]) / plain["t_gen"]) if plain["t_gen"] else float("nan")}
    return {k: round(v, 3) for k, v in out.items()}


@contextlib.contextmanager
def _locked(path: str | None):
    if not path:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("-md", "--draft", default=None, help="draft model (default: the catalog's pair when cached)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--prompts", default=None)
    ap.add_argument("--only", default="", help="comma-separated case ids or groups (`code`: the code edits, not run otherwise)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--lock", default=None, metavar="FILE", help="hold this lock (flock) during each case")
    for name, (mod, attr, value, _, what) in THIRD_ARMS.items():
        ap.add_argument(f"--{name}-arm", action="store_true",
                        help=f"a third arm: the default with {what} ({mod.__name__.split('.')[-1]}.{attr} {value}); "
                             "reported in the no_ledger_* fields")
    ap.add_argument("--same-state", action="store_true",
                    help="each arm of a case starts from the drafters' learned state (calibrations, the draft "
                         "model's state, auto's gates) as the case began, not from what the arm before it left")
    ap.add_argument("--aa-arm", action="store_true",
                    help="a plain arm timed against the plain arm (A/A): how far the figure moves with nothing changed")
    ap.add_argument("--loss-share", type=float, default=None,
                    help="the default arm's costmodel.LOSS_SHARE (default: the module's)")
    a = ap.parse_args()
    third = next((THIRD_ARMS[n] for n in THIRD_ARMS if getattr(a, n.replace("-", "_") + "_arm")), None)
    if a.loss_share is not None:
        costmodel.LOSS_SHARE = a.loss_share
    draft = a.draft
    if draft is None:
        from edgespec.models import CATALOG, is_cached

        pair = CATALOG.get(a.model)
        draft = pair.draft if pair is not None and pair.draft and is_cached(pair.draft) else None
    hist = Path(tempfile.mkdtemp(prefix="conv-bench-")) / "history.npz"
    engine = Engine(EngineConfig(model=a.model, draft=draft, threads=a.threads, n_ctx=4096, history=str(hist)))
    rows = []
    try:
        # one-time costs (the draft model's weights read from disk at its first decode, buffers)
        # are paid here, not by the first case's `auto` arm
        if engine.draft_kv is not None:
            engine.draft_kv.extend(engine.prompt_tokens("warm up " * 64, raw=True), want_logits=False)
            engine.draft_kv.reset()
        for method in ("none", "auto"):
            run(engine, method, ["Say hello."], 16, method == "auto")
        todo = cases(a.prompts, "code" in a.only.split(","))
        if a.only:
            keep = set(a.only.split(","))
            todo = [c for c in todo if c[0] in keep or c[1] in keep]
        for cid, grp, turns in todo:
            ratios, same, info, extra, parts = [], True, {}, {}, []
            snap = _snapshot(engine) if a.same_state else None
            with _locked(a.lock):
                for i in range(a.repeats):
                    if a.aa_arm and i % 2:  # the second plain run first every other repeat
                        plain2, r02, _ = run(engine, "none", turns, a.n, False)
                    plain, r0, info0 = run(engine, "none", turns, a.n, False)
                    if a.aa_arm and not i % 2:
                        plain2, r02, _ = run(engine, "none", turns, a.n, False)
                    if a.aa_arm:
                        same &= plain == plain2
                        extra.setdefault("aa_ratios", []).append(round(r02 / r0 if r0 else float("nan"), 3))
                    # with the third arm, the two `auto` arms swap places every other repeat
                    for arm in (("auto", "third") if i % 2 == 0 or not third else ("third", "auto")):
                        if snap is not None:
                            _restore(engine, snap)
                        if arm == "auto":
                            spec, r1, info = run(engine, "auto", turns, a.n, True)
                            same &= plain == spec
                            ratios.append(r1 / r0 if r0 else float("nan"))
                            parts.append(split(info0, info))
                        elif third:
                            mod, attr, value = third[:3]
                            kept = getattr(mod, attr)
                            setattr(mod, attr, value)
                            try:
                                spec2, r2, info2 = run(engine, "auto", turns, a.n, True)
                            finally:
                                setattr(mod, attr, kept)
                            same &= plain == spec2
                            extra.setdefault("no_ledger_ratios", []).append(round(r2 / r0 if r0 else float("nan"), 3))
                            extra["no_ledger_by_source"] = info2["by_source"]
                            extra.setdefault("no_ledger_other_shares", []).append(split(info0, info2)["other_share"])
            if "no_ledger_ratios" in extra:
                extra["no_ledger_ratio"] = round(statistics.median(extra["no_ledger_ratios"]), 3)
            if "aa_ratios" in extra:
                extra["aa_ratio"] = round(statistics.median(extra["aa_ratios"]), 3)
            info = {k: v for k, v in info.items() if k not in ("steps", "t_gen", "t_draft")}
            parts = {k: round(statistics.median(p[k] for p in parts), 3) for k in parts[0]} if parts else {}
            row = {"id": cid, "group": grp, "ratio": round(statistics.median(ratios), 3),
                   "ratios": [round(x, 3) for x in ratios], "identical": same, **info, **parts, **extra}
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        engine.close()
    print("\n| group | prompts | default / none, geomean | lowest | identical |")
    print("|---|---|---|---|---|")
    for grp in dict.fromkeys(r["group"] for r in rows):
        rs = [r for r in rows if r["group"] == grp]
        g = math.exp(statistics.mean(math.log(r["ratio"]) for r in rs))
        low = min(rs, key=lambda r: r["ratio"])
        print(f"| {grp} | {len(rs)} | {g:.2f}x | {low['ratio']:.2f}x ({low['id']}) | "
              f"{sum(r['identical'] for r in rs)}/{len(rs)} |")
        if all("curve_ratio" in r for r in rs):
            for key, what in (("curve_ratio", "by the cost curve"), ("verify_ratio", "verification time only")):
                g3 = math.exp(statistics.mean(math.log(r[key]) for r in rs))
                low3 = min(rs, key=lambda r: r[key])
                print(f"| {grp}, {what} | {len(rs)} | {g3:.2f}x | {low3[key]:.2f}x ({low3['id']}) | |")
        if all("aa_ratio" in r for r in rs):
            g4 = math.exp(statistics.mean(math.log(r["aa_ratio"]) for r in rs))
            low4 = min(rs, key=lambda r: r["aa_ratio"])
            hi4 = max(rs, key=lambda r: r["aa_ratio"])
            print(f"| {grp}, plain / plain (A/A) | {len(rs)} | {g4:.2f}x | {low4['aa_ratio']:.2f}x ({low4['id']}); "
                  f"highest {hi4['aa_ratio']:.2f}x | |")
        if all("no_ledger_ratio" in r for r in rs):
            g2 = math.exp(statistics.mean(math.log(r["no_ledger_ratio"]) for r in rs))
            low2 = min(rs, key=lambda r: r["no_ledger_ratio"])
            print(f"| {grp}, {third[3]} | {len(rs)} | {g2:.2f}x | {low2['no_ledger_ratio']:.2f}x ({low2['id']}) | |")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
