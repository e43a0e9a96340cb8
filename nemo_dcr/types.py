"""Shared types of the data path (the leaf of the package: imports only numpy and torch).

* :class:`DtypeSpec` / :data:`DTYPES` / :func:`spec_of`: the single table of dtype facts.
* Integer views: every comparison and every write in nemo_dcr goes through same-width integer
  views of a tensor's storage, never through float arithmetic (``-0.0 != +0.0``; two NaNs
  with the same payload are equal).  :func:`int_view` (torch, any device),
  :func:`bits_view` (numpy, unsigned, CPU) and :func:`carrier` (numpy unsigned bits -> a torch
  tensor of the same bits) are the only places that pick an integer type for a width.
* :class:`SparseDelta`: the unit that flows through the data path, the changed elements of one
  tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch


@dataclass(frozen=True)
class DtypeSpec:
    """Facts about one element type.

    Attributes:
        name: wire name (``"bf16"``, ``"fp16"``, ``"fp32"``, ``"fp8_e4m3"``, ``"fp8_e5m2"``).
        torch_dtype: the torch dtype.
        width: bytes per element (1, 2 or 4).
        exp_shift: bit position of the exponent field's lowest bit.
        exp_bits: width of the exponent field.
    """

    name: str
    torch_dtype: torch.dtype
    width: int
    exp_shift: int
    exp_bits: int

    @cached_property
    def uint(self) -> np.dtype:
        """Unsigned numpy integer type of the same width."""
        return np.dtype(UNSIGNED[self.width])

    @property
    def bits(self) -> int:
        return 8 * self.width

    @property
    def sign_mask(self) -> int:
        return 1 << (self.bits - 1)

    @property
    def n_exponents(self) -> int:
        return 1 << self.exp_bits

    def exponent(self, bits: np.ndarray) -> np.ndarray:
        """Biased exponent field of each element (sign ignored), as uint8/uint16."""
        e = (bits >> self.exp_shift) & ((1 << self.exp_bits) - 1)
        return e.astype(np.uint8 if self.exp_bits <= 8 else np.uint16)


DTYPES: dict[str, DtypeSpec] = {
    s.name: s
    for s in (
        DtypeSpec("bf16", torch.bfloat16, 2, 7, 8),
        DtypeSpec("fp16", torch.float16, 2, 10, 5),
        DtypeSpec("fp32", torch.float32, 4, 23, 8),
        DtypeSpec("fp8_e4m3", torch.float8_e4m3fn, 1, 3, 4),
        DtypeSpec("fp8_e5m2", torch.float8_e5m2, 1, 2, 5),
    )
}
_BY_TORCH = {s.torch_dtype: s for s in DTYPES.values()}

UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
"""Width in bytes -> unsigned numpy type (how bits are held in numpy)."""
CARRIER_NP = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}
"""Width in bytes -> the numpy type whose torch counterpart exists (torch has no uint16/32)."""
CARRIER_TORCH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
"""Width in bytes -> the torch integer type of integer views."""
_CARRIERS = frozenset(CARRIER_TORCH.values())
_CARRIER_OF = {s.torch_dtype: CARRIER_TORCH[s.width] for s in DTYPES.values()}


class UnsupportedDtypeError(TypeError):
    """A tensor's dtype has no entry in :data:`DTYPES`."""


def spec_of(dtype: torch.dtype | str) -> DtypeSpec:
    """Look up the :class:`DtypeSpec` for a torch dtype or a wire name."""
    spec = DTYPES.get(dtype) if isinstance(dtype, str) else _BY_TORCH.get(dtype)
    if spec is None:
        known = ", ".join(sorted(DTYPES))
        raise UnsupportedDtypeError(f"unsupported dtype {dtype!r}; supported: {known}")
    return spec


def int_view(t: torch.Tensor) -> torch.Tensor:
    """Flat same-width integer view of a contiguous tensor (shares memory, any device).

    Integer tensors come back flattened as they are.

    Raises:
        ValueError: the tensor is not contiguous (a view of it would silently copy).
    """
    if not t.is_contiguous():
        raise ValueError("tensors must be contiguous to be viewed as integers (a view would copy)")
    dtype = t.dtype
    carrier_of = _CARRIER_OF.get(dtype)
    if carrier_of is None and dtype not in _CARRIERS:
        spec_of(dtype)  # raises UnsupportedDtypeError
    flat = t.detach().reshape(-1)
    return flat if carrier_of is None else flat.view(carrier_of)


def bits_view(t: torch.Tensor) -> np.ndarray:
    """Flat unsigned-integer numpy view sharing memory with a contiguous CPU tensor.

    Writing into the returned array writes into ``t``.
    """
    spec = spec_of(t.dtype)
    if not t.is_cpu:
        raise ValueError(f"bits_view needs a CPU tensor, got device {t.device}")
    if not t.is_contiguous():
        raise ValueError("bits_view needs a contiguous tensor (a view would silently copy)")
    return t.view(CARRIER_TORCH[spec.width]).reshape(-1).numpy().view(spec.uint)


