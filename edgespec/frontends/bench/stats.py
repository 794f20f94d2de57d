"""The bench summary: per method and category, geometric-mean speedups against `none` from the
same prompt and repeat, the oracle ceiling, and the speculation counters merged as `Stats`."""

from __future__ import annotations

import math
from dataclasses import fields

from ...events import Stats



def geomean(xs: list[float]) -> float:
    xs = [x for x in xs if x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else 0.0


# Student's t, two-sided 95%, by degrees of freedom (1-30); past 30 the normal 1.96 plus a small
# correction (within 0.3% of the true quantile)
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
         2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
         2.052, 2.048, 2.045, 2.042)


def geomean_interval(xs: list[float]) -> tuple[float, float] | None:
    """A 95% interval for the geometric mean of ratios (Student's t on their logarithms, each
    ratio one sample): how far this shared machine's noise leaves the mean uncertain. None with
    fewer than two ratios."""
    logs = [math.log(x) for x in xs if x > 0]
    n = len(logs)
    if n < 2:
        return None
    mean = sum(logs) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / (n - 1))
    t = _T975[n - 2] if n - 1 <= len(_T975) else 1.96 + 2.4 / (n - 1)
    half = t * sd / math.sqrt(n)
    return math.exp(mean - half), math.exp(mean + half)


# What each of our methods is put against among llama.cpp's tools: its plain decoding against
# llama-completion, any drafting method against llama-lookup
LLAMA_PEER = {"none": "llama.cpp:completion"}
LLAMA_DRAFTING = "llama.cpp:lookup"


def versus_llama_cpp(records: list[dict], methods: list[str]) -> list[dict]:
    """Our methods against llama.cpp's tools on the same prompt and repeat: per category and
    over all, the geometric mean of ours / theirs in tokens/s, with its 95% interval."""
    theirs = {(r["method"], r["id"], r["repeat"]): r for r in records if r["method"].startswith("llama.cpp:")}
    if not theirs:
        return []
    cats = sorted({r["category"] for r in records})
    out = []
    for m in methods:
        if m.startswith("llama.cpp:"):
            continue
        peer = LLAMA_PEER.get(m, LLAMA_DRAFTING)
        for cat in cats + ["all"]:
            ratios = [_tps(r) / _tps(theirs[(peer, r["id"], r["repeat"])]) for r in records
                      if r["method"] == m and (cat == "all" or r["category"] == cat) and _tps(r) > 0
                      and _tps(theirs.get((peer, r["id"], r["repeat"]), {})) > 0]
            if ratios:
                out.append({"method": m, "versus": peer, "category": cat, "runs": len(ratios),
                            "ratio": _r(geomean(ratios)), "ci": _ci(ratios)})
    return out


def ceiling(cost, n_past: int, max_rows: int = 32, limit: int | None = None) -> tuple[float, int]:
    """Best speedup of an oracle drafter (every draft token accepted) and its draft length;
    `limit`: the rows one verification may decode (default: the probe's bit-exact limit)."""
    best, best_k = 1.0, 0
    plain = cost.t(1, n_past)
    for k in range(1, min(max_rows, cost.max_exact_rows if limit is None else limit)):
        s = (k + 1) * plain / cost.t(k + 1, n_past)
        if s > best:
            best, best_k = s, k
    return best, best_k


def text_ceiling(cost, prompt: list[int], output: list[int], limit: int = 32, window: int = 24,
                 max_match: int = 8) -> tuple[float, float]:
    """What the text itself allowed a trie drafter, in hindsight: (seconds of plain decoding,
    seconds of the best drafting) for `output` after `prompt` on the cost curve.

    At each position the drafts available are the continuations, in a trie of the prompt's and
    the output's n-grams so far (`window`-token branches, as lookahead keeps), of a suffix of up
    to `max_match` tokens; the right ones are known afterwards. The best schedule (plain step or
    a right draft of any length there, at most `limit` - 1 tokens) is found by dynamic
    programming. The oracle ceiling assumes every token could be drafted; this one counts only
    the copies the text holds, so speedup over it is how well drafts were chosen and sized."""
    from ...trie import OUTPUT, PROMPT, Cursor, TokenTrie

    n = len(output)
    if n < 2:
        return 0.0, 0.0
    trie, cur = TokenTrie(window=window), Cursor()
    trie.extend(prompt, PROMPT, cur)
    ctx = list(prompt) + output[:1]  # the first token comes with the prompt's logits
    plain, best = 0.0, [0.0] + [float("inf")] * (n - 1)  # best[j]: seconds to commit output[:j+1]
    for i in range(1, n):
        trie.extend(ctx, OUTPUT, cur)
        right = 0  # the longest right draft any matched suffix offers here
        for s in range(1, min(max_match, len(ctx)) + 1):
            node = trie.walk(ctx[-s:])
            if node is None:
                break
            k = 0
            while i + k < n and k < limit - 1:
                node = node.children.get(output[i + k])
                if node is None:
                    break
                k += 1
            right = max(right, k)
        n_past = len(ctx)
        one = cost.t(1, n_past)
        plain += one
        here = best[i - 1]
        best[i] = min(best[i], here + one)
        for k in range(1, right + 1):
            j = min(n - 1, i + k)
            best[j] = min(best[j], here + cost.t(1 + k, n_past))
        ctx.append(output[i])
    return plain, best[n - 1]


