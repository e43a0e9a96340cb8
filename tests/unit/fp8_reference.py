"""Independent reference of the FP8 block quantization convention, for the tests only.

Written from the convention (DeepGEMM / vLLM ``per_block_cast_to_fp8``), not from
``nemo_dcr.quant``: a plain loop over blocks in numpy float32, and its own float32 -> e4m3fn
rounding from the format's definition (sign, 4 exponent bits with bias 7, 3 mantissa bits,
subnormals ``m * 2**-9``, 0x7F NaN), round to nearest, ties to the even code. No torch cast.
"""

from __future__ import annotations

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
