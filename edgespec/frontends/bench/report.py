"""The bench report: a Markdown table and, with matplotlib, a chart."""

from __future__ import annotations

from pathlib import Path


def render_markdown(report: dict) -> str:
    c = report["ceiling"]
    lines = [
        f"Oracle ceiling on this machine: {c['speedup']:.2f}x (draft {c['draft_len']}, {c['n_past']} tokens of context).",
    ]
    ex = report.get("exactness")
    if ex:
        lines.append(f"Exactness: {ex['policy']} on the {ex['backend']} (bit-exact batches up to {ex['max_exact_rows']} "
                     f"rows, verifying up to {ex['max_verify_rows']}): {ex['guarantee']}.")
    lines += [
        "",
        "| method | category | prompts | tok/s | speedup (min-max) | 95% interval | vs own plain | efficiency | "
        "acceptance | mean acc. len | acc. by position | draft / verify time | draft ms/token (plain step) | output = none |",
        "|" + "---|" * 14,
    ]
    for r in report["summary"]:
        sp = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x ({r['speedup_min']:.2f}-{r['speedup_max']:.2f})"
        eff = "-" if r["efficiency"] is None else f"{100 * r['efficiency']:.0f}%"
        acc = "-" if r["acceptance_rate"] is None else f"{100 * r['acceptance_rate']:.0f}%"
        mal = "-" if r["mean_accepted_length"] is None else f"{r['mean_accepted_length']:.2f}"
        pos = " ".join(f"{100 * x:.0f}" for x in r["acceptance_by_position"][:4]) or "-"
        share = "-" if r["draft_share"] is None or r["verify_share"] is None else f"{100 * r['draft_share']:.0f}% / {100 * r['verify_share']:.0f}%"
        ok = "not checked" if r["all_match"] is None else "yes" if r["all_match"] else "**NO**"
        own = "-" if r.get("speedup_own_plain") is None else f"{r['speedup_own_plain']:.2f}x"
        dms = "-" if r.get("draft_ms_per_token") is None else (
            f"{r['draft_ms_per_token']:.2f}" + ("" if r.get("plain_step_ms") is None else f" ({r['plain_step_ms']:.1f})"))
        ci = "-" if not r.get("speedup_ci") or r["method"] == "none" else _interval(r["speedup_ci"])
        lines.append(f"| {r['method']} | {r['category']} | {r['prompts']} | {r['tokens_per_s']:.1f} | {sp} | {ci} | {own} | {eff} | "
                     f"{acc} | {mal} | {pos} | {share} | {dms} | {ok} |")
    vs = report.get("versus_llama_cpp")
    if vs:
        lines += ["", "Against llama.cpp's tools on the same prompt and repeat (ours / theirs in tokens/s, "
                      "geometric mean, 95% interval):"]
        for m, peer in dict.fromkeys((v["method"], v["versus"]) for v in vs):
            got = [v for v in vs if v["method"] == m and v["versus"] == peer]
            total = next((v for v in got if v["category"] == "all"), None)
            per = ", ".join(f"{v['category']} {_ratio(v)}" for v in got if v["category"] != "all")
            head = f"{_ratio(total)} over all" if total else ""
            lines.append(f"- {m} / {peer.split(':', 1)[-1]}: {head}" + (f"; {per}" if per and len(got) > 2 else ""))
    tc = report.get("text_ceiling")
    if tc and tc["speedup"]:
        cats = [c for c in tc["speedup"] if c != "all"]
        per = ", ".join(f"{c} {tc['speedup'][c]:.2f}x" for c in cats)
        lines += ["", f"Text ceiling (every draft the prompt and the output so far held, right ones chosen in "
                      f"hindsight and sized best on this cost curve): {tc['speedup'].get('all', 0):.2f}x over all ({per})."]
        for m, got in tc["reached"].items():
            per = ", ".join(f"{c} {100 * got[c]:.0f}%" for c in cats if c in got)
            lines.append(f"{m} reached {100 * got.get('all', 0):.0f}% of it ({per}).")
    lx = report.get("llama_cpp_lookup_exact")
    if lx:
        differ = f" (another answer on {', '.join(lx['differ'])})" if lx["differ"] else ""
        lines += ["", f"llama-lookup kept llama-completion's answer (llama.cpp's own plain decoding, same KV cache) "
                      f"in {lx['same']} of {lx['runs']} runs{differ}."]
    return "\n".join(lines)


def _interval(ci: list[float]) -> str:
    return f"{ci[0]:.2f}-{ci[1]:.2f}"


def _ratio(v: dict) -> str:
    return f"{v['ratio']:.2f}x" + (f" ({_interval(v['ci'])})" if v.get("ci") else "")


def write_charts(report: dict, records: list[dict], path: Path) -> Path | None:
    """Speedup by method and category; accepted-length histograms. Needs matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = [r for r in report["summary"] if r["speedup"] is not None and r["method"] != "none"]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    cats = list(dict.fromkeys(r["category"] for r in rows))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [3, 2]})
    width = 0.8 / max(1, len(methods))
    for i, m in enumerate(methods):
        vals = [next((r["speedup"] for r in rows if r["method"] == m and r["category"] == c), 0) for c in cats]
        ax1.bar([j + i * width for j in range(len(cats))], vals, width, label=m)
    ax1.axhline(1.0, color="black", lw=0.8)
    ax1.axhline(report["ceiling"]["speedup"], color="grey", ls="--", lw=0.8, label="oracle ceiling")
    ax1.set_xticks([j + width * (len(methods) - 1) / 2 for j in range(len(cats))], cats, rotation=30, ha="right", fontsize=8)
    ax1.set_ylabel("speedup over none (same run)")
    ax1.set_title("speedup by method and category (geometric mean)")
    ax1.legend(fontsize=8)
    for m in methods:
        row = next((r for r in report["summary"] if r["method"] == m and r["category"] == "all"), None)
        hist = row.get("accepted_len_hist", []) if row else []
        if sum(hist):
            xs = list(range(len(hist)))
            ax2.plot(xs, [h / sum(hist) for h in hist], marker="o", label=m)
    ax2.set_xlabel("tokens committed per target step")
    ax2.set_ylabel("share of steps")
    ax2.set_title("accepted length per step")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
