"""The unit that flows through the data path: the changed elements of one tensor."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SparseDelta:
    """Changed elements of one tensor, in some index space (megatron-local or canonical).

    Attributes:
        name: tensor name in that index space.
        dtype: wire dtype name (see :data:`nemo_dcr.codec.dtypes.DTYPES`).
        shape: shape of the whole tensor the positions index into.
        positions: int64, strictly increasing flat indices of changed elements.
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
