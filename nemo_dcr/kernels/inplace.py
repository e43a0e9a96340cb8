"""The one in-place write of the package: bits into a tensor's integer view, at flat positions.

Every writer (the engine transaction and its undo log, the trainer baseline and mirror, test
references) goes through :func:`write_bits`, every gather of bits at positions (undo log, the
encoder's old bits) through :func:`read_bits`, and the transaction's read-back check through
:func:`unequal_at`; they work on tensors of any device and on contiguous numpy bit arrays, and
take positions and bits as numpy arrays or torch tensors.  On the host they are compiled loops (:mod:`.cpu`) that check every position before the
first write, reached through numpy views without any torch op per call (a call costs a few
microseconds whatever its size: a refit makes several per tensor); on other devices
``index_put_`` and indexing on the integer view, host arrays crossing through the counted
copies of :mod:`.traffic`.
"""

from __future__ import annotations

import numpy as np
import torch

from ..types import CARRIER_NP, int_view
from .cpu import gather, scatter, unequal
from .traffic import on_host, to_device


def _crosses(t: torch.Tensor, device) -> bool:
    """A torch tensor that is host memory while ``device`` is not (it then goes as a host array)."""
    return t.device.type == "cpu" and torch.device(device).type != "cpu"


def _as_index(positions, device) -> torch.Tensor:
    if isinstance(positions, torch.Tensor) and not _crosses(positions, device):
        return positions.to(device=device, dtype=torch.int64)
    if isinstance(positions, torch.Tensor):
        positions = positions.numpy()
    return to_device(np.ascontiguousarray(positions, dtype=np.int64), device)


def _as_bits(bits, like: torch.Tensor) -> torch.Tensor:
    if isinstance(bits, torch.Tensor) and _crosses(bits, like.device):
        bits = bits.numpy()
    t = bits if isinstance(bits, torch.Tensor) else to_device(np.asarray(bits), like.device)
    if t.element_size() != like.element_size():
        raise ValueError(f"bits of {t.element_size()} bytes for a {like.element_size()}-byte tensor")
    return t.to(like.device).view(like.dtype)


def width_of(target: torch.Tensor | np.ndarray) -> int:
    """Bytes per element of a write target: a tensor or a numpy bit array."""
    return target.itemsize if isinstance(target, np.ndarray) else target.element_size()


def count_of(positions: torch.Tensor | np.ndarray) -> int:
    """Number of positions (a tensor's or a numpy array's)."""
    return positions.size if isinstance(positions, np.ndarray) else positions.numel()


def _host_index(positions) -> np.ndarray:
    if isinstance(positions, torch.Tensor):
        positions = positions.cpu().numpy()
    return np.ascontiguousarray(positions, dtype=np.int64).reshape(-1)


def _host_view(target: torch.Tensor | np.ndarray) -> np.ndarray | None:
    """The flat signed-integer numpy view of a host tensor or contiguous numpy array (shares
    memory); None on a device."""
    if isinstance(target, np.ndarray):
        if not target.flags.c_contiguous:
            raise ValueError("in-place bits need a contiguous array")
        return target.reshape(-1).view(CARRIER_NP[target.itemsize])
    if not on_host(target):
        return None
    return int_view(target).numpy()


def _host_bits(bits, dst: np.ndarray, count: int) -> np.ndarray:
    """``bits`` (numpy or torch, ``dst``'s width) as a flat numpy array of ``dst``'s dtype."""
    a = bits.detach().cpu().reshape(-1).numpy() if isinstance(bits, torch.Tensor) else np.asarray(bits).reshape(-1)
    if a.itemsize != dst.itemsize:
        raise ValueError(f"bits of {a.itemsize} bytes for a {dst.itemsize}-byte tensor")
    if a.size != count:
        raise ValueError(f"{count} positions for {a.size} values")
    return np.ascontiguousarray(a).view(CARRIER_NP[dst.itemsize])


def _check(bad: int, positions: np.ndarray, n: int) -> None:
    if bad >= 0:
        raise IndexError(f"position {int(positions[bad])} (entry {bad}) outside a tensor of {n} elements")


def write_bits(target: torch.Tensor | np.ndarray, positions, bits) -> None:
    """``target.flat[positions] = bits`` through integer views (in place, any device).

    Args:
        target: contiguous tensor (float, or already an integer view), or contiguous numpy array
            of bits.
        positions: flat int64 indices (numpy or torch), each in ``[0, numel)``.
        bits: the new bits, same width as ``target``'s elements (unsigned numpy or any torch int).

    Raises:
        IndexError: a position is outside the tensor (nothing written).
    """
    dst = _host_view(target)
    if dst is None:
        view = int_view(target)
        view.index_put_((_as_index(positions, view.device),), _as_bits(bits, view))
        return
    pos = _host_index(positions)
    _check(scatter(dst, pos, _host_bits(bits, dst, pos.size)), pos, dst.size)


def read_bits(target: torch.Tensor | np.ndarray, positions) -> torch.Tensor | np.ndarray:
    """The integer bits of ``target.flat[positions]``: a copy, on ``target``'s device (a numpy
    array of ``target``'s dtype for a numpy ``target``)."""
    src = _host_view(target)
    if src is None:
        view = int_view(target)
        return view[_as_index(positions, view.device)]
    pos = _host_index(positions)
    out = np.empty(pos.size, src.dtype)
    _check(gather(src, pos, out), pos, src.size)
    return out.view(target.dtype) if isinstance(target, np.ndarray) else torch.from_numpy(out)


def unequal_at(target: torch.Tensor, positions, bits) -> int:
    """The first entry ``i`` where ``target.flat[positions[i]]`` does not hold ``bits[i]`` (-1: every
    element holds its bits); reads only those elements (any device), writes nothing.

    Raises:
        IndexError: a position is outside the tensor.
    """
    view = _host_view(target)
    if view is None:
        view = int_view(target)
        idx = _as_index(positions, view.device)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= view.numel()):
            raise IndexError(f"a position outside a tensor of {view.numel()} elements")
        ne = torch.nonzero(view[idx] != _as_bits(bits, view).reshape(-1)).reshape(-1)
        return int(ne[0]) if ne.numel() else -1
    pos = _host_index(positions)
    bad, first = unequal(view, pos, _host_bits(bits, view, pos.size))
    _check(bad, pos, view.size)
    return int(first)
