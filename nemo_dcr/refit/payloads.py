"""Building payloads on the sender side: sparse refits against the mirror, full resyncs.

A *resync* payload is a delta at 100% density through the same wire format: it is encoded
against all-zero tensors (base version :data:`RESYNC_BASE_VERSION`), so it lists every nonzero
element, and the engine applies it with :meth:`nemo_dcr.apply.TensorEngine.resync`, which knows
the zero base.  No side needs to know what the other holds for it to work.
"""

from __future__ import annotations

from typing import Iterator, Mapping, Sequence

import numpy as np
import torch

from nemo_dcr.apply.transaction import RESYNC_BASE_VERSION
from nemo_dcr.codec import Identity, encode_deltas
from nemo_dcr.kernels.traffic import host_bits
from nemo_dcr.types import SparseDelta, spec_of


def dense_delta(name: str, t: torch.Tensor) -> SparseDelta:
    """Every nonzero element of ``t`` as a change from zero."""
    spec = spec_of(t.dtype)
    bits = host_bits(t)
    pos = np.flatnonzero(bits).astype(np.int64)
    return SparseDelta(name, spec.name, tuple(t.shape), pos, bits[pos], np.zeros(pos.size, spec.uint))


def resync_payload(tensors: Mapping[str, torch.Tensor], target_version: int, key: bytes | None = None,
                   encoding: str = "reference", model: str = "", run: str = "") -> bytes:
    """One resync payload carrying ``tensors`` whole (encoded against zeros)."""
    deltas = [dense_delta(n, t) for n, t in tensors.items()]
    zeros = {d.name: np.zeros(d.numel, spec_of(tensors[d.name].dtype).uint) for d in deltas}
    ident = Identity(model, run, RESYNC_BASE_VERSION, target_version)
    return encode_deltas(deltas, zeros, ident, encoding, key)


def buckets(deltas: Sequence[SparseDelta], max_changes: int) -> Iterator[list[SparseDelta]]:
    """Split deltas into groups of about ``max_changes`` changed elements (whole tensors)."""
    group, n = [], 0
    for d in deltas:
        if group and n + d.nnz > max_changes:
            yield group
            group, n = [], 0
        group.append(d)
        n += d.nnz
    if group:
        yield group
