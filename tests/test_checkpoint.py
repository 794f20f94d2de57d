"""Reading head checkpoints without torch: safetensors (bf16 too), torch zips, shards, refusals."""

from __future__ import annotations

import base64
import json
import os
import pickle
import zipfile
import zlib
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from edgespec.errors import ModelError
from edgespec.heads.checkpoint import load_config, load_state_dict
from synthetic_heads import write_eagle, write_eagle3, write_medusa
from torchfmt import Bf16, Global, Strided, save_safetensors, save_torch


def _tensors(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "w32": rng.standard_normal((4, 6)).astype(np.float32),
        "w16": rng.standard_normal((3, 5)).astype(np.float16),
        "w64": rng.standard_normal(7),
        "ids": rng.integers(-5, 10**12, size=9, dtype=np.int64),
        "i32": rng.integers(-100, 100, size=(2, 2), dtype=np.int32),
        "i16": rng.integers(-100, 100, size=3, dtype=np.int16),
        "i8": rng.integers(-100, 100, size=3, dtype=np.int8),
        "u8": rng.integers(0, 255, size=3, dtype=np.uint8),
        "mask": rng.random(11) > 0.5,
        "scalar": np.array(3.5, dtype=np.float32),
        "empty": np.zeros((0, 4), dtype=np.float32),
    }


def assert_same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert list(got) == list(want)
    for name, w in want.items():
        g = got[name]
        assert g.dtype == w.dtype, name
        assert g.shape == w.shape, name
        np.testing.assert_array_equal(g, w, err_msg=name)


# --- safetensors ----------------------------------------------------------------------------


def test_safetensors_written_by_the_reference_library(tmp_path: Path) -> None:
    tensors = _tensors()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    got = load_state_dict(tmp_path / "model.safetensors")
    assert sorted(got) == sorted(tensors)
    assert_same({k: got[k] for k in tensors}, tensors)


def test_safetensors_bf16_widens_exactly(tmp_path: Path) -> None:
    values = np.random.default_rng(1).standard_normal((5, 8)).astype(np.float32) * 100
    bits = Bf16.from_float(values)
    save_safetensors(tmp_path / "m.safetensors", {"w": bits, "b": values[0]})
    got = load_state_dict(tmp_path / "m.safetensors")
    assert got["w"].dtype == np.float32
    np.testing.assert_array_equal(got["w"], bits.to_float())
    np.testing.assert_allclose(got["w"], values, rtol=2**-8)  # bf16 keeps 8 bits of mantissa
    np.testing.assert_array_equal(got["b"], values[0])
    assert got["w"].flags.writeable


def test_safetensors_f16_and_f32_from_our_writer(tmp_path: Path) -> None:
    tensors = _tensors(2)
    save_safetensors(tmp_path / "m.safetensors", tensors)
    assert_same(load_state_dict(tmp_path / "m.safetensors"), tensors)


def test_safetensors_truncated_file_is_a_model_error(tmp_path: Path) -> None:
    save_file({"w": np.ones((64, 64), np.float32)}, str(tmp_path / "m.safetensors"))
    data = (tmp_path / "m.safetensors").read_bytes()
    (tmp_path / "m.safetensors").write_bytes(data[:-100])
    with pytest.raises(ModelError, match="m.safetensors"):
        load_state_dict(tmp_path / "m.safetensors")


# --- torch zip ------------------------------------------------------------------------------


def test_torch_zip_round_trip(tmp_path: Path) -> None:
    tensors = _tensors(3)
    save_torch(tmp_path / "pytorch_model.bin", tensors)
    assert_same(load_state_dict(tmp_path / "pytorch_model.bin"), tensors)


def test_torch_zip_bf16_and_other_archive_prefix(tmp_path: Path) -> None:
    values = np.random.default_rng(4).standard_normal((6, 3)).astype(np.float32)
    bits = Bf16.from_float(values)
    save_torch(tmp_path / "medusa_lm_head.pt", {"0.1.weight": bits}, prefix="medusa_lm_head")
    got = load_state_dict(tmp_path / "medusa_lm_head.pt")
    np.testing.assert_array_equal(got["0.1.weight"], bits.to_float())


