"""Vectorized bit-level primitives: LEB128 varints and Rice codes over numpy arrays.

Rice codes are written as two separate streams (unary quotients, fixed-width remainders) so
that both encode and decode are whole-array numpy operations with no per-element Python loop.
"""

from __future__ import annotations

import numpy as np

from nemo_dcr.codec.errors import MalformedRecordError

MAX_K = 63


def write_varint(out: bytearray, value: int) -> None:
    """Append unsigned LEB128 ``value`` to ``out``."""
    if value < 0:
        raise ValueError(f"varint must be >= 0, got {value}")
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return


class ByteReader:
    """Bounds-checked cursor over a record body; every overrun is a ``MalformedRecordError``."""

    def __init__(self, data: bytes | memoryview, record: str | None = None):
        self.data = memoryview(data)
        self.pos = 0
        self.record = record

    def _fail(self, what: str) -> MalformedRecordError:
        return MalformedRecordError(f"{what} at body offset {self.pos}", self.record)

    def varint(self) -> int:
        value, shift = 0, 0
        for _ in range(10):
            if self.pos >= len(self.data):
                raise self._fail("truncated varint")
            byte = self.data[self.pos]
            self.pos += 1
            value |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return value
            shift += 7
        raise self._fail("varint longer than 10 bytes")

    def byte(self) -> int:
        if self.pos >= len(self.data):
            raise self._fail("truncated body")
        self.pos += 1
        return self.data[self.pos - 1]

    def rest(self) -> memoryview:
        return self.data[self.pos :]


def rice_cost(values: np.ndarray, k: int) -> int:
    """Bits needed to Rice-code ``values`` (uint64) with parameter ``k``."""
    return int(values.size) * (k + 1) + int((values >> np.uint64(k)).sum(dtype=np.uint64))


def best_rice_k(values: np.ndarray) -> tuple[int, int]:
    """The ``k`` in 0..63 minimizing the Rice-coded size of ``values``, and that size in bits."""
    if values.size == 0:
        return 0, 0
    # The optimum is at most ~log2(mean) (outliers pull the mean up): scan below it, exactly.
    mean = float(values.mean(dtype=np.float64))
    guess = int(np.clip(np.ceil(np.log2(mean + 1.0)), 0, MAX_K))
    best = None
    for k in range(max(0, guess - 8), min(MAX_K, guess + 1) + 1):
        cost = rice_cost(values, k)
        if best is None or cost < best[1]:
            best = (k, cost)
    return best


def unary_bits(q: np.ndarray) -> np.ndarray:
    """Unary code of each quotient: ``q`` zero bits then a one, as a 0/1 uint8 array."""
    ends = np.cumsum(q.astype(np.int64) + 1)
    out = np.zeros(int(ends[-1]) if ends.size else 0, dtype=np.uint8)
    out[ends - 1] = 1
    return out


def fixed_bits(values: np.ndarray, k: int) -> np.ndarray:
    """The low ``k`` bits of each value, MSB first, as a 0/1 uint8 array."""
    if k == 0 or values.size == 0:
        return np.zeros(0, dtype=np.uint8)
    shifts = np.arange(k - 1, -1, -1, dtype=np.uint64)
    return ((values[:, None] >> shifts[None, :]) & np.uint64(1)).astype(np.uint8).ravel()


def read_unary(bits: np.ndarray, count: int, record: str | None) -> np.ndarray:
    """Decode exactly ``count`` unary quotients that must fill ``bits`` exactly."""
    ends = np.flatnonzero(bits)
    if ends.size != count or (count and ends[-1] != bits.size - 1) or (not count and bits.size):
        raise MalformedRecordError(
            f"unary stream holds {ends.size} codes in {bits.size} bits, expected {count}", record
        )
    q = np.diff(ends, prepend=-1) - 1
    return q.astype(np.uint64)


def read_fixed(bits: np.ndarray, count: int, k: int) -> np.ndarray:
    """Decode ``count`` values of ``k`` bits each (caller checked ``bits.size == count*k``)."""
    if k == 0:
        return np.zeros(count, dtype=np.uint64)
    shifts = np.arange(k - 1, -1, -1, dtype=np.uint64)
    mat = bits.reshape(count, k).astype(np.uint64) << shifts[None, :]
    return np.bitwise_or.reduce(mat, axis=1) if count else np.zeros(0, dtype=np.uint64)
