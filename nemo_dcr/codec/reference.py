"""The ``reference`` record coding: gaps + XOR + zstd level 1 (docs/wire_format.md 4.3).

This is what the best existing systems ship; it is kept as the baseline ``dcr`` is measured
against.
"""

from __future__ import annotations

import numpy as np
import zstandard

from ..types import DtypeSpec
from .errors import MalformedRecordError, PositionOutOfBoundsError
from .frames import decompress_exact


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


def _decompress(data, expected: int, what: str, name: str) -> bytes:
    return decompress_exact(data, expected, MalformedRecordError, f"{what} section", name)


def decode_reference(body, params: dict, changed: int, base_bits: np.ndarray, spec: DtypeSpec, name: str):
    """Positions and new bits of a ``reference`` record; validates, writes nothing."""
    if set(params) != {"pos_width", "pos_len", "val_len"} or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in params.values()
    ):
        raise MalformedRecordError(f"reference params must be pos_width/pos_len/val_len ints, got {params}", name)
    width, p_len, v_len = params["pos_width"], params["pos_len"], params["val_len"]
    if width != pos_width(base_bits.size) or p_len + v_len != len(body) or min(p_len, v_len) < 0:
        raise MalformedRecordError(f"params {params} inconsistent with body of {len(body)} bytes", name)
    raw_pos = _decompress(body[:p_len], changed * width, "position", name)
    raw_val = _decompress(body[p_len:], changed * spec.width, "value", name)
    gaps = np.frombuffer(raw_pos, dtype=np.dtype(f"<u{width}")).astype(np.uint64)
    if changed and (gaps[1:] == 0).any():
        raise PositionOutOfBoundsError("positions are not strictly increasing", name)
    if changed and int(gaps.max()) >= base_bits.size:
        raise PositionOutOfBoundsError(f"gap beyond tensor of {base_bits.size} elements", name)
    positions = np.cumsum(gaps.astype(np.int64))
    if changed and positions[-1] >= base_bits.size:
        raise PositionOutOfBoundsError(f"position {int(positions[-1])} >= numel {base_bits.size}", name)
    xor = np.frombuffer(raw_val, dtype=spec.uint.newbyteorder("<")).astype(spec.uint)
    return positions, base_bits[positions] ^ xor
