"""Groups of the ``dcr`` record coding (docs/wire_format.md section 4.4), written apart from the
library: which exponent classes share a group, the class-ordered index of a base tensor, and the
Rice parameter of a coded set (Python integers)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from nemo_dcr.codec.dcr.jit_encode import MIN_GROUP_CHANGES  # an encoder choice both coders share
from nemo_dcr.types import DtypeSpec


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
