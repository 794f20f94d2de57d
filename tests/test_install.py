"""The install's native code is safe to load on every machine (issue 56): the sdist is fetched as a
file through the user's configured index and checked before anything reads it, the library searches
no folder outside its own, a build for another CPU or an older edgespec is refused with its reason,
a failed or skipped build is said once, every setting of the kernels' arithmetic keys the cost
cache, and each kernel patch is needed for what it claims (a control build without it differs)."""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import shutil
import subprocess
import sys
import tarfile
import threading
from pathlib import Path

import pytest

from edgespec import kernel_build, kernels, pypi_fetch

from synthetic_kquant import matmul_mismatches, tiny_q4_k_fixture
from test_kernels import _ROWS_CHILD

PROJECT = "demo-pkg"
NAME = "demo_pkg-1.0.tar.gz"


def _sdist(folder: Path) -> tuple[Path, str]:
    """A source distribution whose build would leave a marker, if anything ran it."""
    src = folder / "src"
    src.mkdir()
    (src / "setup.py").write_text("open('/tmp/edgespec-test-ran-setup', 'w').write('ran')\n")
    path = folder / NAME
    with tarfile.open(path, "w:gz") as t:
        t.add(src / "setup.py", arcname="demo_pkg-1.0/setup.py")
    return path, hashlib.sha256(path.read_bytes()).hexdigest()


def test_pip_options_are_read_as_pip_reads_them():
    opts = pypi_fetch.command_line_options(
        ["pip", "install", "-i", "https://a/simple", "--extra-index-url=https://b/simple", "-f/wheels",
         "--find-links", "file:///more", "--no-index", "."])
    assert opts == [("index-url", "https://a/simple"), ("extra-index-url", "https://b/simple"),
                    ("find-links", "/wheels"), ("find-links", "file:///more"), ("no-index", "1")]
    s = pypi_fetch.IndexSettings()
    for k, v in opts:
        pypi_fetch._apply(s, k, v)
    assert s.indexes() == [] and s.find_links == ["/wheels", "file:///more"]


def test_the_sdist_is_fetched_as_a_file_from_the_configured_places(tmp_path):
    """A find-links folder, a PEP 503 file:// index and a PEP 691 JSON index (with credentials)
    each serve the file; a wrong hash is refused and leaves nothing; nothing of the sdist runs."""
    sd, sha = _sdist(tmp_path)
    links = tmp_path / "links"
    links.mkdir()
    shutil.copy(sd, links / NAME)
    got = pypi_fetch.fetch(PROJECT, NAME, sha, tmp_path / "out" / "a.tar.gz",
                           pypi_fetch.IndexSettings(no_index=True, find_links=[str(links)]))
    assert got.read_bytes() == sd.read_bytes()

    simple = tmp_path / "simple" / PROJECT
    simple.mkdir(parents=True)
    shutil.copy(sd, simple / NAME)
    (simple / "index.html").write_text(f'<html><body><a href="{NAME}#sha256={sha}">{NAME}</a></body></html>')
    s = pypi_fetch.IndexSettings(index_url=(tmp_path / "simple").as_uri())
    assert pypi_fetch.fetch(PROJECT, NAME, sha, tmp_path / "out" / "b.tar.gz", s).is_file()

    with pytest.raises(pypi_fetch.FetchError, match="sha256 does not match"):
        pypi_fetch.fetch(PROJECT, NAME, "0" * 64, tmp_path / "out" / "c.tar.gz", s)
    assert not (tmp_path / "out" / "c.tar.gz").exists()
    assert not [p for p in (tmp_path / "out").iterdir() if p.name.startswith(".part-")]

    seen = {}

    class Index(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            seen.setdefault("auth", self.headers.get("Authorization"))
            if self.path == f"/simple/{PROJECT}/":
                body = json.dumps({"files": [{"filename": NAME, "url": f"/files/{NAME}",
                                              "hashes": {"sha256": sha}}]}).encode()
                ctype = "application/vnd.pypi.simple.v1+json"
            elif self.path == f"/files/{NAME}":
                body, ctype = sd.read_bytes(), "application/octet-stream"
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Index)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        s = pypi_fetch.IndexSettings(index_url=f"http://user:pw@127.0.0.1:{srv.server_port}/simple")
        assert pypi_fetch.fetch(PROJECT, NAME, sha, tmp_path / "out" / "d.tar.gz", s).is_file()
    finally:
        srv.shutdown()
    assert seen["auth"] == "Basic dXNlcjpwdw=="  # user:pw
    assert not Path("/tmp/edgespec-test-ran-setup").exists()


def test_offline_the_sdist_fetch_fails_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGESPEC_BUILD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    monkeypatch.delenv(kernel_build.SDIST_ENV, raising=False)
    with pytest.raises(kernel_build.BuildError) as e:
        kernel_build.fetch_sdist(lambda msg: None)
    assert "\n" not in str(e.value) and kernel_build.SDIST_ENV in str(e.value)
    monkeypatch.setenv(kernel_build.SDIST_ENV, str(tmp_path / "nothing.tar.gz"))
    with pytest.raises(kernel_build.BuildError, match="is not llama-cpp-python"):
        kernel_build.fetch_sdist(lambda msg: None)


