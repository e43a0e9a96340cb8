"""The ``dcr`` record coding (docs/wire_format.md section 4.4), conditioned on what the receiver holds.

Four implementations, byte-identical:

* :func:`encode_dcr` / :func:`decode_dcr`: the host coder, compiled kernels; with a kept
  :class:`DcrIndex` (held per tensor in a :class:`DcrIndexes`) its cost follows the changes,
  without one it makes one pass over the base.
* :func:`encode_dcr_np` / :func:`decode_dcr_np`: the vectorized numpy coder (test reference).
* :func:`encode_dcr_torch` / :func:`decode_dcr_torch`: the same vectorized coder on torch
  tensors (any device; the GPU path).
* :func:`encode_dcr_per_group` / :func:`decode_dcr_per_group`: the group-by-group reference.
"""

from .class_index import DcrIndex, DcrIndexes, StaleIndexError
from .decode import decode_dcr_np
from .encode import encode_dcr_np
from .jit_codec import decode_dcr, encode_dcr
from .per_group import decode_dcr_per_group, encode_dcr_per_group
from .torch_codec import decode_dcr_torch, encode_dcr_torch

__all__ = ["DcrIndex", "DcrIndexes", "StaleIndexError", "decode_dcr", "decode_dcr_np", "decode_dcr_per_group",
           "decode_dcr_torch", "encode_dcr", "encode_dcr_np", "encode_dcr_per_group", "encode_dcr_torch"]
