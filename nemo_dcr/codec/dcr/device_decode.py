"""The ``dcr`` decode of a record whose base lives on a device: only the old bits at the changed
positions are read, through a gather the caller does on the device (docs/refit.md, "GPU path").

The kept :class:`~.class_index.DcrIndex` (host memory) maps each change's (class, rank) place to
its flat position without the base, so the decode needs the base only where it changed; the same
kernels as :func:`~.jit_codec.decode_dcr` run in the same order, so the results and refusals are
the same.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ...types import DtypeSpec
from .class_index import DcrIndex
from .jit_codec import _check_index, _refused
from .jit_decode import WHERE, finish, parse, position_order
from .jit_index import select

OldBitsAt = Callable[[np.ndarray], np.ndarray]
"""``old_at(positions)``: the base bits at increasing flat ``positions`` (unsigned, the dtype's width)."""


def decode_dcr_at(body, n: int, old_at: OldBitsAt, spec: DtypeSpec, name: str, index: DcrIndex):
    """Positions (increasing), new bits and old bits of a ``dcr`` record of an ``n``-element base
    read only through ``old_at``; validates, writes nothing.

    Raises:
        MalformedRecordError: the body breaks a rule of section 4.4 (as :func:`~.jit_codec.decode_dcr`).
        StaleIndexError: ``index`` describes another size or dtype.
    """
    _check_index(index, _Sized(n), spec)
    cls, kk, val, eref, refused = parse(np.frombuffer(body, np.uint8), index.hist, spec.bits, spec.exp_shift,
                                        spec.exp_bits)
    if refused:
        raise _refused(refused, name)
    pos = select(cls, kk, *index.tables())  # class order
    perm = position_order(pos, n, np.empty(pos.size, np.int32 if pos.size < 1 << 31 else np.int64))
    old = np.empty(pos.size, spec.uint)
    old[perm] = old_at(pos[perm])  # the gather reads in position order
    new, old, refused = finish(old, np.arange(pos.size, dtype=np.int64), val, eref, spec.bits, spec.exp_shift,
                               spec.exp_bits)
    if refused:
        raise _refused(refused, name, pos[(refused >> WHERE) - 1])
    return pos[perm], new[perm], old[perm]


class _Sized:
    """Stands for a base of ``size`` elements in the index check (no memory)."""

    def __init__(self, size: int):
        self.size = size
