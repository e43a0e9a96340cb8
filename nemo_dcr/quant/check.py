"""Engine side: refuse FP8 changes that cannot come from the quantizer, before anything is written.

The engine does not have the BF16 target, so it cannot recompute the bytes; the checksum of the
refit protocol proves equality with the trainer's target. What the engine can check on its own,
for every block a payload touches (a changed byte or a changed scale), on the values it would
hold after applying:

1. the scale tensor's shape is the weight's block grid, dtypes are ``fp8_e4m3`` / ``fp32``;
2. every new scale is finite and at least the convention's smallest scale
   ``max(amax, 1e-4) / 448 >= fl(1e-4) / 448`` (so in particular > 0);
3. no new byte is an e4m3fn NaN (``0x7F`` / ``0xFF``);
4. bytes agree with their scale: a block whose scale is above the smallest one held an element
   with ``|w| = amax``, which quantizes to exactly 448 (``amax * (1 / (amax / 448))`` is within a
   few fp32 ulps of 448), so the block's largest ``|byte|`` must be 448 (``0x7E``).

Rule 4 reads whole blocks only where it can change: blocks whose scale changes or where a byte at
448 changes.  Every other touched block keeps its scale and its byte at 448 (the engine's tensors
satisfy the rules: they were quantized at load, and every committed version passed them), so its
largest ``|byte|`` stays 448 (rule 3 keeps new bytes at most 448).  A sparse refit then costs in
proportion to its changes, not to the blocks they touch.

Each violation raises :class:`Fp8PayloadError` naming the tensor and the block.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from nemo_dcr.kernels.traffic import host_bits
from nemo_dcr.quant.delta import block_elements
from nemo_dcr.quant.fp8 import AMAX_FLOOR, Fp8Error, Fp8Scheme, check_scale_shape, scale_inv_from_amax
from nemo_dcr.types import SparseDelta, bits_view

E4M3_MAX_BITS = 0x7E
"""Magnitude bits of 448 in e4m3fn; ``0x7F`` is NaN."""
MIN_SCALE = float(scale_inv_from_amax(torch.tensor([AMAX_FLOOR]))[0])


class Fp8PayloadError(Fp8Error):
    """FP8 changes an engine must refuse: bad scales, NaN bytes, bytes that disagree with their scale."""


def _where(name: str, flat_block: int, grid: tuple[int, int]) -> str:
    return f"{name}: block ({flat_block // grid[1]}, {flat_block % grid[1]})"


def _check_new_scales(name: str, d: SparseDelta, grid) -> None:
    vals = d.new_bits.astype(np.uint32).view(np.float32)
    bad = np.flatnonzero(~np.isfinite(vals) | ~(vals >= np.float32(MIN_SCALE)))
    if bad.size:
        raise Fp8PayloadError(f"{_where(name, int(d.positions[bad[0]]), grid)}: new scale {float(vals[bad[0]])!r} "
                              f"is not finite or below the smallest scale {MIN_SCALE!r} ({bad.size} such)")


def _check_new_bytes(name: str, d: SparseDelta) -> None:
    bad = np.flatnonzero((d.new_bits & 0x7F) == 0x7F)
    if bad.size:
        raise Fp8PayloadError(f"{name}: new FP8 byte at flat index {int(d.positions[bad[0]])} is NaN "
                              f"(0x{int(d.new_bits[bad[0]]):02X}; {bad.size} such)")


def _touched(d: SparseDelta | None, shape, block) -> np.ndarray:
    if d is None or not d.nnz:
        return np.zeros(0, np.int64)
    n, gn = shape[1], -(-shape[1] // block[1])
    return (d.positions // n // block[0]) * gn + (d.positions % n) // block[1]


def _may_lose_max(blocks: np.ndarray, wd: SparseDelta | None, sd: SparseDelta | None, shape, block) -> np.ndarray:
    """Which of ``blocks`` rule 4 must rescan: a changed scale, or a changed byte that was at 448."""
    lost = np.zeros(0, np.int64) if sd is None else sd.positions
    if wd is not None and wd.nnz:
        at_max = (wd.old_bits & 0x7F) == E4M3_MAX_BITS
        lost = np.union1d(lost, _touched(SparseDelta(wd.name, wd.dtype, wd.shape, wd.positions[at_max],
                                                     wd.new_bits[at_max]), shape, block))
    return np.isin(blocks, lost)


def _block_max_bits(weight: np.ndarray, wd: SparseDelta | None, blocks: np.ndarray, shape, block) -> np.ndarray:
    """Largest ``|byte|`` code of each block after applying ``wd`` (nothing written)."""
    idx, rank = block_elements(blocks, shape, block)  # grouped by block
    mags = weight[idx] & 0x7F
    if wd is not None and wd.nnz:
        order = np.argsort(idx)
        srt = idx[order]
        at = np.minimum(np.searchsorted(srt, wd.positions), srt.size - 1)
        inside = srt[at] == wd.positions
        mags[order[at[inside]]] = wd.new_bits[inside] & 0x7F
    return np.maximum.reduceat(mags, np.searchsorted(rank, np.arange(blocks.size)))


def check_fp8_changes(name: str, weight: torch.Tensor, scale: torch.Tensor, weight_delta: SparseDelta | None,
                      scale_delta: SparseDelta | None, scheme: Fp8Scheme = Fp8Scheme()) -> int:
    """Validate the changes of one FP8 weight against what the engine holds (writes nothing).

    Args:
        name: the weight's name (for messages).
        weight: the engine's ``float8_e4m3fn`` weight (CPU, contiguous).
        scale: the engine's fp32 scale tensor.
        weight_delta: decoded byte changes of the weight, or None.
        scale_delta: decoded scale changes, or None.
        scheme: the engine's quantization scheme.

    Returns:
        The number of blocks the changes touch (all checked; see the module docstring for which
        ones are read whole).

    Raises:
        Fp8PayloadError: on the first violated rule of the module docstring.
    """
    if weight.dtype != torch.float8_e4m3fn or scale.dtype != torch.float32:
        raise Fp8PayloadError(f"{name}: engine holds {weight.dtype} / {scale.dtype}, expected float8_e4m3fn / float32")
    check_scale_shape(weight.shape, scale.shape, scheme, name)
    shape, block, grid = tuple(weight.shape), scheme.block_for(weight.shape), tuple(scale.shape)
    if scale_delta is not None:
        _check_new_scales(name, scale_delta, grid)
    if weight_delta is not None:
        _check_new_bytes(name, weight_delta)
    blocks = np.union1d(_touched(weight_delta, shape, block),
                        scale_delta.positions if scale_delta is not None else np.zeros(0, np.int64))
    if not blocks.size:
        return 0
    scales = bits_view(scale.contiguous()).copy()
    if scale_delta is not None:
        scales[scale_delta.positions] = scale_delta.new_bits
    scan = blocks[(scales[blocks].view(np.float32) > np.float32(MIN_SCALE))
                  & _may_lose_max(blocks, weight_delta, scale_delta, shape, block)]
    top = _block_max_bits(bits_view(weight.contiguous()), weight_delta, scan, shape, block) if scan.size else scan
    bad = np.flatnonzero(top != E4M3_MAX_BITS)
    if bad.size:
        b = int(scan[bad[0]])
        raise Fp8PayloadError(f"{_where(name, b, grid)}: largest |byte| would be 0x{int(top[bad[0]]):02X}, but its "
                              f"scale {float(scales[b:b + 1].view(np.float32)[0])!r} needs an element at 448 "
                              f"(0x7E): bytes and scale disagree ({bad.size} such blocks)")
    return int(blocks.size)


def check_fp8_payload(engine: Mapping[str, torch.Tensor], deltas: Sequence[SparseDelta], plan) -> int:
    """Run :func:`check_fp8_changes` on every FP8 weight a decoded payload touches.

    Args:
        engine: the engine's tensors by name.
        deltas: decoded changes (``codec.decode(...).deltas``).
        plan: the :class:`~nemo_dcr.quant.fp8_plan.Fp8Plan` the engine was built with.

    Returns:
        Blocks checked in total.
    """
    by_name = {d.name: d for d in deltas}
    checked = 0
    for w, s in plan.scale_names.items():
        if w in by_name or s in by_name:
            checked += check_fp8_changes(w, engine[w], engine[s], by_name.get(w), by_name.get(s), plan.scheme)
    return checked


def check_fp8_tensor(name: str, weight: np.ndarray, scale: np.ndarray, scheme: Fp8Scheme = Fp8Scheme()) -> int:
    """The rules of the module docstring on a whole FP8 weight (a resync), vectorized.

    Args:
        name: the weight's name (for messages).
        weight: its FP8 bytes, ``uint8`` of the weight's shape.
        scale: its fp32 scale bits, ``uint32`` of any shape (checked against the grid).
        scheme: the engine's quantization scheme.

    Returns:
        The number of blocks checked.

    Raises:
        Fp8PayloadError: on the first violated rule.
    """
    check_scale_shape(weight.shape, scale.shape, scheme, name)
    grid, (bm, bn) = tuple(scale.shape), scheme.block_for(weight.shape)
    flat = np.ascontiguousarray(scale, dtype=np.uint32).reshape(-1)
    _check_new_scales(name, SparseDelta(name, "fp32", grid, np.arange(flat.size), flat), grid)
    nan = np.flatnonzero((weight.reshape(-1) & 0x7F) == 0x7F)
    if nan.size:
        _check_new_bytes(name, SparseDelta(name, "fp8_e4m3", weight.shape, nan, weight.reshape(-1)[nan]))
    mags = np.zeros((grid[0] * bm, grid[1] * bn), np.uint8)
    mags[: weight.shape[0], : weight.shape[1]] = weight & 0x7F
    top = mags.reshape(grid[0], bm, grid[1], bn).max(axis=(1, 3)).reshape(-1)
    bad = np.flatnonzero((flat.view(np.float32) > np.float32(MIN_SCALE)) & (top != E4M3_MAX_BITS))
    if bad.size:
        b = int(bad[0])
        raise Fp8PayloadError(f"{_where(name, b, grid)}: largest |byte| is 0x{int(top[b]):02X}, but its scale "
                              f"{float(flat[b:b + 1].view(np.float32)[0])!r} needs an element at 448 (0x7E): "
                              f"bytes and scale disagree ({bad.size} such blocks)")
    return int(flat.size)


class Fp8TransactionCheck:
    """The engine-side FP8 rules as the check of an apply transaction (``TensorEngine.check``):
    a version whose scales or bytes break them is refused before anything is written.

    Args:
        plan: the :class:`~nemo_dcr.quant.fp8_plan.Fp8Plan` the engine was built with.
    """

    def __init__(self, plan):
        self.plan = plan
        self.blocks_checked = 0

    def __call__(self, bases: Mapping[str, torch.Tensor], deltas: Sequence[SparseDelta], resync: bool) -> int:
        """Check a decoded version (``bases``: what the deltas apply to); returns blocks checked."""
        if not resync:
            n = check_fp8_payload(bases, deltas, self.plan)
        else:  # whole tensors: every block of each FP8 weight in the payload is checked
            by_name, n = {d.name: d for d in deltas}, 0
            for w, s in self.plan.scale_names.items():
                if w in by_name or s in by_name:
                    weight = _after(bases[w], by_name.get(w)).reshape(tuple(bases[w].shape))
                    n += check_fp8_tensor(w, weight, _after(bases[s], by_name.get(s)).reshape(tuple(bases[s].shape)),
                                          self.plan.scheme)
        self.blocks_checked += n
        return n


def _after(base: torch.Tensor, d: SparseDelta | None) -> np.ndarray:
    """Flat bits of ``base`` with ``d`` applied (a copy when ``d`` is given)."""
    bits = host_bits(base.contiguous())
    if d is None:
        return bits
    bits = bits.copy()
    bits[d.positions] = d.new_bits
    return bits
