"""Capture scan on the tensor's own device (integer views).

On the host the scan is one compiled pass (:func:`nemo_dcr.kernels.cpu.scan_words`: a cache
line of both tensors compared as 64-bit words, elements looked at only where a line differs);
on a GPU it stays a torch op on the device, chunked to bound the mask's scratch memory.
"""

from __future__ import annotations

import numpy as np
import torch

from ..types import int_view
from .cpu import changed_at, scan_words

DEFAULT_CHUNK = 1 << 26


def _words(a: np.ndarray) -> np.ndarray:
    """uint64 view of the whole 8-byte words at the start of a 1-D contiguous array."""
    raw = a.view(np.uint8)
    return raw[: raw.size - raw.size % 8].view(np.uint64)


def changes_np(cur: np.ndarray, old: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Positions (int64, increasing), new and old bits where two same-size 1-D integer arrays differ
    (one compiled pass)."""
    cur, old = np.ascontiguousarray(cur), np.ascontiguousarray(old)
    return scan_words(cur, old, _words(cur), _words(old), 8 // cur.itemsize)


def changed_bits_np(cur: np.ndarray, old: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Positions (int64, increasing) and new bits where two same-size 1-D integer arrays differ."""
    return changes_np(cur, old)[:2]


def changes_at(bits: np.ndarray, positions: np.ndarray, new_bits: np.ndarray):
    """Positions, new and old bits of the entries where 1-D ``bits[positions]`` differs from
    ``new_bits`` (one compiled pass; entries kept in their order).

    Raises:
        IndexError: a position is outside ``bits``.
    """
    positions = np.ascontiguousarray(positions, np.int64)
    new_bits = np.ascontiguousarray(new_bits)
    if positions.size != new_bits.size:
        raise ValueError(f"{positions.size} positions for {new_bits.size} values")
    bad, pos, new, old = changed_at(np.ascontiguousarray(bits), positions, new_bits)
    if bad >= 0:
        raise IndexError(f"position {int(positions[bad])} (entry {bad}) outside {bits.size} elements")
    return pos, new, old


def count_equal(a: np.ndarray, b: np.ndarray, chunk: int = 1 << 20) -> int:
    """Entries where same-size 1-D arrays ``a == b``, in chunks (no array-sized temporary)."""
    return sum(int(np.count_nonzero(a[s : s + chunk] == b[s : s + chunk])) for s in range(0, a.size, chunk))


def changed_positions(cur: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """Flat positions (int64, increasing) where two same-shape 1-D integer views differ."""
    if cur.device.type == "cpu":
        return torch.from_numpy(changed_bits_np(cur.numpy(), old.numpy())[0])
    return torch.nonzero(cur != old).reshape(-1)


def scan_changes(current: torch.Tensor, base: torch.Tensor, chunk: int = DEFAULT_CHUNK):
    """Changed positions (int64) and new bits of ``current`` vs ``base``, on their device.

    Compares integer views (on a GPU chunk by chunk: scratch memory bounded by ``chunk``
    elements); nothing moves to the host.
    """
    cur, old = int_view(current), int_view(base)
    if cur.shape != old.shape or cur.dtype != old.dtype or cur.device != old.device:
        raise ValueError(f"scan needs same-size tensors on one device, got {cur.dtype}{tuple(cur.shape)} "
                         f"on {cur.device} vs {old.dtype}{tuple(old.shape)} on {old.device}")
    if cur.device.type == "cpu":
        pos, new = changed_bits_np(cur.numpy(), old.numpy())
        return torch.from_numpy(pos), torch.from_numpy(new)
    pos = []
    for s in range(0, cur.numel(), chunk):
        idx = torch.nonzero(cur[s : s + chunk] != old[s : s + chunk]).reshape(-1)
        pos.append(idx + s if s else idx)
    positions = torch.cat(pos) if pos else torch.zeros(0, dtype=torch.int64, device=cur.device)
    return positions, cur[positions]
