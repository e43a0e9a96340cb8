"""Monotone integer keys and ULP steps (docs/wire_format.md section 4.4).

``key`` maps raw bits to an unsigned integer that orders like the float value, so a change of
one ULP is a step of one.  All arithmetic is exact integer arithmetic in uint64, valid for every
bit pattern of every supported width.
"""

from __future__ import annotations

import numpy as np

from nemo_dcr.types import DtypeSpec


def to_key(bits: np.ndarray, spec: DtypeSpec) -> np.ndarray:
    """Monotone key of raw ``bits`` as uint64."""
    b = bits.astype(np.uint64)
    sign = np.uint64(spec.sign_mask)
    ones = np.uint64((1 << spec.bits) - 1)
    return np.where(b & sign, ~b & ones, b | sign)


def from_key(key: np.ndarray, spec: DtypeSpec) -> np.ndarray:
    """Inverse of :func:`to_key`, returned in the dtype's unsigned type."""
    sign = np.uint64(spec.sign_mask)
    ones = np.uint64((1 << spec.bits) - 1)
    return np.where(key & sign, key & ~sign & ones, ~key & ones).astype(spec.uint)


def signed_steps(old: np.ndarray, new: np.ndarray, spec: DtypeSpec) -> np.ndarray:
    """Magnitude-direction steps ``d`` (int64, never 0 for changed elements): positive = away from zero."""
    s = to_key(new, spec).astype(np.int64) - to_key(old, spec).astype(np.int64)
    neg_old = (old.astype(np.uint64) & np.uint64(spec.sign_mask)) != 0
    return np.where(neg_old, -s, s)


def apply_signed_steps(old: np.ndarray, d: np.ndarray, spec: DtypeSpec) -> np.ndarray:
    """Inverse of :func:`signed_steps`; caller checked ``0 < |d| < 2**bits``."""
    neg_old = (old.astype(np.uint64) & np.uint64(spec.sign_mask)) != 0
    s = np.where(neg_old, -d, d)
    new_key = (to_key(old, spec).astype(np.int64) + s) % np.int64(1 << spec.bits)
    return from_key(new_key.astype(np.uint64), spec)


def fold_steps(old: np.ndarray, new: np.ndarray, spec: DtypeSpec) -> np.ndarray:
    """Signed steps folded to ``u = 2(|d| - 1) + (d < 0) >= 0`` (uint64): one symbol per change."""
    d = signed_steps(old, new, spec)
    return (2 * (np.abs(d) - 1) + (d < 0)).astype(np.uint64)