def test_torch_zip_strided_and_offset_views(tmp_path: Path) -> None:
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    storage = np.arange(40, dtype=np.int64)
    views = {
        "transposed": base.T,  # stride (1, 6)
        "sliced": base[1:, ::2],  # a gap between rows and between columns
        "offset": Strided(storage, offset=5, shape=(3, 4), stride=(1, 3)),
        "same_storage": Strided(storage, offset=0, shape=(2, 2), stride=(10, 1)),
        "broadcast": Strided(storage, offset=7, shape=(3, 2), stride=(0, 1)),
    }
    save_torch(tmp_path / "v.pt", views)
    with zipfile.ZipFile(tmp_path / "v.pt") as zf:  # the Strided views share one storage record
        assert sum(n.startswith("archive/data/") for n in zf.namelist()) == 3
    got = load_state_dict(tmp_path / "v.pt")
    np.testing.assert_array_equal(got["transposed"], base.T)
    np.testing.assert_array_equal(got["sliced"], base[1:, ::2])
    np.testing.assert_array_equal(got["offset"], views["offset"].values())
    np.testing.assert_array_equal(got["offset"][:, 0], [5, 6, 7])
    np.testing.assert_array_equal(got["same_storage"], [[0, 1], [10, 11]])
    np.testing.assert_array_equal(got["broadcast"], [[7, 8]] * 3)
    assert all(a.flags.c_contiguous and a.flags.writeable for a in got.values())


def test_torch_zip_shared_tensors_stay_apart_after_loading(tmp_path: Path) -> None:
    w = np.ones((2, 2), np.float32)
    save_torch(tmp_path / "s.pt", {"a": w, "b": w})
    got = load_state_dict(tmp_path / "s.pt")
    got["a"][0, 0] = 5
    assert got["b"][0, 0] == 1


@pytest.mark.parametrize("wrapper", ["state_dict", "model"])
def test_torch_zip_wrapped_state_dict_is_unwrapped(tmp_path: Path, wrapper: str) -> None:
    tensors = {"fc.weight": np.eye(3, dtype=np.float32)}
    save_torch(tmp_path / "c.pt", tensors, wrap=wrapper)
    assert_same(load_state_dict(tmp_path / "c.pt"), tensors)


# torch.save(OrderedDict(fc.weight=arange(6).reshape(2, 3) / 4, fc_t=<its transpose, same storage>,
# norm.weight=bf16 [1.5, -2], d2t=int64 [3, 0, -1], t2d=[True, False]), "real_torch.pt") as written
# by torch 2.14.1 (zlib + base64): memo opcodes, .format_version, .storage_alignment, 64-byte
# aligned records and the "real_torch/" prefix that our writer does not produce.
REAL_TORCH_FILE = (
    "eNqdll1v0lAYxw8tK6xT59jUOZ1zvjJ1jJYNqG8zjelNTZwYE+SmYaWDxkp9yplGE5MlZku8U2O8NHrvvZr4Fr+B9165GOOV"
    "H0HPaRm2hQ3lJIcT4Pz/z++U53kOCyobRSgeR21jGA0ixyhbGrYdvTZTKeNy6tYNS5EHUOnvWGF03bYsQ8emXW/wl52K4RiV"
    "i6aOeUBTBYgki/3EbElP3THMag0Do7t+KW0Zm1aD1xxjcdm0Kho26g3b0W6LPLDJZDFGRA2ys1w1IOpJeMWyy/iq9yEPfcUI"
    "2ZMGrsiSVb+1DDGVwxC/oiKVUdk16FdZNbIG/MMaBRnAsK0A24tRl0bDsKNG4tSitb4aV3OVg1TJqswa7FQj1GDIUyYwDBdg"
    "pDhAlHXbublxkl2eQRNOdumEbItvt8snwB7izmAYdblWYa8aWYUxz3kfhv0FGHcPUBExHAg4XrLr1ZbbhOsmwkHixmKYdFlX"
    "4RB1O+y5HcFwtADHXDcsVuB4kM+2rZZb0nXLwJTHdqLJdpK6nfLcpjGkCjCznFpQY/H3VfHdNyKhc2HTjBlDu/0Zk1oiD6uM"
    "tduG0yDJocgJf+I0h0DtX//6+oAC0bm5/TiaDdg300MrW2a1ftOoY0VOd4iw9cjOUoD5O/CTISGYLQFG0Fk/wOJdbNg03xU5"
    "/99xN4ZlYmwZlGH13PpejkThtmQYQmfCVTmTVuRcrwCe68p58jKP0AUyV8h8MU+JCt9/TIySL0a7EE21EQmKfPTfiD7No080"
    "VuxKaZ2WZrRLrHNtsURFlnp+/CU2FOF3c1Cm+/rbj72dP/PP548gGunD4c/F7vmXQOf9kVp1dbr345cyPI3/5Xn1Wvf4k2gm"
    "UIDuURuGY5IKvFemF4BmVhT55P/gCOlcLp8Vc6KUk6T83KyQFeeEvCBJ6XxOyqdz0pyUyeREt028eoSmk4Qj6VJGKGyL09+h"
    "htvIO9xjYQN/DxoLiEUGbdHWwj7+VjIe8Hkc8mnrX2Erf0cYCWYCizp2orCDv4KHAg7PWNTeR8Jyf1EG5clou1wIy/31E5Q/"
    "7SAXw3J/UYSi97XLM2G5P6cTAfmToHyTH9KfbZPBp8+h7nWwoHLcqabgADvdEvOh9SXjrW84byU6+t8HXe/33nt3Yh/naXh3"
    "v7f3D/LPLnk="
)


