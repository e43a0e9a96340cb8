"""Device-agnostic kernels (torch and numpy only): capture scan, in-place apply and the ``dcr``
record coding, producing exactly the bytes of :mod:`nemo_dcr.codec` on any torch device."""

from .scan import apply_changes, scan_changes
from .torch_codec import decode_dcr_torch, encode_dcr_torch

__all__ = ["scan_changes", "apply_changes", "encode_dcr_torch", "decode_dcr_torch"]
