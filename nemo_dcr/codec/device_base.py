"""A device tensor's base bits as the decoders read them: only at the changed positions.

:func:`nemo_dcr.codec.decode` hands a record's decoder a :class:`DeviceBase` instead of a host
copy of the whole tensor when the decode needs only the old bits where the record changes the
tensor (a ``dcr`` record with a kept class index, a ``reference`` or a ``same`` record): those are
gathered on the tensor's device and cross to the host in one small copy (docs/refit.md, "GPU path").
"""

from __future__ import annotations

import numpy as np
import torch

from ..kernels import read_bits
from ..kernels.traffic import to_host
from ..types import DtypeSpec


class DeviceBase:
    """Read-only base bits of ``tensor`` (contiguous, any device), gathered where they are indexed.

    Attributes:
        tensor: the live tensor.
        spec: its dtype facts.
        size: its elements.
        dtype: the numpy unsigned type of its bits.
    """

    def __init__(self, tensor: torch.Tensor, spec: DtypeSpec):
        self.tensor = tensor
        self.spec = spec
        self.size = tensor.numel()
        self.dtype = np.dtype(spec.uint)

    def __getitem__(self, positions: np.ndarray) -> np.ndarray:
        """The bits at flat ``positions`` (int64): a gather on the device, one copy to the host."""
        positions = np.asarray(positions)
        if positions.size == 0:
            return np.zeros(0, self.dtype)
        return to_host(read_bits(self.tensor, positions)).numpy().view(self.dtype)
