"""Hugging Face names: `org/repo[:quant]`, as llama.cpp's `-hf` spells them.

Resolved offline first, in the Hugging Face cache layout that huggingface_hub and llama.cpp's
`-hf` write (`models--org--repo/{blobs,snapshots/<commit>,refs/main}`), in every folder where one
of them may have put it (`hub_dirs`); else downloaded with huggingface_hub into its own cache
(`HF_HUB_CACHE`, `HF_HOME`: shared with llama.cpp and every other tool that reads it), where the
next run finds it. Nothing is copied: the snapshot's file is loaded where it lies.

The cache is read as data, not trusted: `refs/main` must hold a commit hash (40 hex digits, as
huggingface_hub writes it), and a snapshot's file, its links followed, must be a regular file
inside the repo's folder (`paths.store_problem`); anything else is one line. A downloaded file is
checked once against the Hub's hash of it (the LFS sha256), and the check recorded
(`checksums.verify_once`).

The quant is matched case-insensitively against the GGUF file names (`files.pick`: default
Q4_K_M, what llama.cpp's `-hf` takes); a file name (`org/repo:name.gguf`) picks that file. A split
GGUF (`name-00001-of-00003.gguf`) is loaded by its first part, with every part beside it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import CatalogError, ChecksumError
from .checksums import verify_once
from .files import SplitError, pick, quants
from .paths import MISSING, existing_dirs, read_small, real, store_problem

# a Hugging Face repo id with an optional quant or file name: Qwen/Qwen2.5-7B-Instruct-GGUF:Q4_K_M
REPO_RE = re.compile(r"^([A-Za-z0-9][\w.-]*)/([\w.-]+)(?::([\w.-]+))?$")
COMMIT_RE = re.compile(r"[0-9a-f]{40}")  # what huggingface_hub writes in refs/<revision>
_TRUE = {"1", "on", "yes", "true"}


def offline() -> bool:
    """Whether huggingface_hub is told to stay offline (HF_HUB_OFFLINE, as it reads it)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


# -- the cache on disk ----------------------------------------------------------------------

def hub_dirs() -> list[Path]:
    """Folders that may hold the Hugging Face cache layout, in llama.cpp's and huggingface_hub's
    order: LLAMA_CACHE, HF_HUB_CACHE, HUGGINGFACE_HUB_CACHE, HF_HOME/hub,
    XDG_CACHE_HOME/huggingface/hub, ~/.cache/huggingface/hub (those that exist, once each)."""
    env = os.environ.get
    cands = [env("LLAMA_CACHE"), env("HF_HUB_CACHE"), env("HUGGINGFACE_HUB_CACHE"),
             env("HF_HOME") and os.path.join(env("HF_HOME"), "hub"),
             env("XDG_CACHE_HOME") and os.path.join(env("XDG_CACHE_HOME"), "huggingface", "hub"),
             str(Path.home() / ".cache" / "huggingface" / "hub")]
    return existing_dirs(cands)


def repo_folder_name(repo: str) -> str:
    return "models--" + repo.replace("/", "--")


def repo_of(folder: Path) -> str | None:
    """`org/repo` of a cache folder `models--org--repo`, else None (datasets, spaces, others)."""
    name = folder.name
    if not name.startswith("models--") or name.count("--") < 2:
        return None
    return "/".join(name[len("models--"):].split("--", 1))


def repo_folders(repo: str) -> list[Path]:
    """The cache folders of `repo` in every hub folder (the Hub's names are case-insensitive)."""
    want = repo_folder_name(repo).lower()
    out = []
    for d in hub_dirs():
        exact = d / repo_folder_name(repo)
        if exact.is_dir():
            out.append(exact)
            continue
        try:
            out += [c for c in d.iterdir() if c.name.lower() == want and c.is_dir()]
        except OSError:
            continue
    return out


@dataclass(frozen=True)
class Snapshot:
    path: Path
    files: dict[str, Path]  # the GGUF files there, by name relative to the snapshot
    broken: dict[str, str] = field(default_factory=dict)  # the others: name -> what is wrong with it


def read_ref(folder: Path, revision: str = "main") -> str | None:
    """The commit `refs/<revision>` names, None where there is no such ref; raises one line
    where it holds anything but a commit hash (a path, `../..`: never followed)."""
    ref = folder / "refs" / revision
    if not ref.is_file():
        return None
    try:
        text = read_small(ref, 200).decode("ascii", "replace").strip()
    except (OSError, ValueError) as e:
        raise CatalogError(f"{folder}: cannot read refs/{revision} ({getattr(e, 'strerror', None) or e})") from None
    if not COMMIT_RE.fullmatch(text):
        raise CatalogError(f"{folder}: refs/{revision} holds {text[:60]!r}, not a commit hash; not followed")
    return text


def snapshot(folder: Path) -> Snapshot | None:
    """The snapshot a repo folder's refs/main names (else its newest) and its GGUF files present
    (a link to a missing blob is not there); a file that points out of the folder, loops, is
    no regular file or is empty is in `broken`. Raises one line for a refs/main that is no commit."""
    snaps = folder / "snapshots"
    if not snaps.is_dir():
        return None
    top = real(folder)
    commit = read_ref(folder)
    snap = None
    if commit is not None:
        cand = snaps / commit
        snap = cand if cand.is_dir() else None
    if snap is None:
        dirs = [d for d in snaps.iterdir() if d.is_dir() and _inside(d, top)]
        if not dirs:
            return None
        snap = max(dirs, key=lambda d: d.stat().st_mtime)
    files, broken = {}, {}
    for p in sorted(snap.rglob("*.gguf")):
        rel = p.relative_to(snap).as_posix()
        problem = store_problem(p, folder)
        if problem is None:
            files[rel] = p
        elif problem != MISSING:
            broken[rel] = problem
    return Snapshot(snap, files, broken)


