"""Device-agnostic numeric kernels shared by the stages (torch and numpy only; no codec imports):
the capture scan and the one in-place write of bits."""

from .inplace import read_bits, write_bits
from .scan import changed_positions, scan_changes

__all__ = ["changed_positions", "read_bits", "scan_changes", "write_bits"]
