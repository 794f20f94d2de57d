"""Models in other tools' stores, laid out as those tools lay them out in a temporary home: the
Hugging Face cache (huggingface_hub's and llama.cpp's -hf), an Ollama manifest and blob, an LM
Studio folder, each holding the embedded models' bytes (hard links where the file system allows,
nothing copied: a store's blob must be a file inside the store). Offline: nothing is downloaded
here, but from a stand-in for the Hub on 127.0.0.1.

Hostile stores (`hostile`): climbing and absolute Ollama digests, a blob linked out of its store,
a climbing `refs/main`, a GGUF whose architecture is a number, empty and truncated files, a symlink
loop, a FIFO: `edgespec models` lists each as one note, naming one is one error line, and `auto`
still answers beside them. Every command runs in a subprocess with a timeout, so an abort or a
hang fails the test instead of the suite.

The draft paired by vocabulary is a tiny random-weight llama with SmolLM2's tokenizer (a few MB,
written once): lossless decoding leaves the target's output unchanged whatever it drafts.
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import gguf
import numpy as np
import pytest

from edgespec.errors import CatalogError
from edgespec.models import CATALOG, cache_root, hub, resolve
from edgespec.models import files as gguf_files
from synthetic_mtp import _tokenizer_from

SMOL_REPO = "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF"
TINY_REPO = "edgespec-test/SmolLM2-vocab-tiny-GGUF"
Q15, Q05 = "Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF", "Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF"
LMS = "lmstudio-community/SmolLM2-135M-Instruct-GGUF"
STORE_ENV = ("HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "XDG_CACHE_HOME", "LLAMA_CACHE", "OLLAMA_MODELS")


def _sha(path: Path) -> str:
    marker = Path(f"{path}.verified")  # the cache's record of the file's sha256
    if marker.exists():
        return marker.read_text().split()[0]
    return hashlib.sha256(path.read_bytes()).hexdigest()


def place(src: Path, dst: Path) -> Path:
    """`src`'s bytes at `dst`: a hard link (no copy) where both are on one file system."""
    try:
        os.link(src.resolve(), dst)
    except OSError:
        shutil.copyfile(src, dst)
    return dst


def hf_layout(hub_dir: Path, repo: str, files: dict[str, Path], commit: str = "0" * 40) -> Path:
    """`repo` as huggingface_hub caches it: blobs/<sha256> (the real bytes, hard-linked),
    snapshots/<commit>/<name> -> ../../blobs/<sha256>, refs/main = <commit>."""
    folder = hub_dir / ("models--" + repo.replace("/", "--"))
    (folder / "blobs").mkdir(parents=True)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(commit)
    snap = folder / "snapshots" / commit
    snap.mkdir(parents=True)
    for name, src in files.items():
        sha = _sha(src)
        if not (folder / "blobs" / sha).exists():
            place(src, folder / "blobs" / sha)
        (snap / name).parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(folder / "blobs" / sha, (snap / name).parent), snap / name)
    return snap


def ollama_layout(root: Path, model: str, tag: str, blob_bytes: Path | bytes | None) -> str:
    """A manifest as `ollama pull` writes it (config, model and template layers) and the model
    blob blobs/sha256-<hex> (`blob_bytes` hard-linked, those bytes, or nothing: pointing nowhere)."""
    if isinstance(blob_bytes, Path):
        digest, size = _sha(blob_bytes), blob_bytes.stat().st_size
    else:
        data = blob_bytes if blob_bytes is not None else b"never written"
        digest, size = hashlib.sha256(data).hexdigest(), len(data)
    blobs = root / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    if isinstance(blob_bytes, Path):
        place(blob_bytes, blobs / f"sha256-{digest}")
    elif blob_bytes is not None:
        (blobs / f"sha256-{digest}").write_bytes(blob_bytes)
    manifest = {
        "schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": {"mediaType": "application/vnd.docker.container.image.v1+json", "digest": "sha256:" + "c" * 64,
                   "size": 485},
        "layers": [{"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}", "size": size},
                   {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "d" * 64,
                    "size": 182}],
    }
    write_manifest(root, model, tag, manifest)
    return f"sha256-{digest}"


def write_manifest(root: Path, model: str, tag: str, manifest: dict) -> None:
    path = root / "manifests" / "registry.ollama.ai" / "library" / model / tag
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(manifest))


