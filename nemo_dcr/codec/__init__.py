"""Delta codec: wire format in docs/wire_format.md.

Usage::

    from nemo_dcr import codec
    payload = codec.encode(base_tensors, target_tensors, codec.Identity(base_version=3, target_version=4))
    touched = codec.apply(engine_tensors, payload)   # validates everything, then writes in place
"""

from .dcr import DcrIndex, DcrIndexes, MovedIndexes
from .errors import DeltaFormatError
from .header import header_limit
from .payload import DecodedPayload, Identity, apply, decode, decode_parts, diff_tensors, encode, encode_deltas, inspect

__all__ = ["DcrIndex", "DcrIndexes", "DeltaFormatError", "DecodedPayload", "Identity", "MovedIndexes", "apply",
           "decode", "decode_parts", "diff_tensors", "encode", "encode_deltas", "header_limit", "inspect"]
