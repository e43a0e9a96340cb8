"""The one in-place write of the package: bits into a tensor's integer view, at flat positions.

Every writer (the engine transaction and its undo log, the trainer baseline, test references)
goes through :func:`write_bits`; it works on any device (``index_put_`` on the integer view),
and takes positions and bits as numpy arrays or torch tensors.
"""

from __future__ import annotations

import numpy as np
import torch

from ..types import carrier, int_view


def _as_index(positions, device) -> torch.Tensor:
    if isinstance(positions, torch.Tensor):
        return positions.to(device=device, dtype=torch.int64)
    return torch.from_numpy(np.ascontiguousarray(positions, dtype=np.int64)).to(device)


def _as_bits(bits, like: torch.Tensor) -> torch.Tensor:
    t = bits if isinstance(bits, torch.Tensor) else carrier(np.asarray(bits))
    if t.element_size() != like.element_size():
        raise ValueError(f"bits of {t.element_size()} bytes for a {like.element_size()}-byte tensor")
    return t.to(like.device).view(like.dtype)


def write_bits(target: torch.Tensor, positions, bits) -> None:
    """``target.flat[positions] = bits`` through integer views (in place, any device).

    Args:
        target: contiguous tensor (float, or already an integer view).
        positions: flat int64 indices (numpy or torch).
        bits: the new bits, same width as ``target``'s elements (unsigned numpy or any torch int).
    """
    view = int_view(target)
    view.index_put_((_as_index(positions, view.device),), _as_bits(bits, view))


def read_bits(target: torch.Tensor, positions) -> torch.Tensor:
    """The integer bits of ``target.flat[positions]`` (a copy, on ``target``'s device)."""
    view = int_view(target)
    return view[_as_index(positions, view.device)]
