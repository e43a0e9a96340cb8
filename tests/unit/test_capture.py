"""Capture stage: bit-pattern semantics, accumulation, commit, DP ranges, backends."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nemo_dcr.capture import BaselineError, BaselineStore, capture, split_range
from nemo_dcr.kernels import write_bits
from nemo_dcr.types import int_view


def _bf16_from_bits(bits):
    return torch.tensor(np.array(bits, dtype=np.uint16).view(np.int16)).view(torch.bfloat16)


def _store(params, backend="device", tmp_path=None):
    store = BaselineStore(backend, directory=tmp_path)
    for name, p in params.items():
        store.register(name, p)
    return store


@pytest.mark.parametrize("backend", ["device", "pinned", "file"])
def test_special_bit_patterns_change_exactly_when_bits_differ(backend, tmp_path):
    old = [0x0000, 0x8000, 0x7FC0, 0x7FC1, 0x7F80, 0xFF80, 0x3F80, 0x7FC0]
    new = [0x8000, 0x8000, 0x7FC1, 0x7FC1, 0x7F80, 0x7F80, 0x3F80, 0x7FC0]
    # +0->-0 changed; -0 same; NaN payload changed; same NaN; +Inf same; -Inf->+Inf; 1.0 same;
    # same NaN.  Float compare would get 0/-0 and every NaN wrong.
    p = _bf16_from_bits(old)
    store = _store({"w": p}, backend, tmp_path / "b")
    int_view(p).copy_(int_view(_bf16_from_bits(new)))
    (d,) = capture({"w": p}, store)
    assert d.positions.tolist() == [0, 2, 5]
    assert d.new_bits.dtype == np.uint16
    assert d.new_bits.tolist() == [0x8000, 0x7FC1, 0x7F80]
    assert d.old_bits.tolist() == [0x0000, 0x7FC0, 0xFF80]
    assert d.dtype == "bf16" and d.shape == (8,)


def test_fp32_and_chunked_scan_agree():
    torch.manual_seed(0)
    p = torch.randn(1000)
    store = _store({"w": p})
    p[::7] += 1.0
    full = capture({"w": p}, store)[0]
    chunked = capture({"w": p}, store, chunk=13)[0]
    assert np.array_equal(full.positions, np.arange(0, 1000, 7))
    assert np.array_equal(full.positions, chunked.positions)
    assert np.array_equal(full.new_bits, chunked.new_bits)
    assert full.new_bits.dtype == np.uint32


def test_skipped_refits_accumulate_until_commit():
    p = torch.zeros(10, dtype=torch.bfloat16)
    store = _store({"w": p})
    p[1] = 1.0
    capture({"w": p}, store, version=1)  # shipped, never acknowledged
    p[4] = 2.0
    (d2,) = capture({"w": p}, store, version=2)
    assert d2.positions.tolist() == [1, 4]  # version 1's change is not lost
    assert store.pending_versions() == [1, 2]
    store.commit(2)
    assert store.pending_versions() == [] and store.version == 2
    assert capture({"w": p}, store) == []


def test_commit_applies_shipped_bits_not_current_params():
    p = torch.zeros(6, dtype=torch.bfloat16)
    store = _store({"w": p})
    p[0] = 1.0
    capture({"w": p}, store, version=1)
    p[0] = 3.0  # changes again before the engine acknowledges version 1
    p[5] = 1.0
    assert store.commit(1) == 1
    (d,) = capture({"w": p}, store)
    assert d.positions.tolist() == [0, 5]
    assert d.old_bits[0] == int_view(torch.tensor([1.0], dtype=torch.bfloat16)).item()


def test_commit_unknown_version_raises():
    store = _store({"w": torch.zeros(3)})
    with pytest.raises(BaselineError, match="not staged"):
        store.commit(7)


def test_shape_change_and_unknown_backend_raise():
    store = _store({"w": torch.zeros(3)})
    with pytest.raises(BaselineError, match="registered"):
        capture({"w": torch.zeros(4)}, store)
    with pytest.raises(BaselineError, match="unknown baseline backend"):
        BaselineStore("gpu-magic")


def test_file_backend_is_memmap_and_survives_commit(tmp_path):
    p = torch.arange(100, dtype=torch.float32).to(torch.bfloat16)
    store = _store({"layer.0/w": p}, "file", tmp_path)
    assert store.bits("layer.0/w").numpy().base is not None
    files = list(tmp_path.iterdir())
    assert len(files) == 1 and files[0].stat().st_size == 200
    p[3] = -5.0
    capture({"layer.0/w": p}, store, version=1)
    store.commit(1)
    on_disk = np.fromfile(files[0], dtype=np.int16)
    assert np.array_equal(on_disk, int_view(p).numpy())


def test_split_range_tiles_exactly():
    for numel in (0, 1, 7, 100):
        for count in (1, 2, 3, 8):
            parts = [split_range(numel, i, count) for i in range(count)]
            assert parts[0][0] == 0 and parts[-1][1] == numel
            assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))


def test_dp_ranges_partition_the_delta():
    torch.manual_seed(1)
    p = torch.randn(97).to(torch.bfloat16)
    target = p.clone()
    store = _store({"w": p})
    p.add_(torch.randn(97).to(torch.bfloat16) * 0.01)
    parts = []
    for r in range(3):
        parts += capture({"w": p}, store, {"w": split_range(97, r, 3)})
    whole = capture({"w": p}, store)[0]
    assert np.array_equal(np.concatenate([d.positions for d in parts]), whole.positions)
    for d in parts:
        write_bits(target, d.positions, d.new_bits)
    assert torch.equal(int_view(target), int_view(p))
