"""``dcr`` encode/decode of one record on torch tensors (any device), byte-identical to
:func:`nemo_dcr.codec.dcr.encode_dcr` / :func:`~nemo_dcr.codec.dcr.decode_dcr` (an oracle of
the tests: the package has no device coder)."""

from __future__ import annotations

import torch

from nemo_dcr.types import int_view, spec_of
from .decode import decode_body
from .encode import encode_body
from .index import DecoderIndexTorch, encoder_sorted_pos_torch
from .xp import TorchOps


def encode_dcr_torch(base: torch.Tensor, positions: torch.Tensor, new_bits: torch.Tensor) -> bytes:
    """Body of a ``dcr`` record; ``base`` a float tensor (or its integer view with ``dtype`` known
    through the float tensor), ``positions`` strictly increasing int64, ``new_bits`` the new
    values' integer view.  All work runs on ``base.device``; only the body comes to the host."""
    spec = spec_of(base.dtype)
    bits = int_view(base)
    ops = TorchOps(bits.device)
    pos = positions.to(bits.device, torch.int64)
    new = int_view(new_bits).to(bits.device)
    return encode_body(ops, bits, pos, new, spec, encoder_sorted_pos_torch)


def decode_dcr_torch(body, base: torch.Tensor, name: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """Positions (int64, increasing) and new bits (integer view dtype) on ``base.device``."""
    spec = spec_of(base.dtype)
    bits = int_view(base)
    pos, new = decode_body(TorchOps(bits.device), body, bits, spec, name, DecoderIndexTorch)
    if spec.width > 1:  # unsigned int64 -> signed integer view of the same width
        new = new - ((new >> (spec.bits - 1)) << spec.bits)
    return pos, new.to(bits.dtype)
