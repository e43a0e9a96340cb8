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

from nemo_dcr.quant.fp8 import (
    Fp8Error,
    Fp8Scheme,
    Fp8ShapeError,
    NonFiniteWeightError,
    check_matrix_shape,
    quantize,
    quantize_values,
    quantize_with_reciprocal,
    scale_inv_from_amax,
)
from nemo_dcr.types import SparseDelta, bits_view

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


def bf16_values(bits: np.ndarray) -> torch.Tensor:
    """fp32 tensor of the values of bf16 bit patterns (exact)."""
    return torch.from_numpy(np.ascontiguousarray(bits, dtype=np.uint16).view(np.int16)).view(torch.bfloat16).float()


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
    if not bool((amax >= 0).all()) or not bool(torch.isfinite(amax).all()):
        raise Fp8Error(f"{name}: amax state holds negative, NaN or Inf values: it is not a quantization state")
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


def _finite(name: str, values: torch.Tensor, positions: np.ndarray, what: str) -> None:
    bad = (~torch.isfinite(values)).nonzero().reshape(-1).numpy()
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
        k = int(rank[-1]) + 1
        out[s : s + k] = torch.zeros(k).scatter_reduce_(0, torch.from_numpy(rank), vals.abs(), "amax").numpy()
    return out


def _quantize_bytes(values: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    """FP8 bytes (uint8) of fp32 ``values`` with their per-element fp32 ``scales``."""
    return _bits(quantize_values(values, scales), np.uint8)


@dataclass(frozen=True)
class _Blocks:
    """Per-block view of one step: block id of each changed element, old and new amax and scales."""

    bid: torch.Tensor  # block id (row-major over the grid) of each changed element
    touched: torch.Tensor  # bool per block
    rescan: torch.Tensor  # bool per block: amax recomputed over the whole block
    amax: torch.Tensor  # new amax per block
    s0: torch.Tensor  # old scale per block
    s1: torch.Tensor  # new scale per block
    rescaled: torch.Tensor  # bool per block: scale bits changed


def _blocks(delta, flat, amax, old_v, new_v, shape, block) -> _Blocks:
    """Block ids of the changed elements and the new amax / scale of every block (no sort)."""
    (_, n), (bm, bn) = shape, block
    gn, nblocks = -(-n // bn), amax.numel()
    rows = delta.positions // n  # numpy divides by a scalar without a hardware division per element
    bid = torch.from_numpy((rows // bm) * gn + (delta.positions - rows * n) // bn)
    max_old = torch.zeros(nblocks).scatter_reduce_(0, bid, old_v.abs(), "amax")
    max_new = torch.zeros(nblocks).scatter_reduce_(0, bid, new_v.abs(), "amax")
    touched = torch.bincount(bid, minlength=nblocks) > 0
    a0 = amax.reshape(-1)
    rescan = touched & ~(max_old < a0)  # a changed element held the old maximum
    a1 = torch.where(touched, torch.maximum(a0, max_new), a0)
    if bool(rescan.any()):
        ids = rescan.nonzero().reshape(-1).numpy()
        a1[rescan] = torch.from_numpy(_rescan_amax(delta.name, flat, ids, shape, block))
    s0, s1 = scale_inv_from_amax(a0), scale_inv_from_amax(a1)
    rescaled = touched & (s0.view(torch.int32) != s1.view(torch.int32))
    return _Blocks(bid, touched, rescan, a1, s0, s1, rescaled)


def _element_changes(delta, old_v, new_v, b: _Blocks):
    """Changed bytes of changed elements in blocks whose scale is unchanged (positions stay sorted)."""
    q0 = quantize_with_reciprocal(old_v, (1.0 / b.s0)[b.bid]).view(torch.uint8)
    q1 = quantize_with_reciprocal(new_v, (1.0 / b.s1)[b.bid]).view(torch.uint8)
    keep = ((q0 != q1) & ~b.rescaled[b.bid]).numpy()
    return delta.positions[keep], q1.numpy()[keep], q0.numpy()[keep]


def _rescaled_changes(delta, flat, b: _Blocks, shape, block):
    """Changed bytes of the whole blocks whose scale changed, re-quantized with old and new scales."""
    blocks = b.rescaled.nonzero().reshape(-1).numpy()
    inside = b.rescaled[b.bid].numpy()
    c_pos, c_old, c_bid = delta.positions[inside], delta.old_bits[inside], b.bid.numpy()[inside]
    parts = []
    for s in range(0, blocks.size, BLOCK_CHUNK):
        chunk = blocks[s : s + BLOCK_CHUNK]
        idx, rank = block_elements(chunk, shape, block)
        order = np.argsort(idx)
        idx, ids = idx[order], torch.from_numpy(chunk[rank[order]])
        bits = flat[idx]
        old_bits = bits.copy()
        mine = np.isin(c_bid, chunk)
        old_bits[np.searchsorted(idx, c_pos[mine])] = c_old[mine]
        q1 = _quantize_bytes(bf16_values(bits), b.s1[ids])
        q0 = _quantize_bytes(bf16_values(old_bits), b.s0[ids])
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
    shape, block, grid = tuple(new.shape), scheme.block_for(new.shape), scheme.grid(new.shape)
    old_v, new_v = bf16_values(delta.old_bits), bf16_values(delta.new_bits)
    _finite(delta.name, new_v, delta.positions, "target")
    _finite(delta.name, old_v, delta.positions, "base")
    b = _blocks(delta, flat, amax, old_v, new_v, shape, block)
    parts = [_element_changes(delta, old_v, new_v, b)]
    if bool(b.rescaled.any()):
        parts += _rescaled_changes(delta, flat, b, shape, block)
    pos, new_bits, old_bits = (np.concatenate(x) for x in zip(*parts))
    if len(parts) > 1:
        srt = np.argsort(pos, kind="stable")
        pos, new_bits, old_bits = pos[srt], new_bits[srt], old_bits[srt]
    weight = SparseDelta(delta.name, "fp8_e4m3", shape, pos.astype(np.int64), new_bits, old_bits)
    ids = b.rescaled.nonzero().reshape(-1)
    scale = SparseDelta(name, "fp32", grid, ids.numpy().astype(np.int64), _bits(b.s1[ids], np.uint32),
                        _bits(b.s0[ids], np.uint32))
    stats = Fp8DeltaStats(delta.numel, grid[0] * grid[1], delta.nnz, weight.nnz, int(b.touched.sum()),
                          int(ids.numel()), int(b.rescan.sum()))
    return Fp8TensorDelta(weight, scale, b.amax.reshape(grid), stats)


def requantized_delta(delta: SparseDelta, new: torch.Tensor, weight_bits: np.ndarray, scale_bits: np.ndarray,
                      scheme: Fp8Scheme = Fp8Scheme(), scale_name: str | None = None) -> Fp8TensorDelta:
    """FP8 changes of one weight by quantizing the new target whole and comparing with what the
    engine holds (cost ~ elements, for large deltas; equal to :func:`fp8_delta`'s result).

    Args:
        delta: BF16 changes ``W0 -> W1`` of the weight (only counted here).
        new: the whole new target ``W1`` (bf16, 2-D).
        weight_bits, scale_bits: the engine's flat bits of ``Q(W0)``: FP8 bytes and fp32 scales.
        scheme, scale_name: as for :func:`fp8_delta`.

    Raises:
        Fp8Error: NaN/Inf in the target.
    """
    name = scale_name or scale_tensor_name(delta.name, scheme)
    q = quantize(new, scheme, delta.name)
    weight, scale = _changed(delta.name, "fp8_e4m3", q.weight, weight_bits), _changed(name, "fp32", q.scale, scale_bits)
    n, (bm, bn) = new.shape[1], scheme.block_for(new.shape)
    rows = delta.positions // n
    touched = np.unique((rows // bm) * -(-n // bn) + (delta.positions - rows * n) // bn).size
    blocks = q.scale.numel()
    stats = Fp8DeltaStats(delta.numel, blocks, delta.nnz, weight.nnz, touched, scale.nnz, blocks)
    return Fp8TensorDelta(weight, scale, q.amax, stats)


def _changed(name: str, dtype: str, t: torch.Tensor, old: np.ndarray) -> SparseDelta:
    """The elements of ``t`` whose bits differ from ``old``, as a delta from ``old``."""
    new = bits_view(t.contiguous())
    pos = np.flatnonzero(new != old).astype(np.int64)
    return SparseDelta(name, dtype, tuple(t.shape), pos, new[pos], old[pos])


def scale_tensor_name(weight_name: str, scheme: Fp8Scheme = Fp8Scheme()) -> str:
    """``model.layers.0.mlp.down_proj.weight`` -> ``model.layers.0.mlp.down_proj.weight_scale_inv``."""
    if not weight_name.endswith("weight"):
        raise Fp8Error(f"{weight_name}: only tensors named '*weight' are quantized")
    return weight_name[: -len("weight")] + scheme.scale_suffix
