"""The ``dcr`` coder: compiled kernels (:mod:`.jit_encode`, :mod:`.jit_decode`) on host arrays,
with an optional kept :class:`.class_index.DcrIndex`."""

from __future__ import annotations

import numpy as np

from ...types import DtypeSpec
from ..errors import MalformedRecordError
from .class_index import DcrIndex, StaleIndexError
from .jit_decode import describe, in_position_order, onepass_hist, parse, places
from .jit_encode import MIN_GROUP_CHANGES, encode_kernel, onepass_ranks


def class_ranks(base_bits: np.ndarray, positions: np.ndarray, old_bits: np.ndarray, spec: DtypeSpec,
                index: DcrIndex | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(class, index)-order position of each change and the class histogram of ``base_bits``."""
    if index is not None:
        _check_index(index, base_bits, spec)
        return index.ranks(positions, old_bits), index.hist
    s = np.empty(positions.size, np.int64)
    hist, bad = onepass_ranks(base_bits, positions, spec.exp_shift, spec.n_exponents - 1, s)
    if bad >= 0:
        raise ValueError(f"dcr positions must increase inside [0, {base_bits.size}); entry {bad} is "
                         f"{int(positions[bad])}")
    return s, hist


def encode_dcr(base_bits: np.ndarray, positions: np.ndarray, new_bits: np.ndarray, spec: DtypeSpec,
               index: DcrIndex | None = None, old_bits: np.ndarray | None = None) -> bytes:
    """Body of a ``dcr`` record for a non-empty change set (positions strictly increasing).

    With a kept ``index`` of ``base_bits`` the cost is proportional to the changes; without one
    a single pass over ``base_bits`` ranks them.  ``old_bits``: ``base_bits[positions]`` when the
    caller has them already.
    """
    base_bits = np.ascontiguousarray(base_bits).reshape(-1)
    positions = np.ascontiguousarray(positions, np.int64)
    if positions.size and (positions[0] < 0 or positions[-1] >= base_bits.size):
        raise ValueError(f"dcr positions must increase inside [0, {base_bits.size})")
    old = np.ascontiguousarray(base_bits[positions] if old_bits is None else old_bits)
    new_bits = np.ascontiguousarray(new_bits)
    s, hist = class_ranks(base_bits, positions, old, spec, index)
    body = encode_kernel(old, new_bits, s, hist, spec.bits, spec.exp_shift, spec.exp_bits, MIN_GROUP_CHANGES)
    if not body.size:  # a zero step has no code (wire format 4.4)
        i = int(np.flatnonzero(old == new_bits)[0])
        raise ValueError(f"dcr changes must differ from their old bits; the change at position {int(positions[i])} "
                         f"(entry {i}) keeps 0x{int(old[i]):x}")
    return body.tobytes()


def _check_index(index: DcrIndex, base_bits: np.ndarray, spec: DtypeSpec) -> None:
    if index.n != base_bits.size or index.spec != spec:
        raise StaleIndexError(f"index of {index.n} {index.spec.name} elements used with "
                              f"{base_bits.size} {spec.name} elements")


def _refused(refused: int, name: str, position: int | None = None) -> MalformedRecordError:
    """The error of a kernel's refusal: the rule of section 4.4 broken and the group (or, for a
    change, its ``position``) where."""
    rule, where = describe(refused)
    at = "" if where < 0 else f"group {where}: " if position is None else f"change at position {int(position)}: "
    return MalformedRecordError(f"dcr body (wire format 4.4): {at}{rule}", name)


_NO_TABLES = (np.zeros(0, np.uint16), np.zeros((1, 1), np.uint16), np.zeros((1, 1), np.uint16),
              np.zeros((1, 1), np.int64))
"""Stand-ins for a kept index's tables when there is none (the one-pass select runs instead)."""


def decode_dcr(body, base_bits: np.ndarray, spec: DtypeSpec, name: str,
               index: DcrIndex | None = None, with_old: bool = False):
    """Positions (int64, increasing) and new bits of a ``dcr`` record; validates, writes nothing.

    With a kept ``index`` of ``base_bits`` the cost is proportional to the changes; without one
    up to two passes over ``base_bits`` (a class histogram, then the places, stopping at the
    last change).  ``with_old`` also returns the old bits at the positions.

    Raises:
        MalformedRecordError: the body breaks a rule of section 4.4 (the message names it).
    """
    base_bits = np.ascontiguousarray(base_bits).reshape(-1)
    raw = np.frombuffer(body, np.uint8)
    shift, emask = spec.exp_shift, spec.n_exponents - 1
    if index is not None:
        _check_index(index, base_bits, spec)
    hist = index.hist if index is not None else onepass_hist(base_bits, shift, emask)
    cls, kk, val, eref, refused = parse(raw, hist, spec.bits, shift, spec.exp_bits)
    if refused:
        raise _refused(refused, name)
    # the select writes each flat index over its rank: no array of the change count is born there
    tables = index.tables() if index is not None else _NO_TABLES
    pos, new, old, refused, at = places(base_bits, cls, kk, val, eref, *tables, index is not None, spec.bits, shift,
                                        spec.exp_bits)
    if refused:
        raise _refused(refused, name, at)
    del cls, kk, val, eref  # the parsed fields go before the sort (peak memory per change)
    pos, new, old = in_position_order(pos, new, old, base_bits.size)
    return (pos, new, old) if with_old else (pos, new)