def test_a_file_written_by_real_torch(tmp_path: Path) -> None:
    (tmp_path / "real_torch.pt").write_bytes(zlib.decompress(base64.b64decode(REAL_TORCH_FILE)))
    with zipfile.ZipFile(tmp_path / "real_torch.pt") as zf:
        assert "real_torch/data.pkl" in zf.namelist()
    got = load_state_dict(tmp_path / "real_torch.pt")
    w = np.arange(6, dtype=np.float32).reshape(2, 3) / 4
    assert_same(got, {"fc.weight": w, "fc_t": w.T.copy(), "norm.weight": np.array([1.5, -2.0], np.float32),
                      "d2t": np.array([3, 0, -1], np.int64), "t2d": np.array([True, False])})


def test_big_endian_archive(tmp_path: Path) -> None:
    tensors = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "ids": np.array([1, -2, 3 << 40], np.int64),
               "h": Bf16.from_float(np.array([1.5, -3.25], np.float32))}
    save_torch(tmp_path / "le.pt", tensors)
    with zipfile.ZipFile(tmp_path / "le.pt") as src, zipfile.ZipFile(tmp_path / "be.pt", "w") as dst:
        item = {"archive/data/0": 4, "archive/data/1": 8, "archive/data/2": 2}
        for name in src.namelist():
            data = src.read(name)
            if name == "archive/byteorder":
                data = b"big"
            elif name in item:
                data = np.frombuffer(data, dtype=f"<u{item[name]}").byteswap().tobytes()
            dst.writestr(name, data)
    got = load_state_dict(tmp_path / "be.pt")
    np.testing.assert_array_equal(got["w"], tensors["w"])
    np.testing.assert_array_equal(got["ids"], tensors["ids"])
    np.testing.assert_array_equal(got["h"], [1.5, -3.25])
    assert got["w"].dtype.isnative and got["ids"].dtype.isnative


