"""Would Token Recycling pay here? The fallback issue 58 names for text that matches nothing: a table
from each token to the target's own top next tokens the last time that token was read, drafted where
no earlier text matches. This decodes the prompts greedily, one row at a time, and counts, at every
step where a two-token prompt lookup finds nothing, how often the table's top token for the last
token is the target's next one, by the probability the target gave it when it was stored, beside
what a one-token draft must be kept for to pay on this machine's cost curve (t(2)/t(1) - 1).

    python scripts/recycling_probe.py -m qwen2.5-coder-1.5b-instruct --prompts ../shared/bench/prompts.jsonl

The table is kept across prompts (as one process keeps it) and filled from every prompt row's
logits too (`--no-prompt-rows`: from decoded rows only). Nothing is drafted: one plain decode per
prompt, so the counts are the target's own greedy text.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from edgespec import costcache
from edgespec.kv import KVSeq
from edgespec.llama import Context, ContextConfig, Model
from edgespec.prompts import prompt_tokens
from edgespec.models import resolve

GROUPS = ("chat", "quote", "rag", "extract")  # the conversation groups, not the code edits


def top_and_p(row: np.ndarray) -> tuple[int, float]:
    i = int(np.argmax(row))
    return i, float(1.0 / np.exp(row - row[i]).sum())


def lookup(seq: list[int]) -> int | None:
    """The token after the latest earlier occurrence of the last two tokens, if any."""
    a, b = seq[-2], seq[-1]
    for i in range(len(seq) - 2, 0, -1):
        if seq[i - 1] == a and seq[i] == b:
            return seq[i + 1]
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--prompts", required=True, help="a JSONL file of {id, category, messages}")
    ap.add_argument("-n", "--max-tokens", type=int, default=128)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--no-prompt-rows", action="store_true", help="fill the table from decoded rows only")
    ap.add_argument("--json", help="write the counts here")
    a = ap.parse_args()

    m = Model(resolve(a.model))
    ctx = Context(m, ContextConfig(n_ctx=4096, n_batch=512, n_threads=a.threads, n_seq_max=1))
    kv = KVSeq(ctx)
    cm = costcache.curve(ctx, kv)
    need = cm.t(2) / cm.t(1) - 1.0
    table: dict[int, tuple[int, float]] = {}
    bins = np.zeros((10, 2), dtype=int)  # stored p in tenths: [steps, kept]
    steps = matched = matched_kept = 0
    for line in open(a.prompts, encoding="utf-8"):
        case = json.loads(line)
        if not case.get("category", "").startswith(GROUPS):
            continue
        ctx.mem_clear()
        seq = prompt_tokens(m, messages=case["messages"])
        for s in range(0, len(seq), ctx.n_batch):
            chunk = seq[s:s + ctx.n_batch]
            last = s + len(chunk) == len(seq)
            outs = [not a.no_prompt_rows or (last and i == len(chunk) - 1) for i in range(len(chunk))]
            ctx.decode(chunk, list(range(s, s + len(chunk))), None, outs)
            if not a.no_prompt_rows:
                for i, t in enumerate(chunk):
                    table[t] = top_and_p(ctx.logits(i))
        table[seq[-1]] = top_and_p(ctx.logits(len(chunk) - 1))
        nxt = table[seq[-1]][0]
        for _ in range(a.max_tokens):
            if m.is_eog(nxt):
                break
            guess, copy = table.get(nxt), lookup(seq + [nxt])
            seq.append(nxt)
            ctx.decode([nxt], [len(seq) - 1], None, [True])
            table[nxt] = top_and_p(ctx.logits(0))
            nxt = table[seq[-1]][0]
            steps += 1
            if copy is not None:
                matched += 1
                matched_kept += copy == nxt
            elif guess is not None:
                b = min(int(guess[1] * 10), 9)
                bins[b] += (1, guess[0] == nxt)
    n, k = bins.sum(axis=0)
    out = {"model": a.model, "steps": steps, "lookup_steps": matched, "lookup_kept": matched_kept,
           "no_match_steps_with_entry": int(n), "recycled_kept": int(k), "break_even": round(need, 3),
           "by_stored_p": {f"{b / 10:.1f}": [int(x) for x in bins[b]] for b in range(10) if bins[b, 0]}}
    print(f"{a.model}: {steps} steps; a two-token lookup matched {matched} (kept {matched_kept})")
    print(f"no match, a table entry: {n} steps, its top token kept {k} ({k / max(n, 1):.0%}); "
          f"a one-token draft pays above {need:.0%} kept (t(2)/t(1) = {cm.t(2) / cm.t(1):.2f})")
    for b in range(10):
        if bins[b, 0]:
            print(f"  stored p {b / 10:.1f}-{(b + 1) / 10:.1f}: {bins[b, 0]:4d} steps, kept {bins[b, 1] / bins[b, 0]:.0%}")
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
