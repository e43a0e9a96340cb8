"""Per-record encode/decode dispatch over the encodings of docs/wire_format.md section 4."""

from __future__ import annotations

import numpy as np

from ..types import DtypeSpec
from .dcr import DcrIndex, decode_dcr, encode_dcr
from .dcr.device_decode import decode_dcr_at
from .errors import MalformedRecordError, UnknownEncodingError
from .reference import decode_reference, encode_reference

ENCODINGS = ("same", "raw", "reference", "dcr")
SPARSE_ENCODINGS = ("reference", "dcr")


def encode_record(encoding: str, base_bits: np.ndarray, positions: np.ndarray, new_bits: np.ndarray, spec: DtypeSpec,
                  index: DcrIndex | None = None, old_bits: np.ndarray | None = None):
    """``(encoding, body, params)`` for one tensor; falls back to ``raw`` when that is not larger.

    Args:
        encoding: requested sparse encoding (``dcr`` or ``reference``) or ``raw``.
        base_bits: flat bits the receiver holds.
        positions: strictly increasing changed positions (int64).
        new_bits: new bits at ``positions``.
        spec: dtype facts.
        index: kept class index of ``base_bits`` (``dcr`` only; see :mod:`.dcr.class_index`).
        old_bits: ``base_bits[positions]`` when the caller has them.
    """
    if positions.size == 0:
        return "same", b"", {}
    dense_len = base_bits.size * spec.width
    if encoding in SPARSE_ENCODINGS:
        if encoding == "dcr":
            body, params = encode_dcr(base_bits, positions, new_bits, spec, index, old_bits), {}
        else:
            body, params = encode_reference(base_bits, positions, new_bits, spec)
        if len(body) < dense_len:
            return encoding, body, params
    elif encoding not in SPARSE_ENCODINGS + ("raw",):
        raise ValueError(f"unknown encoding {encoding!r}; choose one of {', '.join(SPARSE_ENCODINGS + ('raw',))}")
    full = base_bits.copy()
    full[positions] = new_bits
    return "raw", full.astype(spec.uint.newbyteorder("<")).tobytes(), {}


def decode_record(info, body, base_bits: np.ndarray, spec: DtypeSpec, index: DcrIndex | None = None):
    """Positions, new bits and old bits of one record; validates, writes nothing.

    ``index``: kept class index of ``base_bits`` (``dcr`` only; see :mod:`.dcr.class_index`).
    ``base_bits``: flat host bits, or a :class:`~.device_base.DeviceBase` (read only at the changed
    positions; a ``dcr`` record then needs ``index``).
    """
    if info.encoding == "dcr":
        if isinstance(base_bits, np.ndarray):
            return decode_dcr(body, base_bits, spec, info.name, index, with_old=True)
        return decode_dcr_at(body, base_bits.size, base_bits.__getitem__, spec, info.name, index)
    pos, new = _decode_other(info, body, base_bits, spec)
    return pos, new, base_bits[pos]


def _decode_other(info, body, base_bits: np.ndarray, spec: DtypeSpec):
    """Positions and new bits of a ``same``, ``raw`` or ``reference`` record."""
    name, enc = info.name, info.encoding
    if enc == "same":
        if info.changed or len(body):
            raise MalformedRecordError("'same' record must have changed=0 and an empty body", name)
        return np.zeros(0, np.int64), np.zeros(0, spec.uint)
    if enc == "raw":
        if len(body) != base_bits.size * spec.width:
            raise MalformedRecordError(f"raw body of {len(body)} bytes for {base_bits.size} elements", name)
        new = np.frombuffer(body, dtype=spec.uint.newbyteorder("<")).astype(spec.uint)
        positions = np.flatnonzero(new != base_bits).astype(np.int64)
        return positions, new[positions]
    if enc == "reference":
        return decode_reference(body, info.params, info.changed, base_bits, spec, name)
    raise UnknownEncodingError(f"unknown encoding {enc!r}; known: {', '.join(ENCODINGS)}", name)