def carrier(bits: np.ndarray) -> torch.Tensor:
    """A torch integer tensor holding the same bits as unsigned numpy ``bits`` (shares memory)."""
    arr = np.ascontiguousarray(bits)
    return torch.from_numpy(arr.view(CARRIER_NP[arr.itemsize]))


def tensor_from_bits(bits: np.ndarray, spec: DtypeSpec, shape) -> torch.Tensor:
    """Build a tensor of ``spec``'s dtype from its raw bits (copies)."""
    arr = np.ascontiguousarray(bits, dtype=spec.uint).copy()
    return carrier(arr).view(spec.torch_dtype).reshape(tuple(shape))


class DeltaInputError(ValueError):
    """A :class:`SparseDelta` whose fields do not fit together; the message names the field."""


@dataclass(frozen=True)
class SparseDelta:
    """Changed elements of one tensor, in some index space (megatron-local or canonical).

    Construction refuses fields that do not fit together (:class:`DeltaInputError` naming the
    field: an unknown dtype, a shape that is not non-negative integers, arrays that are not 1-D,
    positions that are not int64, bits that are not the unsigned integers of ``dtype``'s width,
    lengths that differ); :meth:`validate` adds the checks that cost a pass over the positions.

    Attributes:
        name: tensor name in that index space.
        dtype: wire dtype name (see :data:`DTYPES`).
        shape: shape of the whole tensor the positions index into.
        positions: int64 flat indices of changed elements, within ``[0, numel)``; strictly
            increasing wherever the delta is encoded or applied (a remap may reorder them until
            the owner merges them, :func:`nemo_dcr.refit.routing.merge`).
        new_bits: unsigned integer bits (width of ``dtype``) of the new values, same length.
        old_bits: the bits being replaced, same length, when known (the sender knows them
            from its baseline; the receiver reads them before applying).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    positions: np.ndarray
    new_bits: np.ndarray
    old_bits: np.ndarray | None = None

    def __post_init__(self) -> None:
        where = f"SparseDelta {self.name!r}"
        if self.dtype not in DTYPES:
            raise DeltaInputError(f"{where}: dtype {self.dtype!r} is not a wire dtype; known: {', '.join(DTYPES)}")
        if not isinstance(self.shape, tuple) or not all(
                isinstance(s, (int, np.integer)) and not isinstance(s, bool) and s >= 0 for s in self.shape):
            raise DeltaInputError(f"{where}: shape must be a tuple of non-negative integers, got {self.shape!r}")
        uint = DTYPES[self.dtype].uint
        fields = [("positions", self.positions, np.dtype(np.int64)), ("new_bits", self.new_bits, uint)]
        if self.old_bits is not None:
            fields.append(("old_bits", self.old_bits, uint))
        for field, value, want in fields:
            if not isinstance(value, np.ndarray) or value.ndim != 1:
                got = f"a {value.ndim}-D array" if isinstance(value, np.ndarray) else type(value).__name__
                raise DeltaInputError(f"{where}: {field} must be a 1-D numpy array, got {got}")
            if value.dtype != want:
                what = "the unsigned integers of its dtype's width" if field != "positions" else "int64"
                raise DeltaInputError(f"{where}: {field} are {value.dtype}, expected {want} ({what}; "
                                      f"dtype {self.dtype!r})")
        lengths = {f: v.size for f, v, _ in fields}
        if len(set(lengths.values())) > 1:
            raise DeltaInputError(f"{where}: lengths differ: " + ", ".join(f"{f} {n}" for f, n in lengths.items()))

    def validate(self) -> SparseDelta:
        """Positions strictly increasing and within ``[0, numel)`` (a pass over them); returns self.

        Raises:
            DeltaInputError: naming the first position out of order or out of range.
        """
        pos = self.positions
        if pos.size and (int(pos[0]) < 0 or int(pos[-1]) >= self.numel or (pos.size > 1 and
                                                                             bool((pos[1:] <= pos[:-1]).any()))):
            bad = np.flatnonzero(pos[1:] <= pos[:-1]) if pos.size > 1 else np.zeros(0, np.int64)
            if bad.size:
                i = int(bad[0]) + 1
                raise DeltaInputError(f"SparseDelta {self.name!r}: positions must be strictly increasing; "
                                      f"positions[{i}] = {int(pos[i])} follows {int(pos[i - 1])}")
            i = int(np.flatnonzero((pos < 0) | (pos >= self.numel))[0])
            raise DeltaInputError(f"SparseDelta {self.name!r}: positions[{i}] = {int(pos[i])} is outside "
                                  f"[0, {self.numel}) of shape {self.shape}")
        return self

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= int(s)
        return n

    @property
    def nnz(self) -> int:
        return int(self.positions.size)

    @property
    def density(self) -> float:
        return self.nnz / max(self.numel, 1)

    def select(self, mask: np.ndarray) -> "SparseDelta":
        """The same delta restricted to the elements where ``mask`` is true."""
        old = None if self.old_bits is None else self.old_bits[mask]
        return SparseDelta(self.name, self.dtype, self.shape, self.positions[mask], self.new_bits[mask], old)
