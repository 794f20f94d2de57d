"""What a quantization costs: perplexity of each variant of the default model, and how often its
top token agrees with the Q8_0 variant's, teacher-forced through llama.cpp over the message
texts of shared/bench/prompts.jsonl (docs/models.md: "The default stays the catalog's Q4_1 file").

    python tests/quality.py [--suite ../shared/bench/prompts.jsonl] [--models a,b,c]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from edgespec.kv import KVSeq
from edgespec.llama import Context, ContextConfig, Model
from edgespec.models import resolve

HERE = Path(__file__).resolve().parent


def score(path: Path, text: str, window: int = 1024, step: int = 256) -> tuple[float, list[int]]:
    """Perplexity over `text` (in independent windows) and the top token at every position."""
    m = Model(path)
    c = Context(m, ContextConfig(2 * window, step, 0, 1))
    kv = KVSeq(c)
    toks = m.tokenize(text)
    nll, n, tops = 0.0, 0, []
    for s in range(0, len(toks) - 1, window):
        chunk = toks[s : s + window]
        kv.reset()
        for b in range(0, len(chunk), step):
            part = chunk[b : b + step]
            kv.extend(part, all_rows=True)
            for i in range(len(part)):
                j = b + i + 1
                if j >= len(chunk):
                    break
                lg = c.logits(i).astype(np.float64)
                lg -= lg.max()
                nll -= lg[chunk[j]] - np.log(np.exp(lg).sum())
                n += 1
                tops.append(int(np.argmax(lg)))
    c.close()
    m.close()
    return float(np.exp(nll / n)), tops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suite", default=str(HERE.parent.parent / "shared" / "bench" / "prompts.jsonl"))
    ap.add_argument("--models", default="smollm2-135m-instruct:q8_0,smollm2-135m-instruct,smollm2-135m-instruct:q4_0",
                    help="the first is the reference for top-token agreement")
    a = ap.parse_args()
    items = [json.loads(line) for line in open(a.suite) if line.strip()]
    text = "\n\n".join(msg["content"] for it in items for msg in it["messages"])
    names = a.models.split(",")
    results = {name: score(resolve(name), text) for name in names}
    ref = np.array(results[names[0]][1])
    for name, (ppl, tops) in results.items():
        agree = float(np.mean(np.array(tops) == ref))
        print(f"{name}: perplexity {ppl:.2f} over {len(tops)} tokens; top token = {names[0]}'s at {agree:.1%}")


if __name__ == "__main__":
    main()