def test_the_installed_library_searches_only_its_own_folder():
    lib = kernels.PACKAGE_DIR / kernel_build.LIB
    if os.environ.get("EDGESPEC_REQUIRE_KERNELS") != "1" and not lib.is_file():
        pytest.skip("no kernel build installed here")
    assert kernel_build.foreign_search_paths(lib) == [], kernel_build.search_paths(lib)
    readelf = shutil.which("readelf")
    if readelf:  # the same answer from binutils, where it is installed
        out = subprocess.run([readelf, "-d", str(lib)], capture_output=True, text=True).stdout
        assert "/tmp" not in out and "build/bin" not in out
    m = json.loads((kernels.PACKAGE_DIR / kernel_build.MANIFEST).read_text())
    assert m["format"] == kernel_build.MANIFEST_FORMAT
    assert set(m["isa"]) <= (kernel_build.cpu_flags() or set())
    if "avx2" in (kernel_build.cpu_flags() or set()):
        assert "avx2" in m["isa"]


def _lib_with_runpath(folder: Path, runpath: str) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc, "a C compiler is needed (llama-cpp-python's build needs one too)"
    (folder / "x.c").write_text("int edgespec_x(void) { return 1; }\n")
    out = folder / kernel_build.LIB
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(out), str(folder / "x.c"), f"-Wl,-rpath,{runpath}",
                    "-Wl,--enable-new-dtags"], check=True)
    return out


def test_a_build_that_does_not_fit_this_machine_is_refused(tmp_path):
    """Another CPU's instructions, an older manifest, a search path outside the library's folder:
    each refused with its reason in one line."""
    lib_dir = kernels._llama_lib_dir()
    ggml = next(p.name[len("libggml-base.so."):] for p in lib_dir.glob("libggml-base.so.*.*.*"))
    good = {"format": kernel_build.MANIFEST_FORMAT, "llama_cpp_python": kernel_build.LLAMA_CPP_PYTHON,
            "ggml": ggml, "patches": kernel_build.patch_digest(), "isa": []}
    _lib_with_runpath(tmp_path, "$ORIGIN")

    def why(**change) -> str:
        (tmp_path / kernel_build.MANIFEST).write_text(json.dumps({**good, **change}))
        return kernels._usable(tmp_path, lib_dir)

    assert kernel_build.search_paths(tmp_path / kernel_build.LIB) == ["$ORIGIN"]
    assert why() == ""
    assert "this CPU lacks" in why(isa=["avx2", "edgespec_no_such_extension"])
    assert "older edgespec" in why(format=1)
    assert "skipped" in why(error="EDGESPEC_KERNELS_BUILD=0", skipped=True)
    _lib_with_runpath(tmp_path, "/tmp/edgespec-kernels-XXXX/build/bin:")
    assert kernel_build.foreign_search_paths(tmp_path / kernel_build.LIB) == ["/tmp/edgespec-kernels-XXXX/build/bin", ""]
    assert "outside its own folder" in why()


def test_the_newest_usable_build_is_tried_first(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for folder, at in ((a, 100), (b, 200)):
        folder.mkdir()
        (folder / kernel_build.MANIFEST).write_text(json.dumps({"built_at": at}))
    assert kernels._newest_first([a, b]) == [b, a]


def test_a_failed_build_is_said_once(tmp_path, monkeypatch):
    monkeypatch.setattr(kernels, "PACKAGE_DIR", tmp_path / "pkg")
    monkeypatch.setattr(kernels, "cache_dir", lambda: tmp_path / "cache")
    monkeypatch.delenv(kernels.ENV, raising=False)
    kernel_build.record_failure(tmp_path / "pkg", kernel_build.BuildError("cannot fetch the llama.cpp source"))
    monkeypatch.setattr(kernels, "_state", {"kernels": "stock", "why": kernels._usable(tmp_path / "pkg", tmp_path)})
    first = kernels.build_notice()
    assert "cannot fetch the llama.cpp source" in first and "edgespec kernels --build" in first
    assert "\n" not in first
    assert kernels.build_notice() == ""
    monkeypatch.setattr(kernels, "_state", {"kernels": "batch-invariant", "why": "", "patches": "x", "path": ""})
    assert kernels.build_notice() == ""


def test_every_arithmetic_setting_keys_the_cost_cache():
    """A probe read at the default tiled floor is never reused when the user's environment sets
    another: the cost cache's key (kernels.tag) differs."""
    code = "from edgespec import kernels; print(kernels.tag())"
    env = {k: v for k, v in os.environ.items() if k not in kernels.ARITHMETIC_ENV}
    tags = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True,
                           env={**env, **extra}).stdout.strip()
            for extra in ({}, {kernels.TILED_MIN_ROWS_ENV: "8"}, {"GGML_CPU_TILED_MM": "0"},
                          {"GGML_CPU_DISABLE_FUSION": "1"})]
    assert len(set(tags)) == 4, tags


tiny_q4_k = pytest.fixture(scope="module", name="tiny_q4_k")(tiny_q4_k_fixture)


