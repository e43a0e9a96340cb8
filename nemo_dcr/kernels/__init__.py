"""Numeric kernels shared by the stages (no codec imports): the capture scan and the one in-place
write of bits; compiled numba loops on the host (:mod:`.cpu`, declared through :mod:`.jit`),
torch ops on other devices; every host <-> device copy of the data path counted (:mod:`.traffic`)."""

from .inplace import read_bits, unequal_at, write_bits
from .scan import changed_positions, count_equal, scan_changes

__all__ = ["changed_positions", "count_equal", "read_bits", "scan_changes", "unequal_at", "write_bits"]
