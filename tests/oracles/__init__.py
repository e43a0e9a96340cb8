"""Independent oracles of the ``dcr`` coder (docs/wire_format.md section 4.4), for tests and
benchmarks only.

The package has one coder, the compiled one (:func:`nemo_dcr.codec.dcr.encode_dcr` /
:func:`~nemo_dcr.codec.dcr.decode_dcr`).  These are written apart from it, byte-identical to it
(the golden payloads pin the bytes), and share none of its code:

* :func:`encode_dcr_np` / :func:`decode_dcr_np`: the vectorized numpy coder (the reference of
  the byte-identity tests; :mod:`.xp` runs the same algorithm on numpy or torch);
* :func:`encode_dcr_torch` / :func:`decode_dcr_torch`: that algorithm on torch tensors of any device;
* :func:`encode_dcr_per_group` / :func:`decode_dcr_per_group`: the straightforward
  group-by-group coder;
* :mod:`.keys`, :mod:`.bitio`: monotone keys and ULP steps, varints and Rice codes on numpy arrays.
"""

from .decode import decode_dcr_np
from .encode import encode_dcr_np
from .per_group import decode_dcr_per_group, encode_dcr_per_group
from .torch_codec import decode_dcr_torch, encode_dcr_torch

__all__ = ["decode_dcr_np", "decode_dcr_per_group", "decode_dcr_torch", "encode_dcr_np", "encode_dcr_per_group",
           "encode_dcr_torch"]
