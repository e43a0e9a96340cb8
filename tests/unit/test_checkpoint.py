"""Safetensors checkpoints: bit-exact round trips, folders and indexes, interop with the reference
library's own functions, malformed files raised as this module's errors naming the file."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from nemo_dcr import checkpoint as ckpt
from nemo_dcr.checkpoint import (
    CheckpointError,
    CheckpointNotFoundError,
    HeaderError,
    MissingTensorError,
    OffsetError,
    UnknownDtypeError,
    list_tensors,
    load_checkpoint,
    save_checkpoint,
)

INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
FLOATS = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2]
INTS = [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64]


def random_bits(dtype: torch.dtype, shape, seed: int = 0) -> torch.Tensor:
    """Every bit pattern possible, NaNs, infs and -0.0 included."""
    g = torch.Generator().manual_seed(seed)
    width = torch.empty((), dtype=dtype).element_size()
    n = 1
    for s in shape:
        n *= s
    raw = torch.randint(0, 256, (n * width,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def as_int(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(INT_VIEW[t.element_size()])


def assert_bit_equal(a: dict, b: dict) -> None:
    assert list(a) == list(b) or set(a) == set(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert a[name].shape == b[name].shape, name
        assert torch.equal(as_int(a[name]), as_int(b[name])), name


def mixed_tensors() -> dict[str, torch.Tensor]:
    out = {}
    for k, dtype in enumerate(FLOATS + INTS):
        out[f"t{k}.{str(dtype).split('.')[-1]}"] = random_bits(dtype, (3, 5 + k), seed=k)
    out["scalar"] = torch.tensor(1.5, dtype=torch.bfloat16)
    out["empty"] = torch.empty(0, 4, dtype=torch.float32)
    return out


@pytest.mark.parametrize("dtype", FLOATS + INTS + [torch.float64, torch.bool])
def test_round_trip_every_dtype_bit_exact(tmp_path, dtype):
    t = {"w": random_bits(dtype, (7, 9)) if dtype != torch.bool else torch.rand(7, 9) > 0.5}
    save_checkpoint(t, tmp_path / "one.safetensors")
    back = load_checkpoint(tmp_path / "one.safetensors")
    assert_bit_equal(t, back)
    assert back["w"].is_contiguous() and back["w"].device.type == "cpu"


def test_mixed_round_trip_and_file_order(tmp_path):
    t = mixed_tensors()
    save_checkpoint(t, tmp_path / "m.safetensors", metadata={"step": "3"})
    back = load_checkpoint(tmp_path / "m.safetensors")
    assert_bit_equal(t, back)
    widths = [v.element_size() for v in back.values()]
    assert widths == sorted(widths, reverse=True)  # wider first: every tensor aligned
    assert ckpt.read_metadata(tmp_path / "m.safetensors") == {"step": "3"}
    listed = list_tensors(tmp_path / "m.safetensors")
    assert listed["scalar"] == ("BF16", ()) and listed["empty"] == ("F32", (0, 4))


def test_loaded_tensors_are_copy_on_write(tmp_path):
    path = tmp_path / "c.safetensors"
    save_checkpoint({"w": torch.zeros(16)}, path)
    load_checkpoint(path)["w"].add_(1.0)
    assert torch.equal(load_checkpoint(path)["w"], torch.zeros(16))


def test_sharded_directory_round_trip(tmp_path):
    t = {f"layer.{i}.w": random_bits(torch.bfloat16, (64, 32), seed=i) for i in range(7)}
    files = save_checkpoint(t, tmp_path / "ck", max_shard_bytes=3 * 64 * 32 * 2)
    names = sorted(p.name for p in files)
    assert names[-1] == ckpt.INDEX_FILE
    assert names[:3] == [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
    index = json.loads((tmp_path / "ck" / ckpt.INDEX_FILE).read_text())
    assert index["metadata"]["total_size"] == 7 * 64 * 32 * 2
    back = load_checkpoint(tmp_path / "ck")
    assert list(back) == list(t)
    assert_bit_equal(t, back)
    some = load_checkpoint(tmp_path / "ck", names=["layer.5.w", "layer.0.w"])
    assert list(some) == ["layer.0.w", "layer.5.w"]
    assert list_tensors(tmp_path / "ck")["layer.6.w"] == ("BF16", (64, 32))


def test_unsharded_directory(tmp_path):
    t = mixed_tensors()
    save_checkpoint(t, tmp_path / "d")
    assert (tmp_path / "d" / ckpt.SINGLE_FILE).is_file()
    assert_bit_equal(t, load_checkpoint(tmp_path / "d"))


def test_we_write_reference_reads(tmp_path):
    st = pytest.importorskip("safetensors.torch")
    t = mixed_tensors()
    save_checkpoint(t, tmp_path / "ours.safetensors", metadata={"a": "b"})
    theirs = st.load_file(tmp_path / "ours.safetensors")
    assert_bit_equal(t, theirs)
    with open(tmp_path / "ours.safetensors", "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        assert (8 + n) % 8 == 0


def test_reference_writes_we_read(tmp_path):
    st = pytest.importorskip("safetensors.torch")
    t = mixed_tensors()
    st.save_file(t, tmp_path / "theirs.safetensors", metadata={"format": "pt"})
    ours = load_checkpoint(tmp_path / "theirs.safetensors")
    assert_bit_equal(t, ours)
    assert ckpt.read_metadata(tmp_path / "theirs.safetensors") == {"format": "pt"}
    assert {n: s for n, (_, s) in list_tensors(tmp_path / "theirs.safetensors").items()} == {
        n: tuple(v.shape) for n, v in t.items()
    }


def test_sharded_reference_interop(tmp_path):
    st = pytest.importorskip("safetensors.torch")
    t = {f"w{i}": random_bits(torch.bfloat16, (32, 8), seed=i) for i in range(5)}
    save_checkpoint(t, tmp_path / "ck", max_shard_bytes=2 * 32 * 8 * 2)
    index = json.loads((tmp_path / "ck" / ckpt.INDEX_FILE).read_text())["weight_map"]
    merged = {}
    for fname in sorted(set(index.values())):
        merged.update(st.load_file(tmp_path / "ck" / fname))
    assert_bit_equal(t, merged)


# ----------------------------------------------------------------------------- malformed input


def write_raw(path, header: dict | bytes, data: bytes = b"", header_len: int | None = None):
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(raw) if header_len is None else header_len
    path.write_bytes(struct.pack("<Q", n) + raw + data)
    return path


def entry(dtype="F32", shape=(2,), offsets=(0, 8)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="nope.safetensors"):
        load_checkpoint(tmp_path / "nope.safetensors")
    with pytest.raises(CheckpointNotFoundError, match="nodir"):
        load_checkpoint(tmp_path / "nodir")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointNotFoundError, match="model.safetensors"):
        list_tensors(tmp_path / "empty")


def test_index_names_missing_tensor_and_missing_shard(tmp_path):
    t = {"a": torch.zeros(4), "b": torch.ones(4)}
    save_checkpoint(t, tmp_path / "ck", max_shard_bytes=16)
    index_path = tmp_path / "ck" / ckpt.INDEX_FILE
    index = json.loads(index_path.read_text())
    index["weight_map"]["ghost"] = index["weight_map"]["a"]
    index_path.write_text(json.dumps(index))
    with pytest.raises(MissingTensorError, match=r"model-00001-of-00002.*'ghost'"):
        load_checkpoint(tmp_path / "ck")
    index["weight_map"]["ghost"] = "model-00009-of-00009.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointNotFoundError, match="model-00009"):
        load_checkpoint(tmp_path / "ck")
    with pytest.raises(MissingTensorError, match="'zzz'"):
        load_checkpoint(tmp_path / "ck", names=["zzz"])


@pytest.mark.parametrize(
    "header, data, header_len, error, match",
    [  # the causes as the safetensors package words them, under this module's error classes
        (b"", b"", 0, HeaderError, "JSON"),
        (b"{not json", b"", None, HeaderError, "JSON"),
        (b"[1, 2]", b"", None, HeaderError, "JSON.*sequence"),
        ({"w": entry()}, b"\0" * 8, 1 << 40, HeaderError, "header too large"),
        ({"w": entry(dtype="F128")}, b"\0" * 8, None, UnknownDtypeError, "unknown variant `F128`"),
        ({"w": {"dtype": "F32"}}, b"\0" * 8, None, HeaderError, "missing field `shape`"),
        ({"w": entry(shape=(-1,))}, b"\0" * 8, None, HeaderError, "`-1`"),
        ({"w": entry(offsets=(0, 4))}, b"\0" * 8, None, OffsetError, "shape, data type, or offset"),
        ({"w": entry(offsets=(8, 16))}, b"\0" * 8, None, OffsetError, "offset for tensor `w`"),
        ({"w": entry(offsets=(0, 8))}, b"\0" * 4, None, OffsetError, "not fully covered"),
        ({"w": entry(), "v": entry()}, b"\0" * 8, None, OffsetError, "offset for tensor `[vw]`"),
        ({"w": entry()}, b"\0" * 12, None, OffsetError, "not fully covered"),
        ({"__metadata__": {"a": 1}, "w": entry()}, b"\0" * 8, None, HeaderError, "expected a string"),
    ],
)
def test_malformed_headers(tmp_path, header, data, header_len, error, match):
    path = write_raw(tmp_path / "bad.safetensors", header, data, header_len)
    with pytest.raises(error, match=match) as info:
        load_checkpoint(path)
    assert "bad.safetensors" in str(info.value)
    assert isinstance(info.value, CheckpointError)
    with pytest.raises(error):
        list_tensors(path)


def test_truncated_length_prefix(tmp_path):
    path = tmp_path / "short.safetensors"
    path.write_bytes(b"\x01\x02")
    with pytest.raises(HeaderError, match="short.safetensors"):
        load_checkpoint(path)


def test_save_rejects_unknown_dtype(tmp_path):
    with pytest.raises(UnknownDtypeError, match="'c'"):
        save_checkpoint({"c": torch.zeros(2, dtype=torch.complex64)}, tmp_path / "x.safetensors")


def test_tensors_sharing_memory_are_written_as_copies(tmp_path):
    """Tied weights (one storage, two names) are both written; views of one buffer too."""
    w = random_bits(torch.bfloat16, (4, 6))
    buf = torch.arange(12, dtype=torch.float32)
    t = {"embed.weight": w, "lm_head.weight": w, "lo": buf[:6], "hi": buf[6:].reshape(2, 3)}
    save_checkpoint(t, tmp_path / "tied.safetensors")
    assert_bit_equal(t, load_checkpoint(tmp_path / "tied.safetensors"))
