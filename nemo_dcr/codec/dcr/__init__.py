"""The ``dcr`` record coding (docs/wire_format.md section 4.4), conditioned on what the receiver holds.

* :func:`encode_dcr` / :func:`decode_dcr`: the vectorized coder on numpy (one pass over the base
  for the class ranks, then whole-array work proportional to the changes).
* :func:`encode_dcr_torch` / :func:`decode_dcr_torch`: the same coder on torch tensors (any device),
  byte-identical.
* :func:`encode_dcr_per_group` / :func:`decode_dcr_per_group`: the group-by-group reference.
"""

from .decode import decode_dcr
from .encode import encode_dcr
from .per_group import decode_dcr_per_group, encode_dcr_per_group
from .torch_codec import decode_dcr_torch, encode_dcr_torch

__all__ = ["decode_dcr", "decode_dcr_per_group", "decode_dcr_torch", "encode_dcr", "encode_dcr_per_group",
           "encode_dcr_torch"]