class _Shell:
    """What a hostile checkpoint smuggles in: unpickling it would run a shell command."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


@pytest.mark.parametrize("make", [
    lambda marker: _Shell(f"touch {marker}"),
    lambda marker: Global("builtins", "eval", (f"open({str(marker)!r}, 'w').close()",)),
    lambda marker: Global("builtins", "exec", (f"open({str(marker)!r}, 'w').close()",)),
])
def test_torch_zip_with_a_foreign_global_is_refused_without_running_it(tmp_path: Path, make) -> None:
    marker = tmp_path / "pwned"
    # the payload is live: the standard unpickler runs it
    save_torch(tmp_path / "live.pt", {}, extra_global=make(marker))
    with zipfile.ZipFile(tmp_path / "live.pt") as zf:
        pickle.loads(zf.read("archive/data.pkl"))
    assert marker.exists()
    marker.unlink()

    save_torch(tmp_path / "evil.pt", {"w": np.zeros(2, np.float32)}, extra_global=make(marker))
    with pytest.raises(ModelError, match=r"evil\.pt: refusing to unpickle (posix|os|builtins)\.(system|eval|exec)"):
        load_state_dict(tmp_path / "evil.pt")
    assert not marker.exists()


def test_foreign_global_in_the_storage_type_slot_is_refused(tmp_path: Path) -> None:
    save_torch(tmp_path / "evil.pt", {"w": np.zeros(2, np.float32)})
    with zipfile.ZipFile(tmp_path / "evil.pt") as zf:
        entries = {n: zf.read(n) for n in zf.namelist()}
    entries["archive/data.pkl"] = entries["archive/data.pkl"].replace(b"ctorch\nFloatStorage\n", b"cos\nsystem\n")
    with zipfile.ZipFile(tmp_path / "evil.pt", "w") as zf:
        for name, data in entries.items():
            zf.writestr(name, data)
    with pytest.raises(ModelError, match="refusing to unpickle os.system"):
        load_state_dict(tmp_path / "evil.pt")


def test_legacy_torch_file_is_a_clear_error(tmp_path: Path) -> None:
    # torch < 1.6 wrote pickles back to back, starting with the magic number as a protocol-2 LONG
    (tmp_path / "old.bin").write_bytes(pickle.dumps(0x1950A86A20F9469CFC6C, protocol=2) + b"\x80\x02K\xe9.")
    with pytest.raises(ModelError, match="legacy"):
        load_state_dict(tmp_path / "old.bin")


def test_zip_without_a_pickle_is_not_a_checkpoint(tmp_path: Path) -> None:
    with zipfile.ZipFile(tmp_path / "x.pt", "w") as zf:
        zf.writestr("x/readme.txt", "hello")
    with pytest.raises(ModelError, match="x.pt"):
        load_state_dict(tmp_path / "x.pt")


# --- folders, shards, config ----------------------------------------------------------------


def test_sharded_safetensors_index(tmp_path: Path) -> None:
    tensors = _tensors(5)
    names = list(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:4], "model-00002-of-00002.safetensors": names[4:]}
    weight_map = {}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(tmp_path / shard))
        weight_map.update({k: shard for k in keys})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    got = load_state_dict(tmp_path)
    assert_same({k: got[k] for k in names}, tensors)
    assert sorted(got) == sorted(names)


def test_sharded_torch_index_and_a_missing_tensor(tmp_path: Path) -> None:
    tensors = _tensors(6)
    names = list(tensors)
    save_torch(tmp_path / "pytorch_model-00001-of-00002.bin", {k: tensors[k] for k in names[:3]})
    save_torch(tmp_path / "pytorch_model-00002-of-00002.bin", {k: tensors[k] for k in names[3:]})
    weight_map = {k: f"pytorch_model-0000{1 if i < 3 else 2}-of-00002.bin" for i, k in enumerate(names)}
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    got = load_state_dict(tmp_path / "pytorch_model.bin.index.json")
    assert_same({k: got[k] for k in names}, tensors)

    weight_map["not.there"] = "pytorch_model-00001-of-00002.bin"
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ModelError, match="in no shard"):
        load_state_dict(tmp_path)


def test_folder_prefers_safetensors_and_ignores_training_args(tmp_path: Path) -> None:
    save_torch(tmp_path / "pytorch_model.bin", {"w": np.zeros(2, np.float32)})
    save_file({"w": np.ones(2, np.float32)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "training_args.bin").write_bytes(b"\x80\x04junk")
    np.testing.assert_array_equal(load_state_dict(tmp_path)["w"], [1, 1])
    (tmp_path / "model.safetensors").unlink()
    np.testing.assert_array_equal(load_state_dict(tmp_path)["w"], [0, 0])


def test_folder_without_weights_or_with_ambiguous_ones(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="no weights"):
        load_state_dict(tmp_path)
    save_file({"w": np.ones(2, np.float32)}, str(tmp_path / "a.safetensors"))
    save_file({"w": np.ones(2, np.float32)}, str(tmp_path / "b.safetensors"))
    with pytest.raises(ModelError, match="several weight files"):
        load_state_dict(tmp_path)
    with pytest.raises(ModelError, match="no such file"):
        load_state_dict(tmp_path / "nope.safetensors")


def test_missing_or_broken_config_is_a_model_error(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="config.json") as err:
        load_config(tmp_path)
    assert "\n" not in str(err.value)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelError, match="config.json: not valid JSON"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ModelError, match="JSON object"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text('{"hidden_size": 8}')
    assert load_config(tmp_path) == {"hidden_size": 8}


# --- the synthetic upstream layouts ---------------------------------------------------------


@pytest.mark.parametrize("fmt", ["safetensors", "pt"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_medusa_layout_round_trips(tmp_path: Path, fmt: str, dtype: str) -> None:
    want = write_medusa(tmp_path, hidden=16, vocab=40, n_heads=3, n_layers=2, fmt=fmt, dtype=dtype)
    expected_file = "medusa_lm_head.safetensors" if fmt == "safetensors" else "medusa_lm_head.pt"
    assert (tmp_path / expected_file).is_file()
    assert_same(load_state_dict(tmp_path), want)
    assert set(want) == {f"{h}.{i}.linear.{p}" for h in range(3) for i in range(2) for p in ("weight", "bias")} | \
        {f"{h}.2.weight" for h in range(3)}
    assert want["0.2.weight"].shape == (40, 16)
    np.testing.assert_array_equal(want["1.0.linear.weight"], want["1.1.linear.weight"])  # one ResBlock, repeated
    config = load_config(tmp_path)
    assert (config["medusa_num_heads"], config["medusa_num_layers"]) == (3, 2)


def test_medusa_without_own_lm_head(tmp_path: Path) -> None:
    want = write_medusa(tmp_path, hidden=8, vocab=20, n_heads=2, n_layers=1, own_lm_head=False, fmt="pt")
    assert sorted(want) == ["0.0.linear.bias", "0.0.linear.weight", "1.0.linear.bias", "1.0.linear.weight"]
    assert_same(load_state_dict(tmp_path / "medusa_lm_head.pt"), want)


@pytest.mark.parametrize("fmt", ["safetensors", "pt"])
@pytest.mark.parametrize("with_embed", [False, True])
def test_eagle_layout_round_trips(tmp_path: Path, fmt: str, with_embed: bool) -> None:
    want = write_eagle(tmp_path, hidden=16, n_heads=4, n_kv_heads=2, ffn=24, vocab=30, fmt=fmt,
                       with_embed=with_embed, dtype="float16")
    assert (tmp_path / ("model.safetensors" if fmt == "safetensors" else "pytorch_model.bin")).is_file()
    assert_same(load_state_dict(tmp_path), want)
    assert want["fc.weight"].shape == (16, 32)
    assert want["layers.0.self_attn.k_proj.weight"].shape == (8, 16)
    assert "layers.0.input_layernorm.weight" not in want
    assert ("embed_tokens.weight" in want) == with_embed
    config = load_config(tmp_path)
    assert config["num_hidden_layers"] == 1 and config["num_key_value_heads"] == 2


@pytest.mark.parametrize("fmt", ["safetensors", "pt"])
def test_eagle3_layout_round_trips(tmp_path: Path, fmt: str) -> None:
    want = write_eagle3(tmp_path, hidden=16, n_heads=4, n_kv_heads=2, ffn=24, vocab=50, draft_vocab=20,
                        fmt=fmt, dtype="bfloat16")
    got = load_state_dict(tmp_path)
    assert_same(got, want)
    assert got["d2t"].dtype == np.int64 and got["t2d"].dtype == np.bool_
    assert got["midlayer.self_attn.q_proj.weight"].shape == (16, 32)
    assert got["fc.weight"].shape == (16, 48)
    assert got["lm_head.weight"].shape == (20, 16)
    target_ids = np.arange(20) + got["d2t"]
    assert np.all(np.diff(target_ids) > 0) and target_ids.max() < 50
    np.testing.assert_array_equal(np.flatnonzero(got["t2d"]), target_ids)
    assert load_config(tmp_path)["draft_vocab_size"] == 20
