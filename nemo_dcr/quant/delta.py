"""Trainer side: the FP8 changes that turn an engine's quantized weight into the new target's.

The engine holds ``Q(W0)`` (bytes ``q0``, scales ``s0``) for the BF16 target ``W0`` it was last
synced to; the trainer has the new target ``W1`` and the BF16 delta ``W0 -> W1`` (positions, new
and old bits: :class:`~nemo_dcr.capture.SparseDelta`). Only blocks holding a changed BF16
element can change. For each such block:

* its new ``amax``: if every changed element was strictly below the old ``amax`` before the
  step, the old maximum is still there and ``amax' = max(amax, max |new changed|)`` (cost ~
  changed elements); otherwise the block is rescanned (cost ~ block size);
* scale bits unchanged: only the changed elements are re-quantized, with the same scale, and the
  ones whose FP8 byte differs are sent;
* scale bits changed: the whole block is re-quantized with the new scale (and the old bytes
  rebuilt from ``W0`` = ``W1`` with the old bits put back), and every byte that differs is sent,
  with the new scale.

The result is two :class:`SparseDelta` per weight, ``X.weight`` (``fp8_e4m3``) and its scale
tensor (``fp32``), that the codec encodes like any other record; applying them to ``Q(W0)``
gives exactly ``Q(W1)`` (tests check this against an independent quantizer). The trainer keeps
one fp32 ``amax`` per block (``Fp8Weight.amax``) as state and moves it forward only when the
engine acknowledged, like the BF16 baseline.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from nemo_dcr.capture.delta import SparseDelta
from nemo_dcr.codec.dtypes import bits_view
from nemo_dcr.quant.fp8 import (
    Fp8Error,
    Fp8Scheme,
    Fp8ShapeError,
    NonFiniteWeightError,
    check_matrix_shape,
    quantize_values,
    scale_inv_from_amax,
)

BLOCK_CHUNK = 64
"""Whole blocks re-quantized at a time (bounds scratch memory to ~BLOCK_CHUNK * block size)."""


@dataclass(frozen=True)
class Fp8DeltaStats:
    """What one weight's FP8 delta cost and changed (counted, not estimated).

    Attributes:
        numel: elements of the weight.
        blocks: blocks of its grid.
        bf16_changed: changed BF16 elements of the input delta.
        fp8_changed: FP8 bytes that differ (what is sent).
        blocks_touched: blocks holding at least one changed BF16 element.
        blocks_rescaled: blocks whose scale bits changed (re-quantized whole).
        blocks_rescanned: blocks whose amax had to be recomputed over the whole block.
    """

    numel: int
    blocks: int
    bf16_changed: int
    fp8_changed: int
    blocks_touched: int
    blocks_rescaled: int
    blocks_rescanned: int


@dataclass(frozen=True)
class Fp8TensorDelta:
    """FP8 changes of one weight.

    Attributes:
        weight: changed bytes of ``X.weight`` (dtype ``fp8_e4m3``, old bits included).
        scale: changed scales of ``X.weight_scale_inv`` (dtype ``fp32``, old bits included).
        amax: the block maxima of the new target (state to keep once acknowledged).
        stats: counts.
    """

    weight: SparseDelta
    scale: SparseDelta
    amax: torch.Tensor
    stats: Fp8DeltaStats


def bf16_values(bits: np.ndarray) -> np.ndarray:
    """float32 values of bf16 bit patterns (exact)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def _bits(t: torch.Tensor, dtype) -> np.ndarray:
    signed = {np.uint8: torch.uint8, np.uint32: torch.int32}[dtype]
    return t.contiguous().view(signed).numpy().view(dtype)


def _check_inputs(delta: SparseDelta, new: torch.Tensor, amax: torch.Tensor, scheme: Fp8Scheme) -> np.ndarray:
    """Validate the inputs of :func:`fp8_delta`; returns ``new``'s flat bf16 bits."""
    name = delta.name
    check_matrix_shape(new.shape, name)
    if delta.dtype != "bf16" or new.dtype != torch.bfloat16:
        raise Fp8Error(f"{name}: the FP8 delta needs a bf16 delta and target, got {delta.dtype} / {new.dtype}")
    if tuple(delta.shape) != tuple(new.shape):
        raise Fp8ShapeError(f"{name}: delta shape {list(delta.shape)} vs target shape {list(new.shape)}")
    grid = scheme.grid(new.shape)
    if tuple(amax.shape) != grid or amax.dtype != torch.float32:
        raise Fp8ShapeError(f"{name}: amax state must be fp32 of the grid shape {list(grid)}, "
                            f"got {amax.dtype}{list(amax.shape)}")
    if delta.old_bits is None or delta.old_bits.size != delta.nnz or delta.new_bits.size != delta.nnz:
        raise Fp8Error(f"{name}: the FP8 delta needs old and new bits for every changed position")
    pos = delta.positions
    if pos.size and (pos[0] < 0 or pos[-1] >= delta.numel or (pos.size > 1 and (np.diff(pos) <= 0).any())):
        raise Fp8Error(f"{name}: positions must be strictly increasing flat indices below {delta.numel}")
    flat = bits_view(new.detach().cpu().contiguous())
    mismatch = np.flatnonzero(flat[pos] != delta.new_bits)
    if mismatch.size:
        raise Fp8Error(f"{name}: {mismatch.size} changed positions do not hold the delta's new bits in the target "
                       f"(first at flat index {int(pos[mismatch[0]])}): delta and target disagree")
    return flat


