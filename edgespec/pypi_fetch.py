"""One source distribution fetched from the package index the user's pip is configured for, as a
file: nothing of it runs, and it is kept only if it matches a pinned sha256.

Standard library only (setup.py uses it, through kernel_build, before edgespec's dependencies are
installed). `pip download` would do the finding, but for an sdist pip also prepares its metadata,
which installs and runs its build backend first (scikit-build-core, and from source under
`--no-binary :all:`, CMake itself: 20-30 minutes on 2 cores) before any hash is checked. So the
index is read here, the way pip reads it:

- where: pip's own configuration (`pip config list`: its config files and `PIP_*` variables), then
  the options of the `pip install`/`pip wheel` that runs this build, read from the process tree
  (`-i`/`--index-url`, `--extra-index-url`, `-f`/`--find-links`, `--no-index`), so that what the user
  typed reaches the fetch as it reaches pip;
- how: PEP 691 JSON or PEP 503 HTML simple pages, local find-links folders and pages, `file://`
  indexes; credentials in an index URL become a Basic authorization header;
- bounded: a timeout on every connection and a deadline on the whole download.
"""

from __future__ import annotations

import base64
import hashlib
import html.parser
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

PYPI_SIMPLE = "https://pypi.org/simple"
TIMEOUT = 30.0  # seconds, each connection and read
DEADLINE = 600.0  # seconds, one whole download


class FetchError(Exception):
    """The file could not be had; the message is one line."""


@dataclass
class IndexSettings:
    index_url: str = PYPI_SIMPLE
    extra_index_urls: list[str] = field(default_factory=list)
    find_links: list[str] = field(default_factory=list)
    no_index: bool = False

    def indexes(self) -> list[str]:
        return [] if self.no_index else [self.index_url] + self.extra_index_urls


def _split(value: str) -> list[str]:
    return [v for v in re.split(r"\s+", value.strip()) if v]


def _apply(s: IndexSettings, key: str, value: str) -> None:
    if key == "index-url":
        s.index_url = value
    elif key == "extra-index-url":
        s.extra_index_urls += [v for v in _split(value) if v not in s.extra_index_urls]
    elif key == "find-links":
        s.find_links += [v for v in _split(value) if v not in s.find_links]
    elif key == "no-index":
        s.no_index = value.strip().lower() in ("1", "true", "yes", "on")


def _clean_env() -> dict:
    # pip's isolated build environment (setup.py runs in one) hides the outer environment's packages
    # through PYTHONPATH/PYTHONNOUSERSITE: a child without them sees pip, with the user's settings.
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONNOUSERSITE", "PYTHONHOME")}


def pip_config() -> list[tuple[str, str]]:
    """(key, value) pairs from `pip config list`, files first, then `PIP_*` variables (pip's order)."""
    try:
        r = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                           timeout=60, env=_clean_env())
    except (OSError, subprocess.TimeoutExpired):
        return []
    files, env = [], []
    for line in r.stdout.splitlines():
        m = re.match(r"^([^=]+)\.([a-z-]+)='(.*)'$", line.strip())
        if not m or m.group(1) not in (":env:", "global", "install", "download", "wheel"):
            continue
        (env if m.group(1) == ":env:" else files).append((m.group(2), m.group(3)))
    return files + env


_OPTS = {"-i": "index-url", "--index-url": "index-url", "--extra-index-url": "extra-index-url",
         "-f": "find-links", "--find-links": "find-links"}


def command_line_options(argv: list[str]) -> list[tuple[str, str]]:
    """The index options of one pip command line, as (key, value) pairs."""
    out = []
    it = iter(range(len(argv)))
    for i in it:
        a = argv[i]
        if a == "--no-index":
            out.append(("no-index", "1"))
        elif a in _OPTS and i + 1 < len(argv):
            out.append((_OPTS[a], argv[i + 1]))
            next(it, None)
        elif "=" in a and a.split("=", 1)[0] in _OPTS:
            out.append((_OPTS[a.split("=", 1)[0]], a.split("=", 1)[1]))
        elif a.startswith("-i") and len(a) > 2 or a.startswith("-f") and len(a) > 2:
            out.append((_OPTS[a[:2]], a[2:]))
    return out


def _pip_ancestor_argv() -> list[str]:
    """The command line of the pip that runs this process (Linux: /proc), or []."""
    pid = os.getppid()
    for _ in range(12):
        if pid <= 1:
            return []
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return []
        words = [a.decode(errors="replace") for a in argv if a]
        if any(Path(w).name.startswith("pip") or w == "pip" for w in words[:3]) and \
                any(w in ("install", "wheel", "download") for w in words):
            return words
        pid = int(stat.rsplit(")", 1)[1].split()[1])
    return []


def settings(argv: list[str] | None = None) -> IndexSettings:
    """Where pip would look: its configuration, then the running pip's own options."""
    s = IndexSettings()
    for key, value in pip_config() + command_line_options(_pip_ancestor_argv() if argv is None else argv):
        _apply(s, key, value)
    return s


