"""Where each element sits in the (class, flat index) order of a base tensor.

The ``dcr`` coding ranks elements by (exponent class, flat index).  Two implementations:

- numpy (host): the tensor is cut into blocks of 65536 elements; each block is sorted by class
  on its own (cache-resident radix sort, local order kept as uint16) and its class histogram is
  kept.  A global rank is the count of the class in earlier blocks plus the local rank.
- torch (any device): one stable sort of the class array (a radix sort on GPUs).

Both give the encoder the sorted position ``s`` of each changed element and the decoder the
element at each sorted position, plus the class histogram; both cost one pass over the base.
"""

from __future__ import annotations

import numpy as np
import torch

from nemo_dcr.types import DtypeSpec

BLOCK = 1 << 16
_LOCAL = np.arange(BLOCK, dtype=np.int32)


def classes_np(bits: np.ndarray, spec: DtypeSpec) -> np.ndarray:
    """Exponent class of each element as uint8 (every supported dtype has <= 8 exponent bits)."""
    e = bits >> spec.exp_shift
    if spec.exp_shift + spec.exp_bits < spec.bits - 1 or spec.exp_bits < 8:
        e = e & ((1 << spec.exp_bits) - 1)
    return e.astype(np.uint8)  # for 8-bit exponents the cast drops the sign bit


def classes_torch(bits: torch.Tensor, spec: DtypeSpec) -> torch.Tensor:
    """Exponent class of each element of an integer view, as uint8 (sign extension masked off)."""
    return ((bits >> spec.exp_shift) & ((1 << spec.exp_bits) - 1)).to(torch.uint8)


def _blocks(n: int):
    return range(0, n, BLOCK)


def encoder_sorted_pos_np(base: np.ndarray, positions: np.ndarray, spec: DtypeSpec):
    """Class histogram of ``base`` and the (class, index)-order position of each changed element."""
    n_exp, n = spec.n_exponents, base.size
    nb = -(-n // BLOCK)
    counts = np.zeros((nb, n_exp), np.int64)
    cut = np.searchsorted(positions, np.arange(nb + 1, dtype=np.int64) * BLOCK)
    local_occ = np.empty(positions.size, np.int64)
    inv = np.empty(BLOCK, np.int32)
    for b, s in enumerate(_blocks(n)):
        e = classes_np(base[s : s + BLOCK], spec)
        counts[b] = np.bincount(e, minlength=n_exp)
        lo, hi = cut[b], cut[b + 1]
        if hi > lo:
            pl = positions[lo:hi] - s
            inv[np.argsort(e, kind="stable")] = _LOCAL[: e.size]
            first = np.cumsum(counts[b]) - counts[b]
            local_occ[lo:hi] = inv[pl] - first[e[pl]]
    before = np.cumsum(counts, axis=0) - counts
    hist = counts.sum(axis=0)
    c = classes_np(base[positions], spec).astype(np.int64)
    first = np.cumsum(hist) - hist
    return hist, first[c] + before[positions // BLOCK, c] + local_occ


class DecoderIndexNp:
    """Per-block local orders (uint16) and histograms; ``select`` maps sorted positions to indices."""

    def __init__(self, base: np.ndarray, spec: DtypeSpec):
        n_exp, n = spec.n_exponents, base.size
        nb = -(-n // BLOCK)
        self.counts = np.zeros((nb, n_exp), np.int64)
        self.order = np.empty(n, np.uint16)
        for b, s in enumerate(_blocks(n)):
            e = classes_np(base[s : s + BLOCK], spec)
            self.counts[b] = np.bincount(e, minlength=n_exp)
            self.order[s : s + e.size] = np.argsort(e, kind="stable")
        self.hist = self.counts.sum(axis=0)
        self.n, self.nb = n, nb

    def select(self, s: np.ndarray) -> np.ndarray:
        """Flat index of the element at each (class, index)-order position ``s``."""
        first = np.concatenate([[0], np.cumsum(self.hist)])
        c = np.searchsorted(first, s, side="right") - 1
        k = s - first[c]
        cum = np.cumsum(self.counts, axis=0)  # inclusive, per class over blocks
        keyed = (cum.T + (np.arange(self.counts.shape[1], dtype=np.int64) * (self.n + 1))[:, None]).ravel()
        b = np.searchsorted(keyed, c * (self.n + 1) + k, side="right") - c * self.nb
        k_local = k - (cum[b, c] - self.counts[b, c])
        lfirst = np.cumsum(self.counts, axis=1) - self.counts
        return b * BLOCK + self.order[b * BLOCK + lfirst[b, c] + k_local].astype(np.int64)


def encoder_sorted_pos_torch(base: torch.Tensor, positions: torch.Tensor, spec: DtypeSpec):
    """Torch version of :func:`encoder_sorted_pos_np` (one stable sort on the tensor's device)."""
    e = classes_torch(base, spec)
    hist = torch.bincount(e.to(torch.int64), minlength=spec.n_exponents)
    order = torch.sort(e, stable=True).indices
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device)
    return hist, inv[positions]


class DecoderIndexTorch:
    """Torch version of :class:`DecoderIndexNp`: the full stable order on the tensor's device."""

    def __init__(self, base: torch.Tensor, spec: DtypeSpec):
        e = classes_torch(base, spec)
        self.hist_dev = torch.bincount(e.to(torch.int64), minlength=spec.n_exponents)
        self.hist = self.hist_dev.cpu().numpy()
        self.order = torch.sort(e, stable=True).indices

    def select(self, s: torch.Tensor) -> torch.Tensor:
        return self.order[s]
