"""Hugging Face names: `org/repo[:quant]`, as llama.cpp's `-hf` spells them.

Resolved offline first, in the Hugging Face cache layout that huggingface_hub and llama.cpp's
`-hf` write (`models--org--repo/{blobs,snapshots/<commit>,refs/main}`), in every folder where one
of them may have put it (`hub_dirs`); else downloaded with huggingface_hub into its own cache
(`HF_HUB_CACHE`, `HF_HOME`: shared with llama.cpp and every other tool that reads it), where the
next run finds it. Nothing is copied: the snapshot's file is loaded where it lies.

The quant is matched case-insensitively against the GGUF file names (default Q4_K_M, what
llama.cpp's `-hf` takes); a file name (`org/repo:name.gguf`) picks that file. A split GGUF
(`name-00001-of-00003.gguf`) is loaded by its first part, with every part beside it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from ..errors import CatalogError

DEFAULT_QUANT = "Q4_K_M"
# a Hugging Face repo id with an optional quant or file name: Qwen/Qwen2.5-7B-Instruct-GGUF:Q4_K_M
REPO_RE = re.compile(r"^([A-Za-z0-9][\w.-]*)/([\w.-]+)(?::([\w.-]+))?$")
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.I)
_QUANT = re.compile(r"(?:^|[-._])((?:i?q\d+(?:_[a-z0-9]+)*)|bf16|f16|f32|mxfp4(?:_[a-z0-9]+)*)$")
_TRUE = {"1", "on", "yes", "true"}


class SplitError(CatalogError):
    """A split GGUF with parts missing."""


def offline() -> bool:
    """Whether huggingface_hub is told to stay offline (HF_HUB_OFFLINE, as it reads it)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def split_part(name: str) -> tuple[int, int] | None:
    """(part, parts) of a split GGUF's file name (`-00002-of-00003.gguf`), else None."""
    m = _SPLIT.search(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def quant_of(name: str) -> str | None:
    """The quant a GGUF's file name says (`...-Q4_K_M.gguf`, `model.q8_0.gguf`), upper case, or None."""
    stem = _SPLIT.sub(".gguf", Path(name).name)
    stem = stem[:-5] if stem.lower().endswith(".gguf") else stem
    m = _QUANT.search(stem.lower())
    return m.group(1).upper() if m else None


def is_model_file(name: str) -> bool:
    """A GGUF that may hold a language model: not a vision projector (mmproj) or an imatrix."""
    base = Path(name).name.lower()
    return base.endswith(".gguf") and not base.startswith(("mmproj", "imatrix"))


def pick(files: list[str], want: str | None, repo: str, where: str = "") -> list[str]:
    """The files (relative names) to load for quant or file name `want` (None: the default,
    Q4_K_M, else the only quant there is): a split GGUF's parts in order, else one file. Raises a
    one-line error listing the quants `files` hold when none matches or several do."""
    models = sorted(f for f in files if is_model_file(f))
    if want is not None and want.lower().endswith(".gguf"):
        hits = [f for f in models if Path(f).name.lower() == want.lower()]
    else:
        q = (want or DEFAULT_QUANT).upper()
        hits = [f for f in models if quant_of(f) == q]
        if not hits and want is None and len(quants(models)) == 1:
            hits = models  # no Q4_K_M, one quant: that one (a repo of a single file)
    firsts = [f for f in hits if (split_part(f) or (1, 1))[0] == 1]
    if len(firsts) == 1:
        first = firsts[0]
        sp = split_part(first)
        if sp is None:
            return [first]
        parts = [_SPLIT.sub(f"-{i:05d}-of-{sp[1]:05d}.gguf", first) for i in range(1, sp[1] + 1)]
        missing = [p for p in parts if p not in files]
        if missing:
            raise SplitError(f"{repo}{where}: split GGUF {Path(first).name} lacks {len(missing)} of its "
                               f"{sp[1]} parts ({Path(missing[0]).name} ...)")
        return parts
    label = want or DEFAULT_QUANT
    if firsts:
        raise CatalogError(f"{repo}{where} has several GGUF files for {label}: "
                           f"{', '.join(Path(f).name for f in firsts)}; name one: -m {repo}:FILE.gguf")
    have = quants(models)
    listed = ", ".join(have) if have else "no GGUF files"
    hint = f" (name one: -m {repo}:{have[0]})" if have else ""
    raise CatalogError(f"{repo}{where} has no {label} GGUF; it has: {listed}{hint}")


def quants(files: list[str]) -> list[str]:
    """The quants named by these GGUF files, in a stable order."""
    return sorted({quant_of(f) or Path(f).name for f in files if is_model_file(f)})


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
    return _existing(cands)


def _existing(cands) -> list[Path]:
    out: list[Path] = []
    for c in cands:
        if c and Path(c).expanduser().is_dir() and Path(c).expanduser() not in out:
            out.append(Path(c).expanduser())
    return out


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


def snapshot(folder: Path) -> tuple[Path, dict[str, Path]] | None:
    """The snapshot a repo folder's refs/main names (else its newest) and its GGUF files
    present, by name relative to the snapshot (a link to a missing blob is not there)."""
    snaps = folder / "snapshots"
    if not snaps.is_dir():
        return None
    ref = folder / "refs" / "main"
    snap = None
    if ref.is_file():
        cand = snaps / ref.read_text().strip()
        snap = cand if cand.is_dir() else None
    if snap is None:
        dirs = sorted((d for d in snaps.iterdir() if d.is_dir()), key=lambda d: d.stat().st_mtime, reverse=True)
        if not dirs:
            return None
        snap = dirs[0]
    files = {p.relative_to(snap).as_posix(): p for p in sorted(snap.rglob("*.gguf")) if p.exists()}
    return snap, files


def find_cached(repo: str, want: str | None) -> Path | None:
    """The cached file for `repo:want` (a split GGUF's first part), or None where no hub folder
    has it. A snapshot without it is passed over (the next cache, or a download, may have it);
    offline, a split GGUF with parts missing is said as it is."""
    for folder in repo_folders(repo):
        snap = snapshot(folder)
        if snap is None:
            continue
        try:
            parts = pick(list(snap[1]), want, repo, " (in the Hugging Face cache)")
        except SplitError:
            if offline():
                raise
            continue
        except CatalogError:
            continue
        return snap[1][parts[0]]
    return None


def cached_quants(repo: str) -> list[str]:
    """What the cache holds of `repo`: its quants (for an offline error)."""
    out: set[str] = set()
    for folder in repo_folders(repo):
        snap = snapshot(folder)
        if snap is not None:
            out.update(quants(list(snap[1])))
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
        files = hf.list_repo_files(repo)
        parts = pick(files, want, repo, " on Hugging Face")
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
    return Path(paths[0])


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