class _Links(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.links: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            href = dict(attrs).get("href")
            if href:
                self.links.append(href)


def _request(url: str, accept: str = "*/*") -> urllib.request.Request:
    parts = urllib.parse.urlsplit(url)
    headers = {"Accept": accept, "User-Agent": "edgespec-kernel-build"}
    if parts.username:
        cred = f"{urllib.parse.unquote(parts.username)}:{urllib.parse.unquote(parts.password or '')}"
        headers["Authorization"] = "Basic " + base64.b64encode(cred.encode()).decode()
        netloc = parts.hostname + (f":{parts.port}" if parts.port else "")
        url = urllib.parse.urlunsplit(parts._replace(netloc=netloc))
    return urllib.request.Request(url, headers=headers)


def _read_page(url: str) -> tuple[str, str]:
    """(body, content type) of an index page; a local folder's index.html for file:// folders."""
    if url.startswith("file:"):
        path = Path(urllib.request.url2pathname(urllib.parse.urlsplit(url).path))
        if path.is_dir():
            path = path / "index.html"
        if not path.is_file():
            return "", ""
        return path.read_text(errors="replace"), "text/html"
    req = _request(url, "application/vnd.pypi.simple.v1+json, text/html;q=0.1")
    with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
        return r.read(8 << 20).decode(errors="replace"), r.headers.get("Content-Type", "")


def _links_in(body: str, ctype: str, base: str) -> list[str]:
    if "json" in ctype:
        return [urllib.parse.urljoin(base, f["url"]) for f in json.loads(body).get("files", []) if "url" in f]
    p = _Links()
    p.feed(body)
    return [urllib.parse.urljoin(base, h) for h in p.links]


def candidates(filename: str, project: str, s: IndexSettings) -> list[str]:
    """URLs (or local paths) where pip's settings say `filename` can be had, in pip's order of
    looking: find-links first, then the indexes."""
    found: list[str] = []
    for loc in s.find_links:
        local = Path(urllib.request.url2pathname(urllib.parse.urlsplit(loc).path)) if loc.startswith("file:") \
            else Path(loc) if "://" not in loc else None
        if local is not None and local.is_dir():
            if (local / filename).is_file():
                found.append(str(local / filename))
            continue
        try:
            found += [u for u in _links_in(*_read_page(loc), loc) if _name(u) == filename]
        except (OSError, ValueError):
            continue
    for index in s.indexes():
        page = index.rstrip("/") + f"/{project}/"
        try:
            found += [u for u in _links_in(*_read_page(page), page) if _name(u) == filename]
        except (OSError, ValueError):
            continue
    return found


def _name(url: str) -> str:
    return urllib.parse.unquote(urllib.parse.urlsplit(url).path.rsplit("/", 1)[-1])


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _download(url: str, dest: Path, deadline: float) -> None:
    if "://" not in url or url.startswith("file:"):
        src = Path(urllib.request.url2pathname(urllib.parse.urlsplit(url).path)) if url.startswith("file:") \
            else Path(url)
        with open(src, "rb") as r, open(dest, "wb") as f:
            for chunk in iter(lambda: r.read(1 << 20), b""):
                f.write(chunk)
        return
    started = time.monotonic()
    with urllib.request.urlopen(_request(url.split("#", 1)[0]), timeout=TIMEOUT) as r, open(dest, "wb") as f:
        for chunk in iter(lambda: r.read(1 << 20), b""):
            f.write(chunk)
            if time.monotonic() - started > deadline:
                raise FetchError(f"the download from {urllib.parse.urlsplit(url).netloc} took over {deadline:.0f} s")


def fetch(project: str, filename: str, sha: str, dest: Path, s: IndexSettings | None = None,
          deadline: float = DEADLINE) -> Path:
    """`filename` of `project` into `dest` (a file path), verified against `sha`; each place pip's
    settings name is tried in turn. Raises FetchError with one line saying what was tried."""
    s = settings() if s is None else s
    urls = candidates(filename, project, s)
    if not urls:
        where = ", ".join(s.find_links + s.indexes()) or "nowhere (--no-index and no --find-links)"
        raise FetchError(f"{filename} was not found in {where}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    errors = []
    for url in urls:
        fd, tmp = tempfile.mkstemp(prefix=".part-", dir=dest.parent)
        os.close(fd)
        try:
            _download(url, Path(tmp), deadline)
            if sha256(Path(tmp)) != sha:
                errors.append(f"{_short(url)}: sha256 does not match the pinned one")
                continue
            os.replace(tmp, dest)
            return dest
        except (OSError, FetchError, ValueError) as e:
            errors.append(f"{_short(url)}: {e}")
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    raise FetchError(f"{filename} could not be fetched ({'; '.join(errors)})")


def _short(url: str) -> str:
    p = urllib.parse.urlsplit(url)
    return p.hostname or shlex.quote(url.split("#", 1)[0])
