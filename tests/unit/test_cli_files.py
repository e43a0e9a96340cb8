"""``nemo-dcr encode | apply | diff`` on files: nothing lost, nothing half-written, clear refusals.

* ``apply -o`` writes only the checkpoint files it produces (temp file in the destination
  folder, then a rename); every other file of the destination stays, ``a/b/..`` is just ``a``,
  an in-place apply on a Hugging Face folder keeps config/tokenizer files and ``__metadata__``.
* Temp names are unique (another writer's temp file is never touched) and never left behind.
* ``encode`` refuses a directory as output before writing, and a failing write leaves no file.
* Tensors of dtypes the wire format does not carry (integers, bool, fp64) travel unchanged when
  BASE and TARGET agree on them, and are refused by name and dtype otherwise.
* Key files follow the one rule (raw bytes, >= 16); a short one exits 2 like other bad input.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from nemo_dcr import checkpoint as ckpt
from nemo_dcr.tools.cli import main

KEY = b"k" * 24


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(64, 8, generator=g).to(torch.bfloat16),
            "b.weight": torch.randn(100, generator=g),
            "c.bias": torch.randn(7, generator=g).to(torch.float16)}


def _step(tensors: dict, seed: int) -> dict[str, torch.Tensor]:
    """Flip the lowest mantissa bit of every 5th element (a bit-level change)."""
    out = {}
    for name, t in tensors.items():
        if not t.is_floating_point():
            out[name] = t.clone()
            continue
        iv = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]
        bits = t.reshape(-1).view(iv).clone()
        bits[seed % 5::5] ^= 1
        out[name] = bits.view(t.dtype).reshape(t.shape)
    return out


def _ints(d: dict) -> dict[str, np.ndarray]:
    out = {}
    for n, t in d.items():
        w = t.element_size()
        carrier = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[w]
        out[n] = t.contiguous().reshape(-1).view(carrier).numpy().copy()
    return out


def _assert_bits(got: dict, want: dict) -> None:
    g, w = _ints(got), _ints(want)
    assert g.keys() == w.keys()
    for n in w:
        assert np.array_equal(g[n], w[n]), n


def _hf_folder(path: Path, tensors: dict, shards: int | None = None, meta=None) -> Path:
    ckpt.save_checkpoint(tensors, path, max_shard_bytes=shards, metadata=meta)
    (path / "config.json").write_text('{"model_type": "llama"}')
    (path / "tokenizer.json").write_text('{"version": "1.0"}')
    return path


def _delta(tmp_path: Path, base, target, *extra) -> Path:
    out = tmp_path / "d.ndcr"
    assert main(["encode", str(base), str(target), "-o", str(out), *extra]) == 0
    return out


def _files(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


def test_apply_into_existing_folder_keeps_other_files(tmp_path):
    base, target = _tensors(), _step(_tensors(), 1)
    ckpt.save_checkpoint(base, tmp_path / "base")
    ckpt.save_checkpoint(target, tmp_path / "target")
    delta = _delta(tmp_path, tmp_path / "base", tmp_path / "target")
    out = tmp_path / "out"
    (out / "sub").mkdir(parents=True)
    (out / "notes.txt").write_text("keep me")
    (out / "sub" / "x.bin").write_bytes(b"\0" * 10)
    assert main(["apply", str(tmp_path / "base"), str(delta), "-o", str(out)]) == 0
    assert (out / "notes.txt").read_text() == "keep me" and (out / "sub" / "x.bin").stat().st_size == 10
    _assert_bits(ckpt.load_checkpoint(out), target)
    assert _files(out) == {"notes.txt", "sub", "sub/x.bin", "model.safetensors"}


def test_apply_to_dotdot_path_is_the_folder_it_names(tmp_path):
    base, target = _tensors(), _step(_tensors(), 2)
    ckpt.save_checkpoint(base, tmp_path / "base.safetensors")
    ckpt.save_checkpoint(target, tmp_path / "target.safetensors")
    delta = _delta(tmp_path, tmp_path / "base.safetensors", tmp_path / "target.safetensors")
    a = tmp_path / "a"
    (a / "b").mkdir(parents=True)
    (a / "precious.txt").write_text("x")
    rc = main(["apply", str(tmp_path / "base.safetensors"), str(delta), "-o", str(a / "b" / "..")])
    assert rc == 0
    assert (a / "precious.txt").read_text() == "x" and (a / "b").is_dir()
    _assert_bits(ckpt.load_checkpoint(a), target)


@pytest.mark.parametrize("shards", [None, 700])
def test_in_place_apply_on_hf_folder_keeps_files_and_metadata(tmp_path, shards):
    base, target = _tensors(), _step(_tensors(), 3)
    meta = {"format": "pt", "producer": "unit-test"}
    folder = _hf_folder(tmp_path / "model", base, shards, meta)
    ckpt.save_checkpoint(target, tmp_path / "target")
    delta = _delta(tmp_path, folder, tmp_path / "target")
    before = _files(folder)
    assert main(["apply", str(folder), str(delta), "-o", str(folder)]) == 0
    assert _files(folder) == before  # same files: nothing removed, no temp left
    assert (folder / "config.json").read_text() == '{"model_type": "llama"}'
    assert (folder / "tokenizer.json").read_text() == '{"version": "1.0"}'
    for f in folder.glob("*.safetensors"):
        assert ckpt.read_metadata(f) == meta, f
    _assert_bits(ckpt.load_checkpoint(folder), target)


def test_sharded_base_gives_the_same_shards(tmp_path):
    base, target = _tensors(), _step(_tensors(), 4)
    _hf_folder(tmp_path / "base", base, 700)
    ckpt.save_checkpoint(target, tmp_path / "t.safetensors")
    delta = _delta(tmp_path, tmp_path / "base", tmp_path / "t.safetensors")
    assert main(["apply", str(tmp_path / "base"), str(delta), "-o", str(tmp_path / "out")]) == 0
    want = {p.name for p in (tmp_path / "base").glob("model*")}
    assert {p.name for p in (tmp_path / "out").iterdir()} == want
    _assert_bits(ckpt.load_checkpoint(tmp_path / "out"), target)


def test_apply_refuses_a_folder_whose_stale_index_would_win(tmp_path):
    base, target = _tensors(), _step(_tensors(), 1)
    ckpt.save_checkpoint(base, tmp_path / "base")
    ckpt.save_checkpoint(target, tmp_path / "target")
    delta = _delta(tmp_path, tmp_path / "base", tmp_path / "target")
    out = _hf_folder(tmp_path / "out", base, 700)
    before = {p: p.read_bytes() for p in out.iterdir()}
    assert main(["apply", str(tmp_path / "base"), str(delta), "-o", str(out)]) == 2
    assert {p: p.read_bytes() for p in out.iterdir()} == before


def test_apply_never_touches_another_writers_temp_file(tmp_path):
    base, target = _tensors(), _step(_tensors(), 1)
    ckpt.save_checkpoint(base, tmp_path / "base.safetensors")
    ckpt.save_checkpoint(target, tmp_path / "target.safetensors")
    delta = _delta(tmp_path, tmp_path / "base.safetensors", tmp_path / "target.safetensors")
    out = tmp_path / "o"
    out.mkdir()
    others = [out / ".out.partial.safetensors", out / "out.safetensors.tmp", out / "model.safetensors.tmp",
              out / ".model.partial"]
    for p in others:
        p.write_bytes(b"another writer's bytes")
    assert main(["apply", str(tmp_path / "base.safetensors"), str(delta), "-o", str(out / "out.safetensors")]) == 0
    assert main(["apply", str(tmp_path / "base.safetensors"), str(delta), "-o", str(out)]) == 0
    assert all(p.read_bytes() == b"another writer's bytes" for p in others)
    assert _files(out) == {p.name for p in others} | {"out.safetensors", "model.safetensors"}


def test_concurrent_applies_to_one_output_each_write_a_whole_file(tmp_path, monkeypatch):
    base = _tensors()
    ckpt.save_checkpoint(base, tmp_path / "base.safetensors")
    targets = [_step(base, 1), _step(base, 2)]
    deltas = []
    for i, t in enumerate(targets):
        ckpt.save_checkpoint(t, tmp_path / f"t{i}.safetensors")
        out = tmp_path / f"d{i}.ndcr"
        assert main(["encode", str(tmp_path / "base.safetensors"), str(tmp_path / f"t{i}.safetensors"),
                     "-o", str(out)]) == 0
        deltas.append(out)
    gate = threading.Barrier(2)
    real_replace = os.replace

    def replace(src, dst):  # both writers have written their temp file before either renames
        gate.wait(timeout=30)
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    out = tmp_path / "same.safetensors"
    rcs = [None, None]
    threads = [threading.Thread(target=lambda i=i: rcs.__setitem__(
        i, main(["apply", str(tmp_path / "base.safetensors"), str(deltas[i]), "-o", str(out)])))
        for i in range(2)]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    assert rcs == [0, 0]
    got = _ints(ckpt.load_checkpoint(out))
    assert any(all(np.array_equal(got[n], w[n]) for n in w) for w in map(_ints, targets))
    assert _files(tmp_path) == {"base.safetensors", "t0.safetensors", "t1.safetensors", "d0.ndcr", "d1.ndcr",
                                "same.safetensors"}


def test_encode_refuses_a_folder_output_and_leaves_nothing(tmp_path):
    ckpt.save_checkpoint(_tensors(), tmp_path / "b.safetensors")
    ckpt.save_checkpoint(_step(_tensors(), 1), tmp_path / "t.safetensors")
    (tmp_path / "out").mkdir()
    before = _files(tmp_path)
    assert main(["encode", str(tmp_path / "b.safetensors"), str(tmp_path / "t.safetensors"),
                 "-o", str(tmp_path / "out")]) == 2
    assert _files(tmp_path) == before


def test_encode_failing_write_leaves_the_old_output_and_no_temp(tmp_path, monkeypatch):
    ckpt.save_checkpoint(_tensors(), tmp_path / "b.safetensors")
    ckpt.save_checkpoint(_step(_tensors(), 1), tmp_path / "t.safetensors")
    (tmp_path / "d.ndcr").write_bytes(b"old delta")

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    assert main(["encode", str(tmp_path / "b.safetensors"), str(tmp_path / "t.safetensors"),
                 "-o", str(tmp_path / "d.ndcr")]) == 2
    assert (tmp_path / "d.ndcr").read_bytes() == b"old delta"
    assert _files(tmp_path) == {"b.safetensors", "t.safetensors", "d.ndcr"}


def test_short_key_file_exits_2_and_key_is_raw_bytes(tmp_path, capsys):
    ckpt.save_checkpoint(_tensors(), tmp_path / "b.safetensors")
    ckpt.save_checkpoint(_step(_tensors(), 1), tmp_path / "t.safetensors")
    (tmp_path / "short").write_bytes(b"x" * 15)
    args = ["encode", str(tmp_path / "b.safetensors"), str(tmp_path / "t.safetensors"), "-o", str(tmp_path / "d")]
    assert main(args + ["--key-file", str(tmp_path / "short")]) == 2
    assert "KeyFileError" in capsys.readouterr().err and not (tmp_path / "d").exists()
    (tmp_path / "nl").write_bytes(KEY + b"\n")  # the newline is part of the key
    (tmp_path / "stripped").write_bytes(KEY)
    assert main(args + ["--key-file", str(tmp_path / "nl")]) == 0
    assert main(["inspect", str(tmp_path / "d"), "--key-file", str(tmp_path / "nl")]) == 0
    assert main(["inspect", str(tmp_path / "d"), "--key-file", str(tmp_path / "stripped")]) == 2


def _with_extras(tensors: dict, step: int = 0) -> dict:
    return dict(tensors, **{"pos_ids": torch.arange(16, dtype=torch.int64) + step,
                            "rope.f64": torch.linspace(0, 1, 5, dtype=torch.float64),
                            "mask": torch.tensor([True, False])})


def test_non_float_tensors_travel_unchanged_when_equal(tmp_path):
    base, target = _with_extras(_tensors()), _with_extras(_step(_tensors(), 1))
    ckpt.save_checkpoint(base, tmp_path / "b.safetensors")
    ckpt.save_checkpoint(target, tmp_path / "t.safetensors")
    delta = _delta(tmp_path, tmp_path / "b.safetensors", tmp_path / "t.safetensors")
    assert main(["diff", str(tmp_path / "b.safetensors"), str(tmp_path / "t.safetensors")]) == 0
    assert main(["apply", str(tmp_path / "b.safetensors"), str(delta), "-o", str(tmp_path / "o.safetensors")]) == 0
    _assert_bits(ckpt.load_checkpoint(tmp_path / "o.safetensors"), target)


def test_changed_non_float_tensor_is_refused_by_name_and_dtype(tmp_path, capsys):
    base, target = _with_extras(_tensors()), _with_extras(_step(_tensors(), 1), step=1)
    ckpt.save_checkpoint(base, tmp_path / "b.safetensors")
    ckpt.save_checkpoint(target, tmp_path / "t.safetensors")
    for cmd in (["encode", "-o", str(tmp_path / "d")], ["diff"]):
        rc = main([cmd[0], str(tmp_path / "b.safetensors"), str(tmp_path / "t.safetensors"), *cmd[1:]])
        err = capsys.readouterr().err
        assert rc == 2 and "'pos_ids'" in err and "I64" in err, err
    assert not (tmp_path / "d").exists()

