"""Capture scan and in-place apply on the tensor's own device (integer views, chunked)."""

from __future__ import annotations

import numpy as np
import torch

from ..codec.dtypes import spec_of

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
DEFAULT_CHUNK = 1 << 26


def int_bits(t: torch.Tensor) -> torch.Tensor:
    """Flat same-width integer view of a contiguous tensor (shares memory, any device)."""
    if not t.is_contiguous():
        raise ValueError("kernels need contiguous tensors (a view would silently copy)")
    if t.dtype in _INT.values():
        return t.detach().reshape(-1)
    return t.detach().reshape(-1).view(_INT[spec_of(t.dtype).width])


def changed_positions(cur: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """Flat positions (int64, increasing) where two same-shape 1-D integer views differ.

    On the host this goes through numpy (``flatnonzero`` of the ``!=`` mask runs about 4x
    faster than ``torch.nonzero`` on one CPU core); on a GPU it stays a torch op on the device.
    """
    if cur.device.type == "cpu":
        return torch.from_numpy(np.flatnonzero(cur.numpy() != old.numpy()))
    return torch.nonzero(cur != old).reshape(-1)


def scan_changes(current: torch.Tensor, base: torch.Tensor, chunk: int = DEFAULT_CHUNK):
    """Changed positions (int64) and new bits of ``current`` vs ``base``, on their device.

    Compares integer views chunk by chunk (scratch memory bounded by ``chunk`` elements);
    nothing moves to the host.
    """
    cur, old = int_bits(current), int_bits(base)
    if cur.shape != old.shape or cur.dtype != old.dtype or cur.device != old.device:
        raise ValueError(f"scan needs same-size tensors on one device, got {cur.dtype}{tuple(cur.shape)} "
                         f"on {cur.device} vs {old.dtype}{tuple(old.shape)} on {old.device}")
    pos = []
    for s in range(0, cur.numel(), chunk):
        idx = changed_positions(cur[s : s + chunk], old[s : s + chunk])
        pos.append(idx + s if s else idx)
    positions = torch.cat(pos) if pos else torch.zeros(0, dtype=torch.int64, device=cur.device)
    return positions, cur[positions]


def apply_changes(target: torch.Tensor, positions: torch.Tensor, new_bits: torch.Tensor) -> None:
    """Write ``new_bits`` at ``positions`` into ``target`` in place (integer view index_put)."""
    view = int_bits(target)
    view.index_put_((positions.to(view.device),), new_bits.to(view.device).view(view.dtype))
