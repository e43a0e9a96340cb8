"""The ``dcr`` record coding (docs/wire_format.md section 4.4).

Context is what the receiver already holds: each element's *class* is the exponent of its base
value, and the encoder groups neighbouring classes into *groups* (runs of exponents).  Within a
group every element has a rank (its position among the group's elements in flat order).  Per
group the coder writes three sparse sets and one integer list, all as Rice codes:

- which ranks changed (or, when most did, which did not),
- which changes step towards zero (the minority direction),
- which step magnitudes exceed the group's minimum, and by how much.

Adam moves weights by about ``lr`` per step, so how likely an element is to change, and by how
many ULPs, are both set by its exponent; conditioning on the group captures most of that.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import bitio
from .dtypes import DtypeSpec
from .keys import signed_steps

MIN_GROUP_CHANGES = 1  # a group closes once it holds this many changes; measured: merging exponents costs more than the table saves


def set_rice_k(n_coded: int, size: int) -> int:
    """Rice parameter for the gaps of a coded set of ``n_coded`` ranks among ``size`` (integer-only)."""
    if n_coded <= 0:
        return 0
    mean_gap = (size - n_coded) // n_coded
    return max(0, ((mean_gap * 45426) >> 16).bit_length() - 1)  # ~ floor(log2(mean_gap * ln 2))


@dataclass(frozen=True)
class GroupIndex:
    """Elements of a base tensor ordered by (exponent, flat index); each group is a contiguous slice.

    Groups are runs of consecutive exponents, so one stable sort by exponent serves every group
    (no per-group passes, no lookup table); elements outside the groups' range sort to the ends.
    """

    order: np.ndarray
    starts: np.ndarray

    @classmethod
    def build(cls, base_bits: np.ndarray, spec: DtypeSpec, lo: int, widths: list[int]) -> "GroupIndex":
        e = spec.exponent(base_bits)
        order = np.argsort(e, kind="stable")
        first = np.concatenate([[0], np.cumsum(np.bincount(e, minlength=spec.n_exponents))])
        bounds = lo + np.concatenate([[0], np.cumsum(widths)]).astype(np.int64)
        return cls(order, first[bounds])

    def size(self, g: int) -> int:
        return int(self.starts[g + 1] - self.starts[g])

    def members(self, g: int) -> np.ndarray:
        return self.order[self.starts[g] : self.starts[g + 1]]


def choose_groups(classes: np.ndarray, n_exponents: int) -> tuple[int, list[int]]:
    """Exponent range of the changes and the widths of its groups (greedy by change count)."""
    return groups_from_counts(np.bincount(classes, minlength=n_exponents))


def groups_from_counts(counts: np.ndarray) -> tuple[int, list[int]]:
    """:func:`choose_groups` from the class histogram of the changes (at least one change)."""
    nzc = np.flatnonzero(counts)
    lo, hi = int(nzc[0]), int(nzc[-1])
    if MIN_GROUP_CHANGES == 1:  # every class holding a change closes a group
        return lo, np.diff(nzc, prepend=lo - 1).astype(int).tolist()
    widths, acc, width = [], 0, 0
    for e in range(lo, hi + 1):
        acc, width = acc + int(counts[e]), width + 1
        if acc >= MIN_GROUP_CHANGES:
            widths.append(width)
            acc, width = 0, 0
    if width:  # a short tail joins the last group
        if widths:
            widths[-1] += width
        else:
            widths.append(width)
    return lo, widths


class _Writer:
    """Collects the class table bytes and the Rice-coded quotient/remainder bit streams."""

    def __init__(self):
        self.table = bytearray()
        self.q, self.r = [], []

    def rice(self, values: np.ndarray, k: int) -> None:
        self.q.append(bitio.unary_bits(values >> np.uint64(k)))
        self.r.append(bitio.fixed_bits(values, k))

    def coded_set(self, ranks: np.ndarray, size: int) -> None:
        """The minority side of a subset of ``range(size)`` given as sorted ``ranks``."""
        n = ranks.size
        if n == 0 or n == size:
            return
        if 2 * n > size:
            keep = np.ones(size, dtype=bool)
            keep[ranks] = False
            ranks = np.flatnonzero(keep)
        self.rice((np.diff(ranks, prepend=-1) - 1).astype(np.uint64), set_rice_k(ranks.size, size))

    def finish(self) -> bytes:
        q = np.concatenate(self.q) if self.q else np.zeros(0, np.uint8)
        r = np.concatenate(self.r) if self.r else np.zeros(0, np.uint8)
        bitio.write_varint(self.table, int(q.size))
        bitio.write_varint(self.table, int(r.size))
        return bytes(self.table) + np.packbits(np.concatenate([q, r])).tobytes()


def _bits(w: _Writer) -> int:
    return sum(int(q.size) for q in w.q) + sum(int(r.size) for r in w.r)


def _encode_group(w: _Writer, ranks: np.ndarray, size: int, d: np.ndarray, new: np.ndarray, spec: DtypeSpec) -> None:
    from ..kernels.dcr_encode import literal_choice, zigzag

    n = ranks.size
    bitio.write_varint(w.table, n)
    if n == 0:
        return
    neg = np.flatnonzero(d < 0)
    mag = np.abs(d) - 1
    m_off = int(mag.min())
    nz = np.flatnonzero(mag > m_off)
    k_val = bitio.best_rice_k((mag[nz] - m_off - 1).astype(np.uint64))[0] if nz.size else 0
    steps = _Writer()
    steps.coded_set(neg, n)
    steps.coded_set(nz, n)
    if nz.size:
        steps.rice((mag[nz] - m_off - 1).astype(np.uint64), k_val)
    mb = spec.exp_shift
    new = new.astype(np.int64) & ((1 << spec.bits) - 1)
    e_new = (new >> mb) & ((1 << spec.exp_bits) - 1)
    e_ref = int(np.argmax(np.bincount(e_new, minlength=spec.n_exponents)))
    zz = zigzag(e_new - e_ref).astype(np.uint64)
    k_lit = bitio.best_rice_k(zz)[0]
    lit_v = (zz << np.uint64(mb + 1)) | ((new >> (spec.bits - 1)) << mb).astype(np.uint64) | (new & ((1 << mb) - 1)).astype(np.uint64)
    literal = _Writer()
    literal.rice(lit_v, k_lit + mb + 1)
    one = lambda v: np.array([v], np.int64)  # noqa: E731
    w.coded_set(ranks, size)
    if literal_choice(one(n), one(neg.size), one(m_off), one(nz.size), one(_bits(steps)), one(_bits(literal)),
                      one(e_ref), one(k_lit))[0]:
        for v in (n + 1, e_ref, k_lit):
            bitio.write_varint(w.table, v)
        w.q += literal.q
        w.r += literal.r
        return
    for v in (neg.size, m_off, nz.size):
        bitio.write_varint(w.table, v)
    if nz.size:
        w.table.append(k_val)
    w.q += steps.q
    w.r += steps.r


def encode_dcr(base_bits: np.ndarray, positions: np.ndarray, new_bits: np.ndarray, spec: DtypeSpec) -> bytes:
    """Body of a ``dcr`` record for a non-empty change set.

    Vectorized over groups (``nemo_dcr.kernels``): one blocked pass over the base for the
    class ranks, then whole-array work proportional to the changes.
    """
    from ..kernels.dcr_encode import encode_body
    from ..kernels.index import encoder_sorted_pos_np
    from ..kernels.xp import NumpyOps

    return encode_body(NumpyOps(), base_bits, np.asarray(positions, np.int64), new_bits, spec, encoder_sorted_pos_np)


def encode_dcr_per_group(base_bits: np.ndarray, positions: np.ndarray, new_bits: np.ndarray, spec: DtypeSpec) -> bytes:
    """The straightforward group-by-group encoder (reference for tests and benchmarks)."""
    lo, widths = choose_groups(spec.exponent(base_bits[positions]), spec.n_exponents)
    index = GroupIndex.build(base_bits, spec, lo, widths)
    mask = np.zeros(base_bits.size, dtype=bool)
    mask[positions] = True
    changed_sorted = mask[index.order]
    w = _Writer()
    for v in (lo, len(widths), *widths):
        bitio.write_varint(w.table, v)
    for g in range(len(widths)):
        ranks = np.flatnonzero(changed_sorted[index.starts[g] : index.starts[g + 1]])
        pos_g = index.members(g)[ranks]
        sel = np.searchsorted(positions, pos_g)
        _encode_group(w, ranks, index.size(g), signed_steps(base_bits[pos_g], new_bits[sel], spec), new_bits[sel], spec)
    return w.finish()


from .dcr_decode import decode_dcr  # noqa: E402,F401  (decoder lives in its own module)