def _inside(p: Path, top: Path | None) -> bool:
    target = real(p)
    return top is not None and target is not None and target.is_relative_to(top)


def find_cached(repo: str, want: str | None) -> Path | None:
    """The cached file for `repo:want` (a split GGUF's first part), or None where no hub folder
    has it. A snapshot without it is passed over (the next cache, or a download, may have it);
    offline, a split GGUF with parts missing is said as it is; a broken file or ref is one line."""
    for folder in repo_folders(repo):
        snap = snapshot(folder)
        if snap is None:
            continue
        try:
            parts = pick([*snap.files, *snap.broken], want, repo, " (in the Hugging Face cache)")
        except SplitError:
            if offline():
                raise
            continue
        except CatalogError:
            continue
        bad = next((p for p in parts if p in snap.broken), None)
        if bad is not None:
            raise CatalogError(f"{repo}: {bad} in the Hugging Face cache ({snap.path}): {snap.broken[bad]}; not used")
        return snap.files[parts[0]]
    return None


def cached_quants(repo: str) -> list[str]:
    """What the cache holds of `repo`: its quants (for an offline error)."""
    out: set[str] = set()
    for folder in repo_folders(repo):
        try:
            snap = snapshot(folder)
        except CatalogError:
            continue
        if snap is not None:
            out.update(quants(list(snap.files)))
    return sorted(out)


# -- download -------------------------------------------------------------------------------

def download(repo: str, want: str | None, quiet: bool = False) -> Path:
    """Download `repo:want` with huggingface_hub into its cache (HF_TOKEN honoured, one progress
    bar per file) and return the first part's path there. One-line errors: offline, no such or a
    gated repo, no such quant (listing the repo's quants, read from its file list)."""
    label = f"{repo}:{want}" if want else repo
    if offline():
        held = cached_quants(repo)
        has = f"; the cache holds {', '.join(held)} of it" if held else ""
        raise CatalogError(f"{label} is not in the Hugging Face cache ({', '.join(map(str, hub_dirs())) or 'none'})"
                           f"{has}, and HF_HUB_OFFLINE is set")
    try:
        import huggingface_hub as hf
        from huggingface_hub import errors
        from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
    except ImportError:
        raise CatalogError(f"{label}: downloading needs huggingface_hub (pip install huggingface_hub)") from None
    _reachable(label)
    try:
        hashes = {e.path: _hub_hash(e) for e in hf.list_repo_tree(repo, recursive=True) if hasattr(e, "blob_id")}
        parts = pick(list(hashes), want, repo, " on Hugging Face")
        was_off = are_progress_bars_disabled()
        if quiet:
            disable_progress_bars()
        try:
            paths = [hf.hf_hub_download(repo, f) for f in parts]
        finally:
            if quiet and not was_off:
                enable_progress_bars()
    except CatalogError:
        raise
    except errors.GatedRepoError:
        raise CatalogError(f"{repo} is gated on Hugging Face: accept its terms there and set HF_TOKEN") from None
    except errors.RepositoryNotFoundError:
        raise CatalogError(f"no model {repo} on Hugging Face (a private one needs HF_TOKEN)") from None
    except errors.HfHubHTTPError as e:
        raise CatalogError(f"cannot fetch {label} from Hugging Face: {_first_line(e)}") from None
    except Exception as e:  # no network (requests' or httpx's errors, by version), a full disk: one line
        raise CatalogError(f"cannot fetch {label} from Hugging Face (offline? set HF_HUB_OFFLINE=1 to use only "
                           f"the cache): {type(e).__name__}: {_first_line(e)}") from None
    for name, path in zip(parts, paths):
        verify_download(Path(path), hashes.get(name), f"{repo}:{name}")
    return Path(paths[0])


def _hub_hash(entry) -> str | None:
    """The Hub's hash of one file of a repo's tree: its LFS sha256, else git's object id."""
    lfs = getattr(entry, "lfs", None)  # huggingface_hub's BlobLfsInfo: a dataclass and a dict
    return (lfs or {}).get("sha256") or getattr(entry, "blob_id", None)


def verify_download(path: Path, expected: str | None, label: str) -> None:
    """A downloaded file checked against the Hub's hash, once (recorded); one that does not match
    is removed from the cache (its link and blob: the next run downloads it again) and refused."""
    if not expected:
        raise ChecksumError(f"{label}: the Hub lists no hash for it; not used")
    try:
        verify_once(path, expected, label)
    except OSError as e:
        raise CatalogError(f"{label}: cannot read the downloaded file {path} ({e.strerror or e})") from None
    except ChecksumError:
        blob = real(path)
        path.unlink(missing_ok=True)
        if blob is not None and blob.parent.name == "blobs":
            blob.unlink(missing_ok=True)
        raise


def _reachable(label: str) -> None:
    """Fail at once, in one line, where the Hub's host cannot be reached (no network), rather
    than after huggingface_hub's retries; behind a proxy, huggingface_hub is left to find out."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return
    url = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout=5).close()
    except OSError as e:
        raise CatalogError(f"{label} is in no local cache and {url.hostname} cannot be reached ({e.strerror or e}); "
                           "offline, name a model on disk (`edgespec models` lists them)") from None


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [""])[0][:200]
