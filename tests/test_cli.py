"""The command line as a user meets it: one clear line and a non-zero exit for bad input."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time


from edgespec.models import resolve

SMOL = "smollm2-135m-instruct:q4_0"


def es(*args, env=None, timeout=300, input=None):
    return subprocess.run(
        [sys.executable, "-m", "edgespec", *args], capture_output=True, text=True, timeout=timeout,
        env={**os.environ, **(env or {})}, input=input,
    )


def assert_one_line_error(r, *needles):
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("edgespec: error:")
    for n in needles:
        assert n in lines[0], lines[0]


def test_missing_model_path():
    assert_one_line_error(es("run", "-m", "/nonexistent/model.gguf", "-p", "hi"), "not found")


def test_not_a_gguf(tmp_path):
    f = tmp_path / "notes.gguf"
    f.write_text("hello, I am not a model")
    assert_one_line_error(es("run", "-m", str(f), "-p", "hi"), "not a GGUF")


def test_truncated_gguf(tmp_path):
    src = resolve(SMOL, quiet=True)
    f = tmp_path / "half.gguf"
    with open(src, "rb") as a, open(f, "wb") as b:
        b.write(a.read(4 << 20))
    assert_one_line_error(es("run", "-m", str(f), "-p", "hi"), "truncated or corrupt")


def test_draft_with_other_vocabulary():
    resolve("gemma3-270m", quiet=True)
    r = es("run", "-m", SMOL, "-md", "gemma3-270m", "--spec", "draft", "-p", "hi", "-n", "4")
    assert_one_line_error(r, "vocabulary", "262144", "49152")


def test_prompt_longer_than_context():
    r = es("run", "-m", SMOL, "-c", "256", "-p", "word " * 600, "-n", "4")
    assert_one_line_error(r, "does not fit", "context of 256")


def test_unknown_catalog_name():
    assert_one_line_error(es("run", "-m", "llama-9000b", "-p", "hi"), "unknown model")
    assert_one_line_error(es("pull", "smollm2-135m-instruct:q3_k"), "unknown variant")


def test_spec_draft_without_draft_model():
    assert_one_line_error(es("run", "-m", SMOL, "--spec", "draft", "-p", "hi"), "-md")


def test_checksum_mismatch_in_cache_is_refetched(tmp_path):
    src = resolve("smollm2-135m-instruct", quiet=True)
    cache = tmp_path / "cache"
    (cache / "models").mkdir(parents=True)
    bad = cache / "models" / src.name
    shutil.copyfile(src, bad)
    with open(bad, "r+b") as f:
        f.seek(1 << 20)
        f.write(b"\0" * 64)
    r = es("pull", "smollm2-135m-instruct", env={"EDGESPEC_CACHE": str(cache)})
    assert r.returncode == 0, r.stderr
    assert "does not match its sha256" in r.stderr
    assert bad.read_bytes() == src.read_bytes()
    assert not list((cache / "models").glob(".*tmp*"))  # nothing half-written left behind


def test_json_output():
    r = es("run", "-m", SMOL, "-p", "Say hello.", "-n", "12", "--json", "--spec", "lookahead")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out) == {"text", "token_ids", "stats"}
    assert 0 < len(out["token_ids"]) <= 12
    for key in ("n_drafted", "n_accept", "acceptance_rate", "mean_accepted_length", "tokens_per_s", "n_prompt"):
        assert key in out["stats"]


def test_stdin_prompt_and_stats_line():
    r = es("run", "-m", SMOL, "-n", "8", "--spec", "none", input="Name a colour.")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()
    assert "tok/s" in r.stderr


def test_ctrl_c_keeps_what_was_produced():
    # A runner that starts jobs in the background (`cmd &`) hands them SIGINT ignored, and Python
    # then keeps ignoring it: give the child the default disposition, as a terminal would.
    p = subprocess.Popen(
        [sys.executable, "-m", "edgespec", "run", "-m", SMOL, "-n", "4000", "-c", "4096", "--spec", "none",
         "-p", "Count from 1 to 1000, one number per line."],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    got = b""
    deadline = time.time() + 120
    while len(got) < 20 and time.time() < deadline:
        got += os.read(p.stdout.fileno(), 4096)
    p.send_signal(signal.SIGINT)
    rest, err = p.communicate(timeout=60)
    err = err.decode()
    assert p.returncode == 130
    assert "Traceback" not in err
    assert len(got) >= 20 and len(rest) > 0  # the final newline at least; nothing streamed is lost
    assert "stopped" in err and "tokens" in err


def test_models_lists_catalog():
    r = es("models")
    assert r.returncode == 0
    assert "smollm2-135m-instruct" in r.stdout and "gemma3-270m" in r.stdout and "cache:" in r.stdout


def test_quantize_command(tmp_path):
    out = tmp_path / "q8.gguf"
    r = es("quantize", SMOL, str(out), "q8_0")
    assert r.returncode == 0, r.stderr
    import gguf

    reader = gguf.GGUFReader(str(out))
    ftype = int(reader.fields["general.file_type"].parts[-1][0])
    assert ftype == gguf.LlamaFileType.MOSTLY_Q8_0
    kinds = {t.tensor_type for t in reader.tensors}
    assert gguf.GGMLQuantizationType.Q8_0 in kinds and gguf.GGMLQuantizationType.Q4_0 not in kinds


def test_prompt_file_that_is_not_utf8(tmp_path):
    f = tmp_path / "latin1.txt"
    f.write_bytes("café crème".encode("latin-1"))
    assert_one_line_error(es("run", "-m", SMOL, "-f", str(f)), "not UTF-8")


def test_bad_flags_get_one_line_each():
    for args, needle in [(["--top-p", "2"], "top_p"), (["--top-k", "-3"], "top_k"), (["-t", "-2"], "-t"),
                         (["--seed", "-2"], "seed"), (["--temp", "-1"], "temperature")]:
        assert_one_line_error(es("run", "-m", SMOL, "-p", "hi", *args), needle)


def test_seed_minus_one_is_random():
    r = es("run", "-m", SMOL, "-p", "Name a fruit.", "-n", "3", "--temp", "0.8", "--seed", "-1", "--json")
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["token_ids"]) >= 1


def test_bench_bad_arguments(tmp_path):
    assert_one_line_error(es("bench", "-m", SMOL, "--repeat", "0", "--parallel", "1"), "--repeat")
    f = tmp_path / "report"
    f.write_text("a file")
    assert_one_line_error(es("bench", "-m", SMOL, "--out", str(f)), "is a file")


def test_gguf_damage_is_named(tmp_path):
    import gguf

    src = resolve(SMOL, quiet=True)
    head = tmp_path / "head.gguf"
    with open(src, "rb") as a, open(head, "wb") as b:
        b.write(a.read(100))  # cut inside the metadata
    assert_one_line_error(es("run", "-m", str(head), "-p", "hi"), "truncated or corrupt")
    novocab = tmp_path / "novocab.gguf"
    w = gguf.GGUFWriter(str(novocab), "llama")
    w.add_tensor("token_embd.weight", __import__("numpy").zeros((4, 8), dtype="float32"))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert_one_line_error(es("run", "-m", str(novocab), "-p", "hi"), "no vocabulary")


def test_vocabularies_are_compared_token_by_token():
    import pytest

    from edgespec.errors import VocabMismatchError
    from edgespec.gguf_check import GGUFInfo, compare_vocab

    toks = tuple(b"t%d" % i for i in range(5000))
    a = GGUFInfo(None, "llama", 1, 5000, [toks])
    b = GGUFInfo(None, "llama", 1, 5000, [toks[:4321] + (b"other",) + toks[4322:]])
    compare_vocab(a, a)
    with pytest.raises(VocabMismatchError, match="at token 4321"):
        compare_vocab(a, b)


def test_kv_type_f16_says_what_it_costs():
    r = es("run", "-m", SMOL, "-p", "hi", "-n", "2", "--kv-type", "f16", "--spec", "none")
    assert r.returncode == 0, r.stderr
    assert "f16 KV cache" in r.stderr and "verifies one row at a time" in r.stderr


def test_kv_types_k_and_v():
    """-ctk/-ctv as llama.cpp spells them, --kv-type K/V, and one clear line for a bad type."""
    from edgespec.frontends.cli import build_parser, kv_setting
    from edgespec.frontends.options import options

    ap = build_parser()

    def kv(*flags):
        return kv_setting(options(ap.parse_args(["run", "-p", "x", *flags])).models)

    assert kv() == "q8_0/f16"
    assert kv("--kv-type", "f16") == "f16"
    assert kv("--kv-type", "q8_0/q8_0") == "q8_0"
    assert kv("-ctv", "q8_0") == "q8_0"
    assert kv("--kv-type", "f16", "-ctk", "q8_0") == "q8_0/f16"
    r = es("run", "-p", "hi", "--kv-type", "q8_0/q5_1")
    assert r.returncode == 2 and "unknown KV cache type 'q5_1'" in r.stderr


def test_registry_is_the_one_list_of_methods():
    """The CLI's choices, the README's table and the chat UI's switch come from `methods`."""
    import re
    from pathlib import Path

    from edgespec import methods
    from edgespec.frontends.cli import build_parser

    spec = next(a for a in build_parser()._subparsers._group_actions[0].choices["run"]._actions if a.dest == "spec")
    assert list(spec.choices) == methods.names()
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    table = readme[readme.index("## Methods"):readme.index("## Commands")]
    assert re.findall(r"^\| `(\w+)`", table, re.M) == methods.names()
    assert methods.multi_sequence() == ["none", "ngram", "lookahead", "auto"]


