"""Bit-level views of floating-point dtypes.

Every comparison and every write in nemo_dcr goes through unsigned integer views of the
tensor's storage, never through float arithmetic: ``-0.0 != +0.0`` and ``NaN == NaN`` (same
payload) are what bit-exactness needs.  This module is the single table of dtype facts.
"""

from __future__ import annotations

from dataclasses import dataclass

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

    @property
    def uint(self) -> np.dtype:
        """Unsigned numpy integer type of the same width."""
        return np.dtype({1: np.uint8, 2: np.uint16, 4: np.uint32}[self.width])

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
_TORCH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


class UnsupportedDtypeError(TypeError):
    """A tensor's dtype has no entry in :data:`DTYPES`."""


def spec_of(dtype: torch.dtype | str) -> DtypeSpec:
    """Look up the :class:`DtypeSpec` for a torch dtype or a wire name."""
    spec = DTYPES.get(dtype) if isinstance(dtype, str) else _BY_TORCH.get(dtype)
    if spec is None:
        known = ", ".join(sorted(DTYPES))
        raise UnsupportedDtypeError(f"unsupported dtype {dtype!r}; supported: {known}")
    return spec


def bits_view(t: torch.Tensor) -> np.ndarray:
    """Flat unsigned-integer numpy view sharing memory with a contiguous CPU tensor.

    Writing into the returned array writes into ``t``.
    """
    spec = spec_of(t.dtype)
    if t.device.type != "cpu":
        raise ValueError(f"bits_view needs a CPU tensor, got device {t.device}")
    if not t.is_contiguous():
        raise ValueError("bits_view needs a contiguous tensor (a view would silently copy)")
    return t.view(_TORCH_INT[spec.width]).reshape(-1).numpy().view(spec.uint)


def tensor_from_bits(bits: np.ndarray, spec: DtypeSpec, shape) -> torch.Tensor:
    """Build a tensor of ``spec``'s dtype from its raw bits (copies)."""
    arr = np.ascontiguousarray(bits, dtype=spec.uint)
    signed = {1: np.uint8, 2: np.int16, 4: np.int32}[spec.width]
    t = torch.from_numpy(arr.view(signed).copy())
    return t.view(spec.torch_dtype).reshape(tuple(shape))
