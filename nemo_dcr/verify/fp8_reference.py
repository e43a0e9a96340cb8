"""Independent reference of the FP8 block quantization convention (docs/fp8.md), for the tests
and the demo's per-step check of an FP8 engine (:func:`fp8_mismatches`).

Written from the convention (DeepGEMM / vLLM ``per_block_cast_to_fp8``), not from
``nemo_dcr.quant``: a plain loop over blocks in numpy float32, and its own float32 -> e4m3fn
rounding from the format's definition (sign, 4 exponent bits with bias 7, 3 mantissa bits,
subnormals ``m * 2**-9``, 0x7F NaN), round to nearest, ties to the even code. No torch cast.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

_CODES = np.arange(0x7F)  # every finite non-negative e4m3fn code (0x7F is NaN)
_EXP, _MANT = _CODES >> 3, _CODES & 7
_VALUES = np.where(_EXP == 0, _MANT * 2.0**-9, (1 + _MANT / 8.0) * 2.0 ** (_EXP - 7))


def e4m3_bits(y: np.ndarray) -> np.ndarray:
    """e4m3fn bit patterns (uint8) of finite float32 values with ``|y| <= 448``."""
    a = np.abs(y.astype(np.float64))
    assert np.all(np.isfinite(a)) and np.all(a <= 448.0)
    hi = np.clip(np.searchsorted(_VALUES, a), 1, _VALUES.size - 1)
    lo = hi - 1
    d_lo, d_hi = a - _VALUES[lo], _VALUES[hi] - a
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (_CODES[hi] % 2 == 0))
    code = np.where(a == 0, 0, np.where(pick_hi, _CODES[hi], _CODES[lo]))
    return (code | np.where(np.signbit(y), 0x80, 0)).astype(np.uint8)


def quantize_ref(w: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(fp8 bits uint8, scale_inv float32, amax float32)`` of a 2-D float32 array, block by block."""
    m, n = w.shape
    bm, bn = block
    gm, gn = -(-m // bm), -(-n // bn)
    q = np.zeros((m, n), np.uint8)
    scale = np.zeros((gm, gn), np.float32)
    amax = np.zeros((gm, gn), np.float32)
    for i in range(gm):
        for j in range(gn):
            x = w[i * bm : (i + 1) * bm, j * bn : (j + 1) * bn].astype(np.float32)
            amax[i, j] = np.max(np.abs(x))
            s = np.float32(max(amax[i, j], np.float32(1e-4)) / np.float32(448.0))
            inv = np.float32(np.float32(1.0) / s)
            y = np.clip(x * inv, np.float32(-448.0), np.float32(448.0))
            q[i * bm : (i + 1) * bm, j * bn : (j + 1) * bn] = e4m3_bits(y)
            scale[i, j] = s
    return q, scale, amax


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """float32 values of bf16 bit patterns."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def fp8_mismatches(engine: Mapping[str, np.ndarray], dense: Mapping[str, np.ndarray],
                   fp8: Mapping[str, tuple[tuple[int, int], str]]) -> list[str]:
    """Engine tensors that differ from the reference quantization of a dense BF16 export.

    Args:
        engine: the engine's tensors as unsigned bits, shaped (uint8 FP8 bytes, uint32 fp32
            scales, uint16 bf16 kept tensors).
        dense: the BF16 target of every canonical tensor as uint16 bits, shaped.
        fp8: FP8 weight name -> (its block, its scale tensor's name); every other canonical
            tensor must be held as it is.

    Returns:
        Names (engine tensors, and canonical ones the engine lacks or holds extra), sorted;
        empty when the engine holds exactly the reference quantization of ``dense``.
    """
    want: dict[str, np.ndarray] = {}
    for name, bits in dense.items():
        if name in fp8:
            block, scale_name = fp8[name]
            q, scale, _ = quantize_ref(bf16_to_f32(bits), block)
            want[name], want[scale_name] = q, scale.view(np.uint32)
        else:
            want[name] = bits
    names = set(want) | set(engine)
    return sorted(n for n in names if n not in want or n not in engine or engine[n].shape != want[n].shape
                  or engine[n].dtype != want[n].dtype or not np.array_equal(engine[n], want[n]))