def write_tiny_draft(path: Path, vocab_from: Path, arch_as_number: bool = False) -> Path:
    """A 1-layer llama (n_embd 64, tied output) with `vocab_from`'s tokenizer, in F16 (with
    `arch_as_number`: its general.architecture a uint32, which ggml's parser accepts)."""
    rng = np.random.default_rng(0)
    tok = _tokenizer_from(vocab_from)
    n_vocab = next(len(v) for k, v, _, _ in tok if k == "tokenizer.ggml.tokens")
    d, ff, arch = 64, 128, "llama"
    w = gguf.GGUFWriter(str(path), arch)
    if arch_as_number:
        w.kv_data[0]["general.architecture"] = gguf.GGUFValue(7, gguf.GGUFValueType.UINT32)
    for key, val in ((f"{arch}.context_length", 8192), (f"{arch}.embedding_length", d), (f"{arch}.block_count", 1),
                     (f"{arch}.feed_forward_length", ff), (f"{arch}.attention.head_count", 2),
                     (f"{arch}.attention.head_count_kv", 2), (f"{arch}.rope.dimension_count", 32),
                     (f"{arch}.vocab_size", n_vocab), ("general.file_type", 1)):
        w.add_uint32(key, val)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_float32(f"{arch}.rope.freq_base", 10000.0)
    for key, val, vtype, sub in tok:
        w.add_key_value(key, val, vtype, sub_type=sub) if sub is not None else w.add_key_value(key, val, vtype)

    def m(*shape):
        return (rng.standard_normal(shape) * 0.05).astype(np.float16)

    w.add_tensor("token_embd.weight", m(n_vocab, d))
    w.add_tensor("output_norm.weight", np.ones(d, np.float32))
    for name, shape in (("attn_q", (d, d)), ("attn_k", (d, d)), ("attn_v", (d, d)), ("attn_output", (d, d)),
                        ("ffn_gate", (ff, d)), ("ffn_up", (ff, d)), ("ffn_down", (d, ff))):
        w.add_tensor(f"blk.0.{name}.weight", m(*shape))
    for name in ("attn_norm", "ffn_norm"):
        w.add_tensor(f"blk.0.{name}.weight", np.ones(d, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """A home whose stores hold the embedded models, and the environment that finds them there
    (offline; edgespec's own cache has no models, so nothing comes from the catalog)."""
    smol = resolve("smollm2-135m-instruct", quiet=True)
    smol_q8 = resolve("smollm2-135m-instruct:q8_0", quiet=True)
    smol_q4 = resolve("smollm2-135m-instruct:q4_0", quiet=True)  # the suite's model: its cost curve is measured
    qwen15, qwen05 = (resolve(n, fetch=False, quiet=True) if _cached(n) else None
                      for n in ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"))
    base = tmp_path_factory.mktemp("stores")
    h = base / "home"
    hubd = h / ".cache" / "huggingface" / "hub"
    tiny = write_tiny_draft(base / "tiny-f16.gguf", smol)
    hf_layout(hubd, SMOL_REPO, {"smollm2-135m-instruct-q4_1.gguf": smol, "smollm2-135m-instruct-q8_0.gguf": smol_q8,
                                "smollm2-135m-instruct-q4_0.gguf": smol_q4})
    hf_layout(hubd, TINY_REPO, {"tiny-F16.gguf": tiny}, commit="1" * 40)
    if qwen15 and qwen05:
        hf_layout(hubd, Q15, {CATALOG["qwen2.5-coder-1.5b-instruct"].filename: qwen15}, commit="2" * 40)
        hf_layout(hubd, Q05, {CATALOG["qwen2.5-coder-0.5b-instruct"].filename: qwen05}, commit="3" * 40)
    oll = h / ".ollama" / "models"
    blob = ollama_layout(oll, "smollm2", "135m", smol)
    ollama_layout(oll, "broken", "latest", None)
    ollama_layout(oll, "corrupt", "latest", b"\x00" * 4096)
    lms = h / ".lmstudio" / "models" / LMS
    lms.mkdir(parents=True)
    os.symlink(smol_q8, lms / "SmolLM2-135M-Instruct-Q8_0.gguf")  # LM Studio's `lms import -L`: a link is fine
    cache = base / "edgespec-cache"
    (cache / "models").mkdir(parents=True)
    os.symlink(cache_root() / "costs.json", cache / "costs.json")  # the suite's measured curves, shared
    env = {k: v for k, v in os.environ.items() if k not in STORE_ENV}
    env.update(HOME=str(h), EDGESPEC_CACHE=str(cache), HF_HUB_OFFLINE="1")
    return {"env": env, "smol": smol, "smol_q8": smol_q8, "smol_q4": smol_q4, "tiny": tiny, "oll": oll, "blob": blob,
            "qwen": bool(qwen15 and qwen05), "hub": hubd}


def _cached(name):
    from edgespec.models import is_cached

    return is_cached(name)


@pytest.fixture
def in_home(home, monkeypatch):
    for k in STORE_ENV:
        monkeypatch.delenv(k, raising=False)
    for k in ("HOME", "EDGESPEC_CACHE", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(k, home["env"][k])
    return home


def es(home, *args, timeout=300):
    return subprocess.run([sys.executable, "-m", "edgespec", *args], capture_output=True, text=True,
                          timeout=timeout, env=home["env"])


def one_line_error(r, *needles):
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("edgespec: error:"), r.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def test_each_store_resolves_offline_in_place(in_home):
    h = in_home
    hf = resolve(f"{SMOL_REPO}:q8_0")  # the quant matched case-insensitively
    assert hf.is_symlink() and "snapshots" in hf.parts and hf.samefile(h["smol_q8"])
    assert resolve(SMOL_REPO.lower() + ":Q4_1").samefile(h["smol"])  # the Hub's names: any case
    assert resolve("ollama:smollm2:135m") == h["oll"] / "blobs" / h["blob"]
    assert resolve("ollama:library/smollm2:135m").samefile(h["smol"])
    for spec in (f"lmstudio:{LMS}:Q8_0", "lmstudio:SmolLM2-135M-Instruct-Q8_0.gguf",
                 f"lmstudio:{LMS}/SmolLM2-135M-Instruct-Q8_0.gguf", f"{LMS}:Q8_0"):  # the last: no HF cache has it
        p = resolve(spec)
        assert p.samefile(h["smol_q8"]) and ".lmstudio" in p.parts, spec
    assert resolve(TINY_REPO).samefile(h["tiny"])  # no Q4_K_M, one quant: that one


def test_hf_cache_order_and_llamacpp_flat_files(in_home, tmp_path, monkeypatch):
    """LLAMA_CACHE is looked in first (its own -hf layout), and llama.cpp's old flat files."""
    first = tmp_path / "llama-cache"
    hf_layout(first, SMOL_REPO, {"SmolLM2-Q4_1.gguf": in_home["tiny"]})
    monkeypatch.setenv("LLAMA_CACHE", str(first))
    assert resolve(f"{SMOL_REPO}:Q4_1").samefile(in_home["tiny"])
    assert resolve(f"{SMOL_REPO}:Q8_0").samefile(in_home["smol_q8"])  # not there: the next cache
    flat = tmp_path / "flat"
    flat.mkdir()
    os.symlink(in_home["tiny"], flat / "acme_Tiny-GGUF_tiny-q4_k_m.gguf")
    monkeypatch.setenv("LLAMA_CACHE", str(flat))
    assert resolve("acme/Tiny-GGUF").samefile(in_home["tiny"])


def test_missing_quant_and_broken_stores_are_one_line(in_home):
    h = in_home
    r = es(h, "run", "-m", f"{SMOL_REPO}:Q5_K_M", "-p", "hi", "-n", "2")
    one_line_error(r, "Q5_K_M", "Q4_0, Q4_1, Q8_0", "HF_HUB_OFFLINE")
    one_line_error(es(h, "run", "-m", "ollama:broken", "-p", "hi"), "ollama:broken:latest", "blobs/sha256-",
                   "not there")
    one_line_error(es(h, "run", "-m", "ollama:corrupt", "-p", "hi"), "not a GGUF")
    one_line_error(es(h, "run", "-m", "ollama:nosuch:7b", "-p", "hi"), "no Ollama manifest")
    one_line_error(es(h, "pull", "lmstudio:nobody/nothing"), "LM Studio")


def test_quants_read_from_a_repo_file_list():
    """What the Hub's file list says: the default quant, a named one, a split GGUF, and the
    one-line error naming the quants a repo has."""
    files = ["README.md", "Llama-3.2-3B-Instruct-Q4_K_M.gguf", "Llama-3.2-3B-Instruct-Q8_0.gguf",
             "Llama-3.2-3B-Instruct-IQ4_XS.gguf", "mmproj-F16.gguf",
             "Q6_K/Llama-3.2-3B-Instruct-Q6_K-00001-of-00002.gguf", "Q6_K/Llama-3.2-3B-Instruct-Q6_K-00002-of-00002.gguf"]
    assert gguf_files.pick(files, None, "r/x") == ["Llama-3.2-3B-Instruct-Q4_K_M.gguf"]
    assert gguf_files.pick(files, "iq4_xs", "r/x") == ["Llama-3.2-3B-Instruct-IQ4_XS.gguf"]
    assert gguf_files.pick(files, "Q6_K", "r/x") == files[-2:]
    with pytest.raises(CatalogError, match=r"r/x has no Q5_K_M GGUF; it has: IQ4_XS, Q4_K_M, Q6_K, Q8_0"):
        gguf_files.pick(files, "Q5_K_M", "r/x")
    with pytest.raises(gguf_files.SplitError, match="lacks 1 of its 2 parts"):
        gguf_files.pick(files[:-1], "Q6_K", "r/x")


def test_split_gguf_in_the_cache(in_home, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    names = [f"Big-Q4_K_M-0000{i}-of-00002.gguf" for i in (1, 2)]
    snap = hf_layout(tmp_path, "acme/Big-GGUF", {names[0]: in_home["smol"]})
    with pytest.raises(gguf_files.SplitError, match="lacks 1 of its 2 parts"):
        resolve("acme/Big-GGUF")
    place(in_home["smol"], snap / names[1])  # a file in the snapshot itself, as on a system without links
    assert resolve("acme/Big-GGUF") == snap / names[0]  # the first part; llama.cpp finds the others beside it


def test_models_lists_every_store_with_vocabulary_and_pairs(home, tmp_path):
    (tmp_path / "notes.gguf").write_text("not a model")
    os.symlink(home["smol"], tmp_path / "mine.gguf")
    r = es(home, "models", "--json", "--dir", str(tmp_path))
    assert r.returncode == 0, r.stderr
    rows = {m["name"]: m for m in json.loads(r.stdout)["models"]}
    smol_names = [f"{SMOL_REPO}:Q4_1", f"{SMOL_REPO}:Q8_0", "ollama:smollm2:135m", f"lmstudio:{LMS}:Q8_0",
                  str(tmp_path / "mine.gguf")]
    for name in smol_names:
        assert rows[name]["n_vocab"] == 49152 and rows[name]["arch"] == "llama", name
        assert rows[name]["drafts"] == [f"{TINY_REPO}:F16"], name  # only the tiny one is clearly smaller
    assert len({rows[n]["vocab"] for n in smol_names + [f"{TINY_REPO}:F16"]}) == 1
    assert rows[f"{SMOL_REPO}:Q8_0"]["quant"] == "Q8_0" and rows["ollama:smollm2:135m"]["quant"] == "Q4_1"
    assert rows[f"{TINY_REPO}:F16"]["drafts"] == []
    assert {rows[n]["store"] for n in smol_names} == {"hf", "ollama", "lmstudio", "dir"}
    if home["qwen"]:
        assert rows[f"{Q15}:Q4_K_M"]["n_vocab"] == 151936
        assert rows[f"{Q15}:Q4_K_M"]["drafts"] == [f"{Q05}:Q4_K_M"] and rows[f"{Q05}:Q4_K_M"]["drafts"] == []
    assert "blobs/sha256-" in rows["ollama:broken:latest"]["note"]
    assert "not a GGUF" in rows["ollama:corrupt:latest"]["note"]
    assert "not a GGUF" in rows[str(tmp_path / "notes.gguf")]["note"]
    text = es(home, "models", "--dir", str(tmp_path))
    assert text.returncode == 0 and "Traceback" not in text.stderr
    notes = [ln for ln in text.stdout.splitlines() if ln.strip().startswith("note:")]
    assert len(notes) == 3 and all("\n" not in n for n in notes)
    assert f"{SMOL_REPO}:Q4_1  <-  {TINY_REPO}:F16" in text.stdout


def _git_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class _Hub(BaseHTTPRequestHandler):
    """A stand-in for the Hub's two endpoints huggingface_hub reads: a repo's file list and
    `resolve/` (HEAD for the commit, ETag and size, GET for the bytes)."""

    repo, commit, files, served = "acme/Tiny-GGUF", "a" * 40, {}, {}

    def log_message(self, *args):
        pass

    def _answer(self, body: bytes | None, headers=(), head=False):
        self.send_response(200 if body is not None else 404)
        for k, v in headers:
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body or b"")))
        self.end_headers()
        if body and not head:
            self.wfile.write(body)

    def _route(self, head: bool):
        path, files = self.path.split("?")[0], self.files
        if path.startswith(f"/api/models/{self.repo}/tree/"):
            listing = [{"type": "file", "path": n, "size": len(b), "oid": _git_oid(b),
                        **({"lfs": {"oid": hashlib.sha256(b).hexdigest(), "size": len(b), "pointerSize": 134}}
                           if n.endswith(".gguf") else {})}
                       for n, b in files.items()]
            return self._answer(json.dumps(listing).encode(), [("Content-Type", "application/json")], head)
        name = path.removeprefix(f"/{self.repo}/resolve/main/")
        if name in files:
            body = self.served.get(name, files[name])  # what the listing says, unless told to serve other bytes
            etag = f'"{hashlib.sha256(body).hexdigest()}"'
            return self._answer(body, [("X-Repo-Commit", self.commit), ("ETag", etag), ("X-Linked-Etag", etag),
                                       ("X-Linked-Size", str(len(body)))], head)
        self._answer(None, [("X-Error-Code", "RepoNotFound")])

    def do_GET(self):
        self._route(False)

    def do_HEAD(self):
        self._route(True)


def test_download_into_the_hf_cache(home, tmp_path):
    """In no cache: fetched with huggingface_hub (from a local stand-in for the Hub) into the
    Hugging Face cache, then found there offline; a quant or a repo the Hub lacks is one line."""
    tiny = home["tiny"].read_bytes()
    _Hub.files = {"tiny-Q4_K_M.gguf": tiny, "tiny-Q8_0.gguf": tiny, "README.md": b"# tiny"}
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    proxies = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")
    env = {k: v for k, v in home["env"].items() if k not in ("HF_HUB_OFFLINE", *proxies)}
    env.update(HOME=str(tmp_path), HF_ENDPOINT=f"http://127.0.0.1:{server.server_address[1]}")
    h = {"env": env}
    try:
        r = es(h, "pull", "acme/Tiny-GGUF")
        assert r.returncode == 0, r.stderr
        got = Path(r.stdout.strip())
        assert got == tmp_path / ".cache/huggingface/hub/models--acme--Tiny-GGUF/snapshots" / _Hub.commit / "tiny-Q4_K_M.gguf"
        assert got.read_bytes() == tiny
        one_line_error(es(h, "pull", "acme/Tiny-GGUF:Q5_K_M"), "has no Q5_K_M GGUF; it has: Q4_K_M, Q8_0")
        one_line_error(es(h, "pull", "acme/Other-GGUF"), "no model acme/Other-GGUF on Hugging Face")
        # bytes other than those the Hub's listing hashes: refused in one line, and not left in the cache
        _Hub.served = {"tiny-Q8_0.gguf": tiny[:-16] + b"\0" * 16}
        one_line_error(es(h, "pull", "acme/Tiny-GGUF:Q8_0"), "acme/Tiny-GGUF:tiny-Q8_0.gguf: ", "the Hub says")
        assert not (got.parent / "tiny-Q8_0.gguf").exists()
    finally:
        _Hub.served = {}
        server.shutdown()
    env["HF_HUB_OFFLINE"] = "1"
    assert es(h, "pull", "ACME/tiny-gguf:q4_k_m").stdout.strip() == str(got)


def test_auto_and_draft_take_the_vocabulary_pair(in_home):
    """Without -md: the smallest local model with the target's vocabulary (auto, draft, pearl);
    -md wins, -md none goes without; a target with no such model has none."""
    from edgespec.frontends.cli import _draft_choice
    from edgespec.frontends.options import ModelOptions

    def choice(model, draft=None, spec="auto"):
        m = ModelOptions(model, draft, 0, 0, 0, 0, 0, None, None, None, None, None, "auto", False)
        return _draft_choice(m, [spec])

    for spec in ("auto", "draft", "pearl"):
        assert choice(f"{SMOL_REPO}:Q8_0", spec=spec) == (f"{TINY_REPO}:F16", "same vocabulary")
    assert choice("ollama:smollm2:135m")[0] == f"{TINY_REPO}:F16"
    assert choice(f"{SMOL_REPO}:Q8_0", spec="lookahead") == (None, "")
    assert choice(f"{SMOL_REPO}:Q8_0", "none") == (None, "")
    assert choice(f"{SMOL_REPO}:Q8_0", "x.gguf") == ("x.gguf", "-md")
    assert choice(TINY_REPO) == (None, "")  # nothing smaller shares its vocabulary
    if in_home["qwen"]:
        assert choice(f"{Q15}:Q4_K_M") == (f"{Q05}:Q4_K_M", "same vocabulary")


def _run(home, model, spec, n=24, *flags):
    r = es(home, "run", "-m", model, "--spec", spec, "-n", str(n), "--json", *flags, "-p",
           "Write a Python function that returns the sum of a list, then call it on [1, 2, 3].")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_draft_paired_by_vocabulary_is_lossless(home):
    """A target known only by its Hugging Face name drafts with the tiny model found beside it,
    and says so; its output is plain decoding's."""
    target = f"{SMOL_REPO}:Q4_0"
    # at least 2 tokens per step drafted: the random draft is rejected, and the output stays the same
    plain, drafted = _run(home, target, "none"), _run(home, target, "draft", 24, "--spec-draft-n-min", "2")
    st = drafted["stats"]
    assert st["drafter"] == "draft" and st["draft_model"] == f"{TINY_REPO}:F16"
    assert st["draft_model_why"] == "same vocabulary" and st["n_drafted"] > 0
    assert plain["stats"]["draft_model"] is None
    assert drafted["token_ids"] == plain["token_ids"]


@pytest.mark.slow
@pytest.mark.large
def test_qwen_from_the_hf_cache_drafts_with_its_05b(home):
    """The issue's case: both Qwen2.5-Coder models only in the Hugging Face cache layout (the 1.5B
    stays out of the default suite: `large`, run with EDGESPEC_TEST_LARGE=1, about 40 s)."""
    assert home["qwen"], "the Qwen2.5-Coder 1.5B and 0.5B are not in the cache: `edgespec pull` them first"
    target = f"{Q15}:Q4_K_M"
    # drafting forced (2 tokens a step at least): on 2 shared cores the sizing step may find that
    # the 0.5B does not pay and draft nothing, which would leave the pairing untested
    plain, drafted = _run(home, target, "none", 32), _run(home, target, "draft", 32, "--spec-draft-n-min", "2")
    st = drafted["stats"]
    assert st["draft_model"] == f"{Q05}:Q4_K_M" and st["draft_model_why"] == "same vocabulary"
    assert st["n_drafted"] > 0 and st["n_accept"] > 0
    assert drafted["token_ids"] == plain["token_ids"]


# -- hostile stores -------------------------------------------------------------------------------

EVIL = "acme/Evil-GGUF"
HOSTILE_LMS = "hostile/files"


@pytest.fixture(scope="module")
def hostile(home, tmp_path_factory):
    """A home of its own: a good target and its tiny vocabulary draft in the Hugging Face cache,
    and beside them every kind of broken or hostile entry, each pointing at a real GGUF outside
    the store where it could (so that following it would load something)."""
    base = tmp_path_factory.mktemp("hostile")
    h, outside = base / "home", base / "outside"
    outside.mkdir()
    place(home["smol"], outside / "evil-x")  # what the climbing and absolute digests reach
    place(home["smol"], outside / "evil.gguf")  # what the climbing refs/main's "snapshot" holds
    hubd = h / ".cache" / "huggingface" / "hub"
    hf_layout(hubd, SMOL_REPO, {"smollm2-135m-instruct-q4_0.gguf": home["smol_q4"]})
    hf_layout(hubd, TINY_REPO, {"tiny-F16.gguf": home["tiny"]}, commit="1" * 40)
    snap = hf_layout(hubd, EVIL, {"evil-Q8_0.gguf": home["tiny"]}, commit="4" * 40)
    (snap.parents[1] / "refs" / "main").write_text(os.path.relpath(outside, snap.parent))  # climbs
    loose = hf_layout(hubd, "acme/Loose-GGUF", {"loose-Q8_0.gguf": home["smol_q4"]}, commit="5" * 40)
    os.symlink("loop-Q4_0.gguf", loose / "loop-Q4_0.gguf")  # a symlink loop
    os.symlink(outside / "evil.gguf", loose / "out-Q6_K.gguf")  # a snapshot link out of the repo's folder
    oll = h / ".ollama" / "models"
    ollama_layout(oll, "fine", "latest", home["smol"])
    layer = {"mediaType": "application/vnd.ollama.image.model", "size": home["smol"].stat().st_size}
    for model, digest in (("climb", os.path.relpath(outside, oll / "blobs") + "/evil:x"),  # blobs/../../../evil-x
                          ("absolute", f"{outside}/evil:x")):  # blobs / "/.../evil-x" is that absolute path
        write_manifest(oll, model, "latest", {"schemaVersion": 2, "layers": [{**layer, "digest": digest}]})
    linked = hashlib.sha256(b"linked").hexdigest()
    os.symlink(outside / "evil-x", oll / "blobs" / f"sha256-{linked}")  # a well-formed digest, its blob a link out
    write_manifest(oll, "linked", "latest", {"schemaVersion": 2, "layers": [{**layer, "digest": f"sha256:{linked}"}]})
    lms = h / ".lmstudio" / "models" / HOSTILE_LMS
    lms.mkdir(parents=True)
    write_tiny_draft(lms / "arch-number.gguf", home["smol"], arch_as_number=True)
    (lms / "empty.gguf").write_bytes(b"")
    (lms / "truncated.gguf").write_bytes(home["tiny"].read_bytes()[:3000])
    os.symlink("loop.gguf", lms / "loop.gguf")
    os.mkfifo(lms / "fifo.gguf")
    env = {**home["env"], "HOME": str(h)}
    return {"env": env, "lms": lms, "outside": outside}


def _note_lines(stdout: str) -> dict[str, str]:
    """`edgespec models`' notes, by the name each is about."""
    notes = [ln.strip().removeprefix("note: ") for ln in stdout.splitlines() if ln.strip().startswith("note:")]
    return {n.split(": ", 1)[0]: n.split(": ", 1)[1] for n in notes}


def test_models_lists_each_broken_entry_on_one_line(hostile):
    r = es(hostile, "models", timeout=120)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    notes = _note_lines(r.stdout)
    lms = f"lmstudio:{HOSTILE_LMS}"
    expected = {
        "ollama:climb:latest": "not sha256:<64 hex digits>", "ollama:absolute:latest": "not sha256:<64 hex digits>",
        "ollama:linked:latest": "points out of its store", EVIL: "not a commit hash",
        "acme/Loose-GGUF:loop-Q4_0.gguf": "a symlink loop", "acme/Loose-GGUF:out-Q6_K.gguf": "points out of its store",
        f"{lms}:arch-number.gguf": "general.architecture is a uint32", f"{lms}:empty.gguf": "an empty file",
        f"{lms}:truncated.gguf": "truncated or corrupt", f"{lms}:loop.gguf": "a symlink loop",
        f"{lms}:fifo.gguf": "not a regular file",
    }
    for name, why in expected.items():
        assert name in notes and why in notes[name], (name, notes.get(name), r.stdout)
    assert len(notes) == len(expected), notes
    for good in (f"{SMOL_REPO}:Q4_0", f"{TINY_REPO}:F16", "acme/Loose-GGUF:Q8_0", "ollama:fine:latest"):
        assert any(ln.split()[:1] == [good] for ln in r.stdout.splitlines()), (good, r.stdout)
    listed = [ln for ln in r.stdout.splitlines() if not ln.strip().startswith("note:")]
    assert not any(str(hostile["outside"]) in ln for ln in listed)  # what they point at is never listed as a model


def test_hostile_names_refused_in_one_line(hostile):
    """Named with -m: one `edgespec: error:` line, exit 2, whatever the store or file holds."""
    for spec, why in (("ollama:climb", "not sha256:<64 hex digits>"), ("ollama:absolute", "not followed"),
                      ("ollama:linked", "points out of its store"), (EVIL, "not a commit hash"),
                      ("acme/Loose-GGUF:Q6_K", "points out of its store"),
                      ("ollama:../../x", "not an Ollama model name")):
        one_line_error(es(hostile, "run", "-m", spec, "-p", "hi", "-n", "4", timeout=120), why)
    lms = hostile["lms"]
    for name, why in (("arch-number.gguf", "general.architecture is a uint32"), ("empty.gguf", "an empty file"),
                      ("truncated.gguf", "truncated or corrupt"), ("loop.gguf", "a symlink loop"),
                      ("fifo.gguf", "not a regular file")):
        one_line_error(es(hostile, "run", "-m", str(lms / name), "-p", "hi", "-n", "4", timeout=120), why)
        one_line_error(es(hostile, "run", "-m", f"lmstudio:{name}", "-p", "hi", "-n", "4", timeout=120), why)


def test_auto_answers_beside_hostile_stores(hostile):
    """`auto` without -md looks through every store for a draft: the broken entries are passed
    over, the tiny draft is taken, and the stats line names it."""
    r = es(hostile, "run", "-m", f"{SMOL_REPO}:Q4_0", "-p", "Say hi.", "-n", "4", timeout=300)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert r.stdout.strip()
    stats = [ln for ln in r.stderr.splitlines() if "tok/s" in ln]
    assert len(stats) == 1 and f"draft model {TINY_REPO}:F16 (same vocabulary)" in stats[0], r.stderr


def test_digests_refs_and_names_are_checked():
    """The rules themselves: what a layer digest, a ref and a store name may be."""
    from edgespec.models import classify, stores

    assert stores.DIGEST_RE.fullmatch("sha256:" + "a" * 64) and stores.DIGEST_RE.fullmatch("sha256-" + "0" * 64)
    for bad in ("sha256:" + "A" * 64, "sha256:" + "a" * 63, "sha256:../../x", "/etc/passwd:x", "sha512:" + "a" * 64):
        assert not stores.DIGEST_RE.fullmatch(bad), bad
    assert classify("ollama:qwen2.5-coder:1.5b").store.name == "registry.ollama.ai/library/qwen2.5-coder"
    for bad in ("ollama:../../x", "ollama:a/../b", "ollama:x:..", "lmstudio:../x/y", "ollama:"):
        name = classify(bad)
        assert name.kind == "store" and name.problem, bad
        with pytest.raises(CatalogError):
            name.check()
    assert classify("smollm2-135m-instruct:q8_0").quant == "q8_0" and classify("./x.gguf").kind == "path"
    assert classify("nosuch-model").problem.startswith("unknown model")


def test_refs_must_name_a_commit(tmp_path):
    folder = tmp_path / "models--a--b"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text("c" * 40 + "\n")
    assert hub.read_ref(folder) == "c" * 40
    for bad in ("../../../etc", "/etc", "main", "c" * 39, "C" * 40):
        (folder / "refs" / "main").write_text(bad)
        with pytest.raises(CatalogError, match="not a commit hash"):
            hub.read_ref(folder)
    assert hub.read_ref(folder, "nosuch") is None


def test_dir_scan_checks_split_parts(home, tmp_path):
    """`--dir` groups a split GGUF's parts as the stores do: one with parts missing is a note."""
    from edgespec.models.stores import scan

    (tmp_path / "sub").mkdir()
    place(home["tiny"], tmp_path / "sub" / "Big-Q8_0-00001-of-00002.gguf")
    place(home["tiny"], tmp_path / "Whole-Q8_0-00001-of-00002.gguf")
    place(home["tiny"], tmp_path / "Whole-Q8_0-00002-of-00002.gguf")
    found = {f.name: f for f in scan((str(tmp_path),)) if f.store == "dir"}
    big = found[str(tmp_path / "sub" / "Big-Q8_0-00001-of-00002.gguf")]
    assert big.path is None and big.note == "split GGUF with 1 of its 2 parts"
    whole = found[str(tmp_path / "Whole-Q8_0-00001-of-00002.gguf")]
    assert whole.path is not None and whole.parts == (tmp_path / "Whole-Q8_0-00002-of-00002.gguf",)
    assert len(found) == 2


def test_download_checked_once_against_the_hubs_hash(tmp_path, monkeypatch):
    """A downloaded file against the Hub's hash: a match is recorded and not hashed again while
    the file stays as it was; a mismatch is one line; a changed file is hashed again."""
    from edgespec.errors import ChecksumError
    from edgespec.models import checksums

    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path / "cache"))
    f = tmp_path / "blobs" / "x"
    f.parent.mkdir()
    f.write_bytes(b"GGUF and some bytes")
    sha = hashlib.sha256(f.read_bytes()).hexdigest()
    checksums.verify_once(f, sha, "acme/x:x")
    assert checksums.verify_once(f, _git_oid(f.read_bytes()), "acme/x:x") is None  # a file kept in git: its oid
    hashed = []
    monkeypatch.setattr(checksums, "sha256_of", lambda p: hashed.append(p) or sha)
    checksums.verify_once(f, sha, "acme/x:x")
    assert hashed == []  # recorded: not hashed again
    monkeypatch.undo()
    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ChecksumError, match=r"^acme/x:x: .* has sha256 [0-9a-f]{64}, the Hub says 0{64}; not used"):
        checksums.verify_once(f, "0" * 64, "acme/x:x")
    f.write_bytes(b"GGUF and other bytes")  # changed on disk: its record no longer holds
    with pytest.raises(ChecksumError):
        checksums.verify_once(f, sha, "acme/x:x")
    with pytest.raises(ChecksumError, match="no usable hash"):
        checksums.verify_once(f, "../etc", "acme/x:x")
