"""The ``reference`` record coding: gaps + XOR + zstd level 1 (docs/wire_format.md 4.3).

This is what the best existing systems ship; it is kept as the baseline ``dcr`` is measured
against.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import zstandard

from ..types import DtypeSpec
from .errors import MalformedRecordError, PositionOutOfBoundsError
from .frames import iter_frame


def pos_width(numel: int) -> int:
    """Bytes per position: 8 when the tensor has more than 2**31 - 1 elements."""
    return 8 if numel > (1 << 31) - 1 else 4


def encode_reference(base_bits: np.ndarray, positions: np.ndarray, new_bits: np.ndarray, spec: DtypeSpec):
    """Body and params of a ``reference`` record."""
    width = pos_width(base_bits.size)
    gaps = np.diff(positions, prepend=0).astype(np.dtype(f"<u{width}"))
    xor = (base_bits[positions] ^ new_bits).astype(spec.uint.newbyteorder("<"))
    cctx = zstandard.ZstdCompressor(level=1)
    pos = cctx.compress(gaps.tobytes())
    val = cctx.compress(xor.tobytes())
    return pos + val, {"pos_width": width, "pos_len": len(pos), "val_len": len(val)}


def _elements(pieces, dtype: np.dtype) -> Iterator[np.ndarray]:
    """Whole little-endian elements of ``dtype`` from byte pieces (an element may straddle two)."""
    carry = b""
    for piece in pieces:
        buf = carry + piece if carry else piece
        whole = len(buf) - len(buf) % dtype.itemsize
        carry = buf[whole:]
        if whole:
            yield np.frombuffer(buf, dtype=dtype, count=whole // dtype.itemsize)


def _section(data, expected: int, what: str, name: str, dtype: np.dtype) -> Iterator[np.ndarray]:
    return _elements(iter_frame(data, expected, MalformedRecordError, f"{what} section", name), dtype)


def _positions(section, width: int, changed: int, numel: int, name: str) -> np.ndarray:
    """Positions from the gap section, built piece by piece into one int64 array (8 B per change)."""
    out, k, last = np.empty(changed, np.int64), 0, 0
    for gaps in _section(section, changed * width, "position", name, np.dtype(f"<u{width}")):
        n = gaps.size
        if (gaps[0 if k else 1:] == 0).any():
            raise PositionOutOfBoundsError("positions are not strictly increasing", name)
        if int(gaps.max()) >= numel:
            raise PositionOutOfBoundsError(f"gap beyond tensor of {numel} elements", name)
        chunk = out[k : k + n]
        np.cumsum(gaps, dtype=np.int64, out=chunk)
        chunk += last
        if width == 8 and ((chunk[0] <= last and k) or (np.diff(chunk) <= 0).any()):  # int64 wrapped
            raise PositionOutOfBoundsError(f"position beyond tensor of {numel} elements", name)
        if chunk[-1] >= numel:
            raise PositionOutOfBoundsError(f"position {int(chunk[-1])} >= numel {numel}", name)
        k, last = k + n, int(chunk[-1])
    return out


def decode_reference(body, params: dict, changed: int, base_bits: np.ndarray, spec: DtypeSpec, name: str):
    """Positions and new bits of a ``reference`` record; validates, writes nothing.

    Memory: the outputs (8 B per change for positions, the element width for the new bits) plus
    pieces of bounded size; the decompressed sections are never held whole.
    """
    if set(params) != {"pos_width", "pos_len", "val_len"} or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in params.values()
    ):
        raise MalformedRecordError(f"reference params must be pos_width/pos_len/val_len ints, got {params}", name)
    width, p_len, v_len = params["pos_width"], params["pos_len"], params["val_len"]
    if width != pos_width(base_bits.size) or p_len + v_len != len(body) or min(p_len, v_len) < 0:
        raise MalformedRecordError(f"params {params} inconsistent with body of {len(body)} bytes", name)
    positions = _positions(body[:p_len], width, changed, base_bits.size, name)
    new, k = np.empty(changed, spec.uint), 0
    for xor in _section(body[p_len:], changed * spec.width, "value", name, spec.uint.newbyteorder("<")):
        np.bitwise_xor(base_bits[positions[k : k + xor.size]], xor, out=new[k : k + xor.size])
        k += xor.size
    return positions, new