def test_readme_and_docs_cover_every_command():
    """The README lists every command in one line each, in the CLI's order; every flag of every
    command is documented under docs/; every document the README links to exists."""
    import re
    from pathlib import Path

    from edgespec.frontends.cli import build_parser

    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text()
    subs = build_parser()._subparsers._group_actions[0].choices
    table = readme[readme.index("## Commands"):readme.index("## Measured here")]
    assert re.findall(r"^\| `edgespec (\w+)`", table, re.M) == list(subs)
    docs = {p.name: p.read_text() for p in (root / "docs").glob("*.md")}
    reference = docs["commands.md"] + docs["serving.md"] + docs["heads.md"]
    for name in subs:                           # a section per command
        assert re.search(rf"^## `edgespec {name}[ `]", reference, re.M) or \
            re.search(rf"^## .*`edgespec {name}[ `]", docs["commands.md"], re.M), name
    everything = "\n".join(docs.values())
    for name, parser in subs.items():           # every flag, in one of its spellings
        for a in parser._actions:
            if a.option_strings and "-h" not in a.option_strings:
                assert any(re.search(r"(?<![\w-])" + re.escape(o) + r"(?![\w-])", everything)
                           for o in a.option_strings), (name, a.option_strings)
    for link in re.findall(r"\]\((docs/[^)#]+)", readme):
        assert (root / link).is_file(), link
    assert "![" in readme and (root / "docs" / "bench.png").is_file()


def test_core_never_imports_a_front_end():
    """Only the front ends (edgespec/frontends/, the entry point) import edgespec.frontends or the
    chat UI: the core, serving included, is used by them and never the other way round."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "edgespec"
    front = ("edgespec.frontends", "edgespec.tui")
    bad = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] == "frontends" or rel == Path("__main__.py"):
            continue
        pkg = ["edgespec", *rel.parts[:-1]]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                mod = ".".join(pkg[:len(pkg) - node.level + 1] + [node.module or ""]).rstrip(".") if node.level \
                    else node.module or ""
                names = [mod] + [f"{mod}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            if any(n == f or n.startswith(f + ".") for n in names for f in front):
                bad.append(f"{rel}:{node.lineno}")
    assert not bad, bad
