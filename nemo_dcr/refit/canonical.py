"""A trainer source whose tensors are already canonical (held whole on this rank).

Used where the trainer side hands over Hugging Face-named tensors: NeMo-RL's export on each
policy rank, the refit benchmark.  The layout is the identity; with ``owned``, this rank
captures only those tensors (every other tensor gets an empty range), so several ranks that all
see the whole export split the capture, routing and encoding between them.  With ``canonical``
(the model-wide table), a rank holds only the tensors it captures: NeMo-RL's policy workers keep
a copy of the canonical tensors they own and drop the rest of the export.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import numpy as np
import torch

from nemo_dcr.kernels.traffic import host_bits
from nemo_dcr.types import SparseDelta, spec_of
from nemo_dcr.verify.sample import Sample, whole_checksum


class CanonicalSource:
    """Canonical tensors as a :class:`~nemo_dcr.refit.source.TrainerSource`.

    Args:
        tensors: canonical name -> live tensor (contiguous); written in place by the caller.
        owned: names this rank captures (default: all of ``tensors``).
        canonical: every canonical tensor of the model, name -> (wire dtype name, shape)
            (default: the table of ``tensors``); each held tensor must match its entry.
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor], owned: Iterable[str] | None = None,
                 canonical: Mapping[str, tuple[str, Sequence[int]]] | None = None):
        self.params = dict(tensors)
        bad = [n for n, t in self.params.items() if not t.is_contiguous()]
        if bad:
            raise ValueError(f"tensors must be contiguous: {bad[:5]}")
        own = set(self.params) if owned is None else set(owned)
        unknown = sorted(own - set(self.params))
        if unknown:
            raise ValueError(f"owned names not among the tensors: {unknown[:5]}")
        held = {n: (spec_of(t.dtype).name, tuple(t.shape)) for n, t in self.params.items()}
        self.canonical = held if canonical is None else {n: (d, tuple(int(x) for x in s))
                                                         for n, (d, s) in canonical.items()}
        wrong = [f"{n}: held {held[n]}, table {self.canonical.get(n, 'missing')}"
                 for n in held if self.canonical.get(n) != held[n]]
        if wrong:
            raise ValueError(f"held tensors disagree with the canonical table: {wrong[:5]}")
        self.ranges = {n: (0, t.numel()) if n in own else (0, 0) for n, t in self.params.items()}

    def _captured(self):
        return [n for n, (lo, hi) in self.ranges.items() if hi > lo]

    def remap(self, delta: SparseDelta) -> list[SparseDelta]:
        """Identity: a captured delta is already canonical."""
        return [delta]

    def checksums(self, sample: Sample | None = None) -> dict[str, int]:
        """Checksums of the tensors this rank captures (full scan, or ``sample``'s slice of them)."""
        return {n: whole_checksum(host_bits(self.params[n]), sample, n) for n in self._captured()}

    def captured(self) -> dict[str, int]:
        """Elements captured per tensor: every element of the tensors this rank captures."""
        return {n: self.params[n].numel() for n in self._captured()}

    def pieces(self) -> list[SparseDelta]:
        """Every captured element, with zero old bits.

        Each piece's positions are ``0 .. numel - 1`` and its old bits zeros: read-only views of
        one position array and one zero array per width, as long as the largest tensor, that every
        piece shares (8 bytes per element of the largest tensor, not per element of the model)."""
        names = self._captured()
        iota = _read_only(np.arange(max((self.params[n].numel() for n in names), default=0), dtype=np.int64))
        zeros: dict[np.dtype, np.ndarray] = {}
        out = []
        for n in names:
            t = self.params[n]
            bits = host_bits(t).copy()
            zero = zeros.setdefault(bits.dtype, _read_only(np.zeros(iota.size, bits.dtype)))
            out.append(SparseDelta(n, spec_of(t.dtype).name, tuple(t.shape), iota[:bits.size], bits, zero[:bits.size]))
        return out


def _read_only(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a
