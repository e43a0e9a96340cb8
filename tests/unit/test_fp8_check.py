"""Engine-side FP8 checks: bad scales, NaN bytes, bytes disagreeing with their scale -> clear error, no write."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nemo_dcr import codec, quant
from nemo_dcr.types import SparseDelta, bits_view
from nemo_dcr.verify.fp8_reference import quantize_ref

NAME, SCALE = "l.weight", "l.weight_scale_inv"
PLAN = quant.Fp8Plan.build({NAME: (256, 384)})


def engine() -> dict[str, torch.Tensor]:
    rng = np.random.default_rng(2)
    w = rng.standard_normal((256, 384)).astype(np.float32) * np.float32(0.02)
    w[128:, 256:] = 0.0  # block (1, 2) is all zeros: floor scale, zero bytes
    q, s, _ = quantize_ref(torch.from_numpy(w).bfloat16().float().numpy(), (128, 128))
    return {NAME: torch.from_numpy(q).view(torch.float8_e4m3fn), SCALE: torch.from_numpy(s)}


def scale_change(eng, block: int, value: float) -> SparseDelta:
    old = bits_view(eng[SCALE])[[block]]
    return SparseDelta(SCALE, "fp32", (2, 3), np.array([block]), np.array([value], np.float32).view(np.uint32), old)


def byte_change(eng, flat: int, byte: int) -> SparseDelta:
    old = bits_view(eng[NAME])[[flat]]
    return SparseDelta(NAME, "fp8_e4m3", (256, 384), np.array([flat]), np.array([byte], np.uint8), old)


def block_max_positions(eng, bi: int, bj: int) -> np.ndarray:
    """Flat indices of the elements of block (bi, bj) holding |byte| = 448."""
    q = bits_view(eng[NAME]).reshape(256, 384)[bi * 128 : (bi + 1) * 128, bj * 128 : (bj + 1) * 128] & 0x7F
    r, c = np.nonzero(q == 0x7E)
    return (bi * 128 + r) * 384 + bj * 128 + c


def assert_refused(eng, deltas, match):
    """The check raises, through a real decoded payload, and the engine is untouched."""
    before = {n: bits_view(t).copy() for n, t in eng.items()}
    payload = codec.encode_deltas(deltas, {n: bits_view(t) for n, t in eng.items()})
    decoded = codec.decode(payload, eng)
    with pytest.raises(quant.Fp8PayloadError, match=match):
        quant.check_fp8_payload(eng, decoded.deltas, PLAN)
    assert all(np.array_equal(bits_view(eng[n]), b) for n, b in before.items())


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 0.0, -1e-3, 1e-12])
def test_bad_scale_is_refused(value):
    eng = engine()
    assert_refused(eng, [scale_change(eng, 4, value)], r"l\.weight: block \(1, 1\): new scale")


@pytest.mark.parametrize("byte", [0x7F, 0xFF])
def test_nan_byte_is_refused(byte):
    eng = engine()
    assert_refused(eng, [byte_change(eng, 1000, byte)], r"flat index 1000 is NaN")


def test_block_losing_its_448_byte_is_refused():
    """Bytes changed without the scale: the block no longer has the element its scale was derived from."""
    eng = engine()
    at = block_max_positions(eng, 0, 1)
    old = bits_view(eng[NAME])[at].copy()
    lowered = SparseDelta(NAME, "fp8_e4m3", (256, 384), at, (old & 0x80) | 0x7D, old)
    assert_refused(eng, [lowered], r"block \(0, 1\): largest \|byte\| would be 0x7D")


def test_scale_raised_on_a_zero_block_is_refused():
    eng = engine()
    assert_refused(eng, [scale_change(eng, 5, 0.01)], r"block \(1, 2\).*bytes and scale disagree")


def test_valid_changes_pass_and_count_blocks():
    eng = engine()
    bits = bits_view(eng[NAME])
    small = int(np.flatnonzero((bits[:128] & 0x7F) < 0x70)[0])  # block (0, 0), far from 448
    zero_block = 128 * 384 + 300  # block (1, 2)
    positions = np.array([small, zero_block])
    deltas = [SparseDelta(NAME, "fp8_e4m3", (256, 384), positions, np.array([bits[small] ^ 1, 0x7E], np.uint8),
                          bits[positions].copy()),
              scale_change(eng, 5, 0.01)]  # the zero block gets a 448 byte and a scale above the floor
    payload = codec.encode_deltas(deltas, {n: bits_view(t) for n, t in eng.items()})
    assert quant.check_fp8_payload(eng, codec.decode(payload, eng).deltas, PLAN) == 2


def test_scale_tensor_of_the_wrong_shape_is_refused():
    eng = engine()
    with pytest.raises(quant.Fp8ShapeError, match=r"scale shape \[2, 2\]"):
        quant.check_fp8_changes(NAME, eng[NAME], eng[SCALE][:, :2].contiguous(), byte_change(eng, 1, 0), None)
    with pytest.raises(quant.Fp8PayloadError, match="expected float8_e4m3fn"):
        quant.check_fp8_changes(NAME, eng[NAME].view(torch.uint8), eng[SCALE], None, None)