def summarize(records: list[dict], methods: list[str], cost, n_past: int, limit: int | None = None,
              texts: dict[str, tuple[str, list[int], list[int]]] | None = None) -> dict:
    base = {(r["id"], r["repeat"]): r for r in records if r["method"] == "none"}
    llama_base = {(r["id"], r["repeat"]): r for r in records if r["method"] == "llama.cpp:completion"}
    cats = sorted({r["category"] for r in records})
    top, top_k = ceiling(cost, n_past, limit=limit)
    rows = []
    for m in methods:
        mine = [r for r in records if r["method"] == m]
        for cat in cats + ["all"]:
            sel = [r for r in mine if cat == "all" or r["category"] == cat]
            if not sel:
                continue
            sp = [_tps(r) / _tps(base[(r["id"], r["repeat"])]) for r in sel
                  if _tps(r) > 0 and _tps(base.get((r["id"], r["repeat"]), {})) > 0]
            st = merged(sel)
            tgen = st.t_gen
            speed = geomean(sp) if sp else None
            # llama.cpp's tools against llama.cpp's own plain decoding: the drafting alone,
            # without the difference between the two runtimes' plain speeds
            own = llama_base if m.startswith("llama.cpp:") else base
            osp = [_tps(r) / _tps(own[(r["id"], r["repeat"])]) for r in sel
                   if _tps(r) > 0 and _tps(own.get((r["id"], r["repeat"]), {})) > 0]
            rows.append({
                "method": m, "category": cat, "prompts": len(sel),
                "tokens_per_s": round(geomean([_tps(r) for r in sel]), 1),
                "speedup": _r(speed), "speedup_min": _r(min(sp) if sp else None), "speedup_max": _r(max(sp) if sp else None),
                "speedup_ci": _ci(sp),
                "speedup_own_plain": _r(geomean(osp) if osp else None),
                "efficiency": _r(speed / top if speed and top > 0 else None),
                "acceptance_rate": _r(st.acceptance_rate if st.n_drafted else None),
                "mean_accepted_length": _r(st.mean_accepted_length if st.n_steps else None),
                "acceptance_by_position": [round(x, 3) for x in st.acceptance_by_position],
                "accepted_len_hist": st.accepted_len_hist,
                "draft_share": _r(sum(r.get("t_draft", 0.0) for r in sel) / tgen if tgen and "t_draft" in sel[0] else None),
                "verify_share": _r(sum(r.get("t_verify", 0.0) for r in sel) / tgen if tgen and "t_verify" in sel[0] else None),
                # drafting time per drafted token against one plain target step (heads must be cheap)
                "draft_ms_per_token": _r(1e3 * st.t_draft / st.n_drafted if st.n_drafted else None),
                "plain_step_ms": _r(_plain_step_ms([base[k] for k in {(r["id"], r["repeat"]) for r in sel} if k in base])),
                # llama.cpp's tools: their printed answer against our `none` text (run.py); None: not checked
                "all_match": None if all(r.get("match") is None for r in sel) else all(r.get("match", True) for r in sel),
            })
    out = {"summary": rows, "cost_ms": cost.to_dict(),
           "ceiling": {"speedup": round(top, 3), "draft_len": top_k, "n_past": n_past}}
    vs = versus_llama_cpp(records, methods)
    if vs:
        out["versus_llama_cpp"] = vs
    if texts:
        out["text_ceiling"] = _text_ceilings(rows, texts, cost, limit or cost.max_exact_rows)
    checked = [r for r in records if r.get("same_as_own_plain") is not None]
    if checked:
        # llama-lookup against llama-completion, both llama.cpp's: is its drafting lossless?
        out["llama_cpp_lookup_exact"] = {
            "same": sum(bool(r["same_as_own_plain"]) for r in checked), "runs": len(checked),
            "differ": sorted({r["id"] for r in checked if not r["same_as_own_plain"]})}
    return out


def _text_ceilings(rows: list[dict], texts: dict, cost, limit: int) -> dict:
    """Per category (and all): the text ceiling, a geometric mean over prompts as speedups are,
    and each drafting method's speedup as a share of it."""
    per: dict[str, list[float]] = {}
    for category, prompt, output in texts.values():
        plain, best = text_ceiling(cost, prompt, output, min(32, limit))
        if plain > 0 and best > 0:
            per.setdefault(category, []).append(plain / best)
            per.setdefault("all", []).append(plain / best)
    top = {c: round(geomean(v), 3) for c, v in per.items()}
    reached: dict[str, dict[str, float]] = {}
    for r in rows:
        if r["method"] in ("none", "llama.cpp:completion") or r["speedup"] is None or not top.get(r["category"]):
            continue
        reached.setdefault(r["method"], {})[r["category"]] = round(r["speedup"] / top[r["category"]], 3)
    return {"speedup": top, "reached": reached}


def _plain_step_ms(records: list[dict]) -> float | None:
    st = merged(records) if records else None
    return 1e3 * st.t_verify / st.n_steps if st and st.n_steps and st.t_verify else None


def _tps(record: dict) -> float:
    """A run's tokens/s; 0 when it has none (a llama.cpp run whose output could not be parsed)."""
    return record.get("tokens_per_s") or 0.0


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def _ci(ratios: list[float]) -> list[float] | None:
    ci = geomean_interval(ratios)
    return [_r(ci[0]), _r(ci[1])] if ci else None


def merged(records: list[dict]) -> Stats:
    """The runs' counters added up (llama.cpp's runs have none: they add zeros)."""
    names = {f.name for f in fields(Stats)}
    total = Stats()
    for r in records:
        total.merge(Stats(**{k: v for k, v in r.items() if k in names}))
    return total