def _cached_build(chosen: list[Path], cmake_env: str | None = None, prefix: str = "") -> Path:
    """A build of the patches `chosen` (with `cmake_env` as CMAKE_ARGS where given), kept in the build
    cache under its patch set and CMake arguments (one minute on 2 cores, once)."""
    env = {**os.environ, "CMAKE_ARGS": cmake_env} if cmake_env is not None else None
    args = kernel_build.cmake_args(env)
    key = hashlib.sha256((kernel_build.patch_digest(chosen) + "|" + " ".join(args)).encode())
    dest = kernel_build.cache_dir() / "controls" / (prefix + key.hexdigest()[:16])
    if not (dest / kernel_build.LIB).is_file():
        with pytest.MonkeyPatch.context() as m:
            if cmake_env is not None:
                m.setenv("CMAKE_ARGS", cmake_env)
            kernel_build.build(dest, patch_files=chosen)
    return dest


def _control(without: str) -> Path:
    """A build of every patch but `without`."""
    return _cached_build([p for p in kernel_build.patches() if p.name != without])


# What an AVX2 laptop's install builds (no AVX-512): llama.cpp's own "haswell" CPU variant, less BMI2.
AVX2_ONLY = "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF"


def test_an_avx2_only_build_is_bit_identical_too(tiny_q4_k):
    """Laptops often lack AVX-512, and the patched kernels take other code there (Q6_K: vpmaddwd +
    vpaddd instead of vpdpwssd; the repacked Q4_K GEMM's AVX2 paths at 16 rows). A build with AVX2 and
    no AVX-512 (cached after the first) gives, product by product through ggml (scripts/kernel_bench.py
    --check), every output value of 1-8 and 16 rows the bits of the one-row product of its row, on the
    tiny model's repacked Q4_K and Q6_K tensors. Skipped only on a CPU without AVX2 or with no C
    compiler and CMake; under CI (CI set) a missing compiler fails instead."""
    if "avx2" not in (kernel_build.cpu_flags() or set()) or kernel_build.unsupported():
        pytest.skip("this CPU cannot run an AVX2 build")
    missing = [t for t in (os.environ.get("CC", "cc"), "cmake") if shutil.which(t) is None]
    if missing:
        if os.environ.get("CI"):
            pytest.fail(f"{', '.join(missing)} missing: CI must build the AVX2 kernels")
        pytest.skip(f"{', '.join(missing)} missing: cannot build the AVX2 kernels")
    folder = _cached_build(kernel_build.patches(), AVX2_ONLY, prefix="avx2-")
    isa = json.loads((folder / kernel_build.MANIFEST).read_text())["isa"]
    assert "avx2" in isa and not [f for f in isa if f.startswith("avx512")], isa
    for t in matmul_mismatches(tiny_q4_k, "avx2", folder, "1,2,3,4,5,6,7,8,16"):
        diff = t["diff"]
        assert set(diff) == {"1", "2", "3", "4", "5", "6", "7", "8", "16"}
        assert all(d == 0 for d in diff.values()), (t["name"], diff)


def _rows_with(model: Path, folder: Path) -> dict:
    r = subprocess.run([sys.executable, "-c", _ROWS_CHILD, str(model)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, kernels.ENV: str(folder)})
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    return {int(k): v for k, v in d["diff"].items()}


@pytest.mark.parametrize("patch, rows", [
    # the repacked Q4_K GEMM from 9 rows, and 0004-0005's several-row GEMV (2-8 rows), which sums in 0001's order
    ("0001-ggml-cpu-q4_K-gemv-accumulates-as-gemm.patch", range(2, 33)),
    ("0002-ggml-cpu-tiled-mm-min-rows.patch", range(8, 33)),  # the tiled Q6_K kernel
])
def test_each_patch_is_needed(patch, rows, tiny_q4_k, monkeypatch):
    """A control build with only this patch left out is loaded (it is the library the patch set's
    digest does not name, so the digest check is bypassed for it alone) and gives other bits than
    one-row decodes at the row counts the patch claims; the full build is exact there (test_kernels).
    0003-0011 change which kernel runs, not what it adds: without them batches stay exact, and their
    own test is the matrix products checked value by value (test_kernels, kernel_bench --check)."""
    if not kernels.batch_invariant():
        pytest.skip(f"the batch-invariant kernels are not loaded here: {kernels.info()['why']}")
    assert patch in [p.name for p in kernel_build.patches()]
    folder = _control(patch)
    m = json.loads((folder / kernel_build.MANIFEST).read_text())
    # loaded as the asked folder: the loader refuses other patch sets, so the control says it is the full set
    shadow = folder.parent / (folder.name + "-as-full")
    shadow.mkdir(exist_ok=True)
    shutil.copyfile(folder / kernel_build.LIB, shadow / kernel_build.LIB)
    (shadow / kernel_build.MANIFEST).write_text(json.dumps({**m, "patches": kernel_build.patch_digest(),
                                                             "built_at": 0}))
    diff = _rows_with(tiny_q4_k, shadow)
    assert all(diff[n] == 0.0 for n in range(1, min(rows))), diff
    assert any(diff[n] > 0.0 for n in rows), diff
