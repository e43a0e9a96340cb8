"""Compiled host kernels (scan, in-place bit writes, checksum) against numpy/torch references."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nemo_dcr.kernels import read_bits, scan_changes, write_bits
from nemo_dcr.kernels.scan import changed_bits_np, changes_np
from nemo_dcr.types import DTYPES, carrier, tensor_from_bits
from nemo_dcr.verify.checksum import hash_sum, hash_sum_np, tensor_checksum, tensor_checksum_np, updated_checksum

UINTS = (np.uint8, np.uint16, np.uint32)


@pytest.mark.parametrize("dtype", UINTS + (np.uint64,))
def test_scan_equals_numpy_mask(dtype):
    rng = np.random.default_rng(np.dtype(dtype).itemsize)
    for n in (0, 1, 7, 63, 64, 65, 1000, 70_001):
        a = rng.integers(0, np.iinfo(dtype).max, n, dtype=dtype)
        for density in (0.0, 0.001, 0.2, 1.0):
            b = a.copy()
            hit = rng.random(n) < density
            b[hit] ^= dtype(1 << int(rng.integers(0, 8)))
            for off in (0, 1, 3):  # unaligned starts too
                pos, new = changed_bits_np(b[off:], a[off:])
                want = np.flatnonzero(b[off:] != a[off:])
                assert np.array_equal(pos, want) and np.array_equal(new, b[off:][want])
                pos, new, old = changes_np(b[off:], a[off:])
                assert np.array_equal(pos, want) and np.array_equal(new, b[off:][want])
                assert np.array_equal(old, a[off:][want])


def test_scan_finds_every_lane_of_a_word():
    """Each element width's lanes: every subset of changed lanes in one word (and a high-bit-only
    change, which the lane arithmetic must not carry into its neighbour)."""
    for dtype in UINTS + (np.uint64,):
        per = 8 // np.dtype(dtype).itemsize
        top = dtype(1 << (8 * np.dtype(dtype).itemsize - 1))
        for subset in range(1 << per):
            a = np.zeros(8 * per * 3, dtype)
            b = a.copy()
            lanes = [j for j in range(per) if subset >> j & 1]
            b[8 * per + np.array(lanes, dtype=np.int64)] = top
            pos, new, old = changes_np(b, a)
            assert pos.tolist() == [8 * per + j for j in lanes] and (new == top).all() and (old == 0).all()


def test_scan_changes_on_tensors_is_bitwise():
    a = torch.tensor([0.0, -0.0, float("nan"), 1.0] * 40, dtype=torch.bfloat16)
    b = a.clone()
    b.view(torch.int16)[1] = 0  # -0.0 -> +0.0
    b.view(torch.int16)[2] ^= 1  # another NaN payload
    b.view(torch.int16)[159] ^= 1
    pos, new = scan_changes(b, a)
    assert pos.tolist() == [1, 2, 159] and torch.equal(new, b.view(torch.int16)[pos])


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_write_and_read_bits_match_index_put(name):
    spec, rng = DTYPES[name], np.random.default_rng(1)
    base = rng.integers(0, 1 << spec.bits, 5000, dtype=np.uint64).astype(spec.uint)
    pos = np.sort(rng.choice(base.size, 700, replace=False)).astype(np.int64)
    new = rng.integers(0, 1 << spec.bits, pos.size, dtype=np.uint64).astype(spec.uint)
    got = tensor_from_bits(base, spec, (50, 100))
    want = tensor_from_bits(base, spec, (50, 100))
    write_bits(got, pos, new)
    want.view(carrier(new).dtype).view(-1).index_put_((torch.from_numpy(pos),), carrier(new))
    assert torch.equal(got.view(carrier(new).dtype), want.view(carrier(new).dtype))
    write_bits(got, torch.from_numpy(pos[::-1].copy()), carrier(new[::-1].copy()))  # torch inputs, any order
    assert torch.equal(got.view(carrier(new).dtype), want.view(carrier(new).dtype))
    assert np.array_equal(read_bits(got, pos).numpy().view(spec.uint), new)


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_write_and_read_bits_on_numpy_arrays(name):
    """Host bit arrays (a mirror's, an encoder's base) take the same compiled writes and reads."""
    spec, rng = DTYPES[name], np.random.default_rng(2)
    base = rng.integers(0, 1 << spec.bits, 3000, dtype=np.uint64).astype(spec.uint)
    pos = np.sort(rng.choice(base.size, 400, replace=False)).astype(np.int64)
    new = rng.integers(0, 1 << spec.bits, pos.size, dtype=np.uint64).astype(spec.uint)
    got, want = base.copy(), base.copy()
    want[pos] = new
    old = read_bits(got, pos)
    assert old.dtype == base.dtype and np.array_equal(old, base[pos])
    write_bits(got, pos, new)
    assert np.array_equal(got, want)
    with pytest.raises(IndexError, match="outside a tensor of 3000"):
        write_bits(got, np.array([0, 3000]), new[:2])
    assert np.array_equal(got, want)
    with pytest.raises(ValueError, match="contiguous"):
        read_bits(got[::2], pos[:1])


def test_out_of_range_write_raises_and_writes_nothing():
    t = torch.zeros(10, dtype=torch.bfloat16)
    for bad in ([3, 10], [-1, 2]):
        with pytest.raises(IndexError, match="outside a tensor of 10"):
            write_bits(t, np.array(bad), np.array([1, 1], np.uint16))
        assert not t.view(torch.int16).any()
    with pytest.raises(IndexError):
        read_bits(t, np.array([10]))


@pytest.mark.parametrize("dtype", UINTS + (np.uint64,))
def test_checksums_equal_numpy(dtype):
    rng = np.random.default_rng(9)
    for n in (0, 1, 33_000, 100_003):
        bits = rng.integers(0, np.iinfo(dtype).max, n, dtype=dtype)
        for off in (0, 12345, (1 << 64) - 7):
            assert tensor_checksum(bits, off) == tensor_checksum_np(bits, off)
        idx = rng.integers(0, 1 << 62, n)
        assert hash_sum(idx, bits) == hash_sum_np(idx, bits)


def test_updated_checksum_equals_a_full_one():
    rng = np.random.default_rng(4)
    bits = rng.integers(0, 1 << 16, 50_000, dtype=np.uint64).astype(np.uint16)
    pos = np.sort(rng.choice(bits.size, 3000, replace=False))
    new = bits.copy()
    new[pos] = rng.integers(0, 1 << 16, pos.size, dtype=np.uint64).astype(np.uint16)
    want = tensor_checksum_np(new)
    assert updated_checksum(tensor_checksum_np(bits), pos, bits[pos], new[pos]) == want
    assert (tensor_checksum_np(bits) - hash_sum_np(pos, bits[pos]) + hash_sum_np(pos, new[pos])) % 2**64 == want
