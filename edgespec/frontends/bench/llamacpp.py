"""llama.cpp's own tools (`llama-completion`, `llama-lookup`) on the same prompts, for the table."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ...errors import EdgespecError
from ...kvtypes import kv_types


_EVAL = re.compile(r"eval time =\s*([\d.]+) ms /\s*(\d+) (?:runs|tokens)")
_TOTAL = re.compile(r"total time =\s*([\d.]+) ms")
_PROMPT = re.compile(r"prompt eval time =\s*([\d.]+) ms")
_DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
# how the tools mark an answer that ended on its own: llama-completion prints "[end of text]",
# llama-lookup the end token's text ("<|im_end|>", "<end_of_turn>", "</s>")
_END = re.compile(r"\s*(\[end of text\]|<[^<>\s]{1,32}>)$")


def run_llama_cpp(bin_dir: str, eng, prompts, cfg, repeat: int = 0, kv: str | None = None) -> list[dict]:
    """llama.cpp's own llama-completion (plain) and llama-lookup on the same formatted prompts,
    with our KV cache types, or `kv` ("default": llama.cpp's own, f16; or T or K/V)."""
    bind = Path(bin_dir)
    kv = kv or cfg.kv_type
    kv_args = [] if kv == "default" else ["-ctk", kv_types(kv)[0], "-ctv", kv_types(kv)[1]]
    rows = []
    for item, toks, n in prompts:
        prompt_forms = (eng.target.detokenize(toks, special=True), eng.target.detokenize(toks))
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
            f.write(prompt_forms[0])
            pf = f.name
        answers = {}
        try:
            for name, exe, extra in (("llama.cpp:completion", "llama-completion", ["-no-cnv"]),
                                     ("llama.cpp:lookup", "llama-lookup", [])):
                path = bind / exe
                if not path.exists():
                    raise EdgespecError(f"{path} not found (build it with shared/tools/build-llama-cpp-tools.sh)")
                # --no-escape: llama.cpp turns "\\" in a prompt file into "\" unless told not to,
                # which would give its tools another prompt than ours wherever code has backslashes
                cmd = [str(path), "-m", str(eng.target.path), "-f", pf, "--no-escape", "-n", str(n), "--temp", "0",
                       "-t", str(eng.ctx.n_threads), "-c", str(eng.ctx.n_ctx), *kv_args, *extra]
                t0 = time.perf_counter()
                r = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=600)
                tps = parse_gen_tps(r.stderr + r.stdout, n)
                if tps is None:
                    tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
                    print(f"edgespec: {exe} gave no timing on {item['id']}: {tail}", file=sys.stderr)
                    continue
                rows.append({"id": item["id"], "category": item["category"], "method": name, "repeat": repeat,
                             "tokens_per_s": tps, "eval_tokens_per_s": parse_eval_tps(r.stderr + r.stdout),
                             "kv_type": kv, "n_generated": parse_eval_count(r.stderr + r.stdout),
                             "wall_s": time.perf_counter() - t0, "match": None, "stdout": r.stdout})
                answers[name] = rows[-1]["answer"] = answer_text(r.stdout, prompt_forms)
        finally:
            os.unlink(pf)
        # Does llama-lookup keep llama.cpp's own plain answer (same cache)? Not always: with an
        # f16 cache its batches take other attention kernels than one-row decodes.
        plain, lookup = answers.get("llama.cpp:completion"), answers.get("llama.cpp:lookup")
        if plain is not None and lookup is not None:  # llama-lookup ran last: its record is the last
            rows[-1]["same_as_own_plain"] = same_answer(plain, lookup)
    return rows


def answer_text(stdout: str, prompt_forms: tuple[str, ...]) -> str | None:
    """The generated text in a llama.cpp tool's stdout, which echoes the prompt first (with its
    special tokens or without, per tool); None when the echo is not found."""
    out = stdout.lstrip()
    for p in prompt_forms:
        p = p.lstrip()
        if p and out.startswith(p):
            return _END.sub("", out[len(p):].rstrip())
    return None


def same_answer(a: str, b: str) -> bool:
    """Two greedy answers agree when the shorter begins the longer and they differ by a few
    tokens at most: the tools stop a token or two apart at the `-n` limit (llama-completion
    prints `-n` - 1 tokens, llama-lookup `-n` + 1) and llama-lookup prints the end token."""
    a, b = a.strip(), b.strip()
    short, long_ = sorted((a, b), key=len)
    return long_.startswith(short) and len(long_) - len(short) <= SLACK_CHARS


SLACK_CHARS = 64  # a few tokens' worth of text


def parse_eval_count(text: str) -> int | None:
    """Tokens decoded one by one, as llama.cpp counts them (its `N runs` / `decoded N tokens`)."""
    m = _DECODED.search(text)
    if m:
        return int(m.group(1))
    for line in text.splitlines():
        m = _EVAL.search(line)
        if m and "prompt eval time" not in line:
            return int(m.group(2))
    return None


def parse_gen_tps(text: str, n_max: int | None = None) -> float | None:
    """Generation tokens/s counted as edgespec counts its own: the answer's tokens after the
    first (which comes with the prompt's logits), end-of-generation not counted, over the time
    from the first token to the end. llama.cpp counts more over the same decodes:
    llama-lookup's `decoded N tokens` holds the first token and the end-of-generation token
    (and runs to `n_max` + 1 tokens when no end comes); llama-completion's `N runs` holds the
    decode of the last text token, which only yields the end token. Both are brought to our
    count here (`n_max`: the -n they ran with), which matters on short answers (a 10-token
    answer: lookup +2 tokens, 20%). llama-completion's time is its `total time` less `prompt
    eval time` (the eval time it prints leaves out sampling and the loop around the decodes)."""
    m = _DECODED.search(text)
    if m:
        n, sec = int(m.group(1)), float(m.group(2))
        ended = n_max is not None and n <= n_max  # stopped on end-of-generation before the limit
        n -= 1 + int(ended)
        return n / sec if sec > 0 and n > 0 else None
    total = _TOTAL.search(text)
    prompt = _PROMPT.search(text)
    runs = parse_eval_count(text)
    if total and prompt and runs:
        sec = (float(total.group(1)) - float(prompt.group(1))) / 1e3
        runs -= int("[end of text]" in text)
        if sec > 0 and runs > 0:
            return runs / sec
    return parse_eval_tps(text)


def parse_eval_tps(text: str) -> float | None:
    """Decode tokens/s as llama.cpp prints it: llama-lookup's `decoded N tokens in X seconds`,
    else the `eval time = X ms / N runs` line (prompt eval excluded)."""
    m = _DECODED.search(text)
    if m:
        n, sec = int(m.group(1)), float(m.group(2))
        return n / sec if sec > 0 else None
    for line in text.splitlines():
        if "prompt eval time" in line:
            continue
        m = _EVAL.search(line)
        if m:
            ms, runs = float(m.group(1)), int(m.group(2))
            return runs / (ms / 1e3) if ms > 0 else None
    return None
