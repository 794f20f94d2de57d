"""Does KV reuse change greedy output against a cold full prefill? Measured on the bench prompts.

    python scripts/reuse_vs_cold.py -m smollm2-135m-instruct:q4_0
    python scripts/reuse_vs_cold.py -m qwen2.5-coder-1.5b-instruct -n 128 --json out.json

Reuse reads a prompt's new suffix in a batch of its own (a turn's new message, or the last token
alone), where a cold read takes the whole prompt in chunks of -b rows: other batch shapes, and
llama.cpp's kernels need not give the same bits for both. Per prompt (plain decoding, greedy):

- regenerate: the prompt read cold, then generated again from the cache (only its last token
  read again): the first token's logits (max |diff|) and the two outputs;
- turn 2: the prompt, its reply, and a follow-up message: turn 2 generated from the cache of
  turn 1 (only the follow-up read) and cold (the whole conversation read at once).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from edgespec.engine import Engine, EngineConfig
from edgespec.sampling import SamplingConfig

GREEDY = SamplingConfig(temp=0.0)
FOLLOW_UP = "Thanks. Now say the same again, more briefly."


def first_diff(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default="smollm2-135m-instruct:q4_0")
    ap.add_argument("--prompts", default="/work/shared/bench/prompts.jsonl")
    ap.add_argument("-n", type=int, default=128, help="tokens per reply (default: %(default)s)")
    ap.add_argument("-c", "--ctx", type=int, default=4096)
    ap.add_argument("-t", "--threads", type=int, default=0)
    ap.add_argument("--kv", default="q8_0/f16", help="KV cache types (default: %(default)s)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    items = [json.loads(line) for line in Path(a.prompts).read_text().splitlines() if line.strip()]
    eng = Engine(EngineConfig(model=a.model, n_ctx=a.ctx, threads=a.threads, kv_type=a.kv))
    kv, ctx = eng.kv, eng.ctx
    gen = lambda p, reuse: eng.start(p, a.n, GREEDY, "none", reuse=reuse).run()  # noqa: E731
    rows = []
    try:
        for it in items:
            msgs = it.get("messages") or [{"role": "user", "content": it["prompt"]}]
            p1 = eng.prompt_tokens(messages=msgs)
            if len(p1) + 2 * a.n + 64 > eng.n_ctx_seq:
                continue
            # the first token's logits: the prompt read cold, then its last token read alone
            kv.reset()
            cold_logits = ctx.logits(kv.extend(p1)).copy()
            kv.keep_prefix(p1, len(p1) - 1)
            warm_logits = ctx.logits(kv.extend(p1[-1:]))
            d_logit = float(np.max(np.abs(cold_logits - warm_logits)))
            kv.reset()
            g1 = gen(p1, False)
            regen = gen(p1, True)
            msgs2 = msgs + [{"role": "assistant", "content": eng.target.detokenize(g1.tokens)},
                            {"role": "user", "content": FOLLOW_UP}]
            p2 = eng.prompt_tokens(messages=msgs2)
            kv.reset()
            gen(p1, True)  # turn 1 again, so that the cache holds it as a chat leaves it
            t2_reuse = gen(p2, True)
            t2_cold = gen(p2, False)
            rows.append({
                "id": it.get("id", ""), "n_prompt": len(p1), "first_logit_max_diff": d_logit,
                "regen_same": regen.tokens == g1.tokens, "regen_first_diff": first_diff(regen.tokens, g1.tokens),
                "turn2_prompt": len(p2), "turn2_read": t2_reuse.stats.n_prompt_eval,
                "turn2_same": t2_reuse.tokens == t2_cold.tokens,
                "turn2_first_diff": first_diff(t2_reuse.tokens, t2_cold.tokens),
            })
            r = rows[-1]
            print(f"{r['id'][:32]:32s} prompt {r['n_prompt']:5d}  first-token |dlogit| {d_logit:.3g}  "
                  f"regenerate {'same' if r['regen_same'] else 'differs at ' + str(r['regen_first_diff'])}  "
                  f"turn 2 ({r['turn2_read']} of {r['turn2_prompt']} read) "
                  f"{'same' if r['turn2_same'] else 'differs at ' + str(r['turn2_first_diff'])}", flush=True)
    finally:
        eng.close()
    n = len(rows)
    print(f"{a.model} (KV {a.kv}, exact batches up to {eng.cost.max_exact_rows} rows): regenerate same on "
          f"{sum(r['regen_same'] for r in rows)}/{n}, turn 2 same on {sum(r['turn2_same'] for r in rows)}/{n}, "
          f"first-token logits bit-identical on {sum(r['first_logit_max_diff'] == 0 for r in rows)}/{n} "
          f"(max |diff| {max((r['first_logit_max_diff'] for r in rows), default=0):.3g})")
    if a.json:
        Path(a.json).write_text(json.dumps({"model": a.model, "kv": a.kv, "n": a.n, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