def _finite(name: str, values: np.ndarray, positions: np.ndarray, what: str) -> None:
    bad = np.flatnonzero(~np.isfinite(values))
    if bad.size:
        raise NonFiniteWeightError(f"{name}: {bad.size} NaN/Inf {what} values, first at flat index "
                                   f"{int(positions[bad[0]])} ({float(values[bad[0]])}); refusing to quantize")


def block_elements(blocks: np.ndarray, shape: tuple[int, int], block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """Flat element indices of ``blocks`` (row-major block ids) and each element's rank in ``blocks``.

    Edge blocks contribute only their elements inside ``shape``.
    """
    (m, n), (bm, bn) = shape, block
    gn = -(-n // bn)
    rows = (blocks // gn)[:, None] * bm + np.arange(bm)[None, :]
    cols = (blocks % gn)[:, None] * bn + np.arange(bn)[None, :]
    idx = rows[:, :, None] * n + cols[:, None, :]
    valid = (rows < m)[:, :, None] & (cols < n)[:, None, :]
    rank = np.broadcast_to(np.arange(blocks.size)[:, None, None], idx.shape)
    return idx[valid], rank[valid]


def _rescan_amax(name: str, flat: np.ndarray, blocks: np.ndarray, shape, block) -> np.ndarray:
    """Exact amax of whole ``blocks`` of the new target (refuses NaN/Inf)."""
    out = np.empty(blocks.size, dtype=np.float32)
    for s in range(0, blocks.size, BLOCK_CHUNK):
        idx, rank = block_elements(blocks[s : s + BLOCK_CHUNK], shape, block)
        vals = bf16_values(flat[idx])
        _finite(name, vals, idx, "target")
        starts = np.searchsorted(rank, np.arange(rank[-1] + 1))  # elements come grouped by block
        out[s : s + starts.size] = np.maximum.reduceat(np.abs(vals), starts)
    return out


def _quantize_np(values: np.ndarray, scales: torch.Tensor) -> np.ndarray:
    """FP8 bytes (uint8) of fp32 ``values`` with their per-element fp32 ``scales``."""
    return _bits(quantize_values(torch.from_numpy(values), scales), np.uint8)


def _touched_blocks(delta: SparseDelta, shape, block):
    """Changed elements grouped by block: block ids, group starts, the sort order and ranks."""
    (m, n), (bm, bn) = shape, block
    gn = -(-n // bn)
    pos = delta.positions
    bid = (pos // n // bm) * gn + (pos % n) // bn
    if -(-m // bm) * gn <= 1 << 16:
        bid = bid.astype(np.uint16)  # numpy's stable sort is a radix sort for 16-bit keys
    order = np.argsort(bid, kind="stable")
    touched, starts, counts = np.unique(bid[order], return_index=True, return_counts=True)
    rank = np.repeat(np.arange(touched.size), counts)  # block rank of each element in `order`
    return touched.astype(np.int64), starts, order, rank


def _new_amax(name, delta, flat, amax_flat, shape, block):
    """New amax of every touched block, and which blocks needed a rescan."""
    touched, starts, order, rank = _touched_blocks(delta, shape, block)
    old_v, new_v = bf16_values(delta.old_bits)[order], bf16_values(delta.new_bits)[order]
    _finite(name, new_v, delta.positions[order], "target")
    _finite(name, old_v, delta.positions[order], "base")
    if touched.size == 0:
        return touched, order, rank, np.zeros(0, np.float32), np.zeros(0, bool)
    max_old = np.maximum.reduceat(np.abs(old_v), starts)
    max_new = np.maximum.reduceat(np.abs(new_v), starts)
    a0 = amax_flat[touched]
    rescan = ~(max_old < a0)
    a1 = np.maximum(a0, max_new)
    if rescan.any():
        a1[rescan] = _rescan_amax(name, flat, touched[rescan], shape, block)
    return touched, order, rank, a1, rescan


def _kept_scale_changes(delta, order, rank, keep, s0, s1):
    """Changed bytes of changed elements in blocks whose scale is unchanged."""
    sel = keep[rank]
    pos = delta.positions[order][sel]
    r = torch.from_numpy(rank[sel])
    q0 = _quantize_np(bf16_values(delta.old_bits[order][sel]), s0[r])
    q1 = _quantize_np(bf16_values(delta.new_bits[order][sel]), s1[r])
    diff = q0 != q1
    return pos[diff], q1[diff], q0[diff]


def _rescaled_changes(changed, flat, blocks, s0, s1, shape, block):
    """Changed bytes of whole ``blocks`` whose scale changed (``s0``/``s1``: their old/new scales).

    ``changed`` = (positions, old bits, rank in ``blocks``) of the BF16 changes inside them.
    """
    c_pos, c_old, c_rank = changed
    parts = []
    for s in range(0, blocks.size, BLOCK_CHUNK):
        idx, rank = block_elements(blocks[s : s + BLOCK_CHUNK], shape, block)
        order = np.argsort(idx)
        idx, rank = idx[order], torch.from_numpy(rank[order] + s)
        bits = flat[idx]
        old_bits = bits.copy()
        mine = (c_rank >= s) & (c_rank < s + BLOCK_CHUNK)
        old_bits[np.searchsorted(idx, c_pos[mine])] = c_old[mine]
        q1 = _quantize_np(bf16_values(bits), s1[rank])
        q0 = _quantize_np(bf16_values(old_bits), s0[rank])
        diff = q0 != q1
        parts.append((idx[diff], q1[diff], q0[diff]))
    return parts


def fp8_delta(delta: SparseDelta, new: torch.Tensor, amax: torch.Tensor, scheme: Fp8Scheme = Fp8Scheme(),
              scale_name: str | None = None) -> Fp8TensorDelta:
    """FP8 changes of one weight from its BF16 delta.

    Args:
        delta: BF16 changes ``W0 -> W1`` of the weight, canonical flat positions, with old bits.
        new: the whole new target ``W1`` (bf16, 2-D; only touched blocks are read).
        amax: fp32 block maxima of ``W0`` (``quantize(W0).amax`` or the previous delta's ``amax``).
        scheme: the engine's quantization scheme.
        scale_name: name of the scale tensor (default: ``weight`` suffix replaced by the scheme's).

    Returns:
        The ``X.weight`` and scale changes, the new block maxima and counts.

    Raises:
        Fp8Error: inputs that disagree (shapes, dtypes, a target not matching the delta) or
            NaN/Inf in the values to quantize; nothing is returned then.
    """
    name = scale_name or scale_tensor_name(delta.name, scheme)
    flat = _check_inputs(delta, new, amax, scheme)
    shape, block = tuple(new.shape), scheme.block_for(new.shape)
    amax_flat = amax.reshape(-1).numpy()
    touched, order, rank, a1, rescan = _new_amax(delta.name, delta, flat, amax_flat, shape, block)
    s0 = scale_inv_from_amax(torch.from_numpy(amax_flat[touched]))
    s1 = scale_inv_from_amax(torch.from_numpy(a1))
    s0_bits, s1_bits = _bits(s0, np.uint32), _bits(s1, np.uint32)
    rescaled = s0_bits != s1_bits
    parts = [_kept_scale_changes(delta, order, rank, ~rescaled, s0, s1)]
    sel = rescaled[rank]
    new_rank = (np.cumsum(rescaled) - 1)[rank[sel]]  # rank among the rescaled blocks
    changed = (delta.positions[order][sel], delta.old_bits[order][sel], new_rank)
    parts += _rescaled_changes(changed, flat, touched[rescaled], s0[rescaled], s1[rescaled], shape, block)
    pos = np.concatenate([p[0] for p in parts]).astype(np.int64)
    srt = np.argsort(pos)
    weight = SparseDelta(delta.name, "fp8_e4m3", shape, pos[srt],
                         np.concatenate([p[1] for p in parts])[srt], np.concatenate([p[2] for p in parts])[srt])
    grid = scheme.grid(shape)
    scale = SparseDelta(name, "fp32", grid, touched[rescaled].astype(np.int64), s1_bits[rescaled], s0_bits[rescaled])
    new_amax = amax.clone()
    new_amax.view(-1)[torch.from_numpy(touched)] = torch.from_numpy(a1)
    stats = Fp8DeltaStats(delta.numel, grid[0] * grid[1], delta.nnz, weight.nnz, int(touched.size),
                          int(rescaled.sum()), int(rescan.sum()))
    return Fp8TensorDelta(weight, scale, new_amax, stats)


def scale_tensor_name(weight_name: str, scheme: Fp8Scheme = Fp8Scheme()) -> str:
    """``model.layers.0.mlp.down_proj.weight`` -> ``model.layers.0.mlp.down_proj.weight_scale_inv``."""
    if not weight_name.endswith("weight"):
        raise Fp8Error(f"{weight_name}: only tensors named '*weight' are quantized")
    return weight_name[: -len("weight")] + scheme.scale_suffix
