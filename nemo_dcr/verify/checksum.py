"""Layout-independent tensor checksum.

``C(T) = sum over i of h(i, bits_i)  mod 2**64`` where ``i`` is the element's flat index in the
*canonical* tensor and ``h`` a 64-bit mixer.  Because it is a sum, it decomposes over any
sharding (each rank sums its own elements with their canonical indices, totals are added) and
updates incrementally from a delta: ``C' = C - sum h(i, old_i) + sum h(i, new_i)`` over the
changed ``i`` only.  It detects any single changed element (h is a bijection of (i, bits) for
fixed i) and random corruption with probability 1 - 2**-64; it is not a MAC (payloads are
authenticated with HMAC, see docs/wire_format.md).

:func:`checksums_after` is the one way a kept checksum follows a delta (the trainer's partial sums,
the sender mirror and its views, an engine rank's canonical sums); :func:`updated_checksum` is the
primitive under it (and under the codec's and the transaction's read-back checks).
:func:`hash_sum` and :func:`tensor_checksum` are compiled loops (one pass, no temporaries);
:func:`hash_sum_np` and :func:`tensor_checksum_np` are the numpy implementations the tests
compare them with.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Mapping

import numpy as np

from ..kernels.jit import njit

if TYPE_CHECKING:
    from ..types import SparseDelta

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_K_IDX = np.uint64(0x9E3779B97F4A7C15)
_K_BITS = np.uint64(0xD6E8FEB86659FD93)
_CHUNK = 1 << 20  # hash_sum's temporaries: a few 8-byte arrays of this many elements
_TILE = 1 << 15  # tensor_checksum_np works on cache-sized tiles, in place
_IDX_MUL = np.arange(_TILE, dtype=np.uint64) * _K_IDX
MASK64 = (1 << 64) - 1


def element_hash(index: np.ndarray, bits: np.ndarray) -> np.ndarray:
    """Per-element 64-bit hash of (canonical flat index, raw bits): splitmix64 finalizer."""
    with np.errstate(over="ignore"):
        x = index.astype(np.uint64) * _K_IDX
        x ^= (bits.astype(np.uint64) + np.uint64(1)) * _K_BITS
        x ^= x >> np.uint64(30)
        x *= _M1
        x ^= x >> np.uint64(27)
        x *= _M2
        x ^= x >> np.uint64(31)
    return x


@njit
def _mix(x):
    x ^= x >> np.uint64(30)
    x *= _M1
    x ^= x >> np.uint64(27)
    x *= _M2
    return x ^ (x >> np.uint64(31))


@njit
def _hash_sum(index, bits):
    total = np.uint64(0)
    for i in range(index.size):
        total += _mix(np.uint64(index[i]) * _K_IDX ^ (np.uint64(bits[i]) + np.uint64(1)) * _K_BITS)
    return total


@njit
def _run_sum(bits, offset):
    total = np.uint64(0)
    for i in range(bits.size):
        total += _mix((offset + np.uint64(i)) * _K_IDX ^ (np.uint64(bits[i]) + np.uint64(1)) * _K_BITS)
    return total


def unsigned_bits(bits, what: str = "bits") -> np.ndarray:
    """``bits`` as a flat numpy array, refused unless unsigned integers (signed bits of the same width
    hash differently: an int16 ``-1`` is not the uint16 ``0xFFFF``).

    Raises:
        TypeError: naming ``what`` and the dtype found.
    """
    arr = np.asarray(bits).reshape(-1)
    if arr.dtype.kind != "u":
        raise TypeError(f"{what} must be unsigned integers (the raw bits of an element), got {arr.dtype}")
    return arr


def hash_sum(index: np.ndarray, bits: np.ndarray) -> int:
    """``sum h(index_k, bits_k) mod 2**64`` for explicit index/bits vectors."""
    index, bits = np.asarray(index).reshape(-1), unsigned_bits(bits)
    if index.size != bits.size:
        raise ValueError(f"{index.size} indices for {bits.size} bit values")
    return int(_hash_sum(index, bits))


def tensor_checksum(bits: np.ndarray, index_offset: int = 0) -> int:
    """Checksum of a contiguous run of elements whose canonical indices start at ``index_offset``."""
    return int(_run_sum(np.ascontiguousarray(unsigned_bits(bits)), np.uint64(index_offset & MASK64)))


def hash_sum_np(index: np.ndarray, bits: np.ndarray) -> int:
    """:func:`hash_sum` in numpy (the reference the compiled loop is tested against)."""
    total = 0
    for s in range(0, index.size, _CHUNK):
        h = element_hash(index[s : s + _CHUNK], bits[s : s + _CHUNK])
        total += int(h.sum(dtype=np.uint64))
    return total & MASK64


def tensor_checksum_np(bits: np.ndarray, index_offset: int = 0) -> int:
    """:func:`tensor_checksum` in numpy: 32K-element tiles worked in place (test reference)."""
    flat = bits.reshape(-1)
    total = 0
    x = np.empty(_TILE, np.uint64)
    y = np.empty(_TILE, np.uint64)
    with np.errstate(over="ignore"):
        for s in range(0, flat.size, _TILE):
            part = flat[s : s + _TILE]
            n = part.size
            xs, ys = x[:n], y[:n]
            np.add(_IDX_MUL[:n], np.uint64(((index_offset + s) * int(_K_IDX)) & MASK64), out=xs)  # i * K_IDX
            np.add(part, np.uint64(1), out=ys, dtype=np.uint64)
            ys *= _K_BITS
            xs ^= ys
            for shift, mul in ((30, _M1), (27, _M2)):
                np.right_shift(xs, np.uint64(shift), out=ys)
                xs ^= ys
                xs *= mul
            np.right_shift(xs, np.uint64(31), out=ys)
            xs ^= ys
            total += int(xs.sum(dtype=np.uint64))
    return total & MASK64


@njit
def _delta_sum(index, old, new):
    total = np.uint64(0)
    for i in range(index.size):
        x = np.uint64(index[i]) * _K_IDX
        total += _mix(x ^ (np.uint64(new[i]) + np.uint64(1)) * _K_BITS)
        total -= _mix(x ^ (np.uint64(old[i]) + np.uint64(1)) * _K_BITS)
    return total


def updated_checksum(checksum: int, positions: np.ndarray, old_bits: np.ndarray, new_bits: np.ndarray) -> int:
    """Checksum after replacing ``old_bits`` by ``new_bits`` at ``positions`` (cost ∝ changes)."""
    positions = np.asarray(positions)
    old_bits, new_bits = unsigned_bits(old_bits, "old bits"), unsigned_bits(new_bits, "new bits")
    if not (positions.size == old_bits.size == new_bits.size):
        raise ValueError(f"{positions.size} positions for {old_bits.size} old and {new_bits.size} new bit values")
    return (checksum + int(_delta_sum(positions, old_bits, new_bits))) & MASK64


def checksum_after(checksum: int, delta: SparseDelta) -> int:
    """``checksum`` of ``delta``'s tensor after its ``old_bits`` were replaced by its ``new_bits`` at
    its positions (the index the checksum hashes: canonical, or a view's); cost ∝ changes.

    Raises:
        ValueError: the delta carries no old bits.
    """
    if delta.old_bits is None:
        raise ValueError(f"{delta.name}: a checksum follows a delta only with its old bits")
    return updated_checksum(checksum, delta.positions, delta.old_bits, delta.new_bits)


def checksums_after(checksums: Mapping[str, int], deltas: Iterable[SparseDelta]) -> dict[str, int]:
    """Per-tensor checksums after every delta moved its tensor's (:func:`checksum_after`), keyed by
    ``delta.name``; a tensor without a value starts at 0 (a partial sum of no elements yet)."""
    out = dict(checksums)
    for d in deltas:
        out[d.name] = checksum_after(out.get(d.name, 0), d)
    return out
