"""Sender side of engine routing: each engine rank gets only the records for elements it holds.

With a placement per engine rank (:mod:`nemo_dcr.apply.placement`), the owner of a canonical
tensor cuts its merged changes per engine rank with :meth:`Runs.select` (cost ∝ changes) into
the rank's view index space and encodes them against the mirror's bits of that view, so the
engine's codec checks (base/target checksums of the view) hold.  View checksums are computed
once per (rank, tensor) and then moved by the encoded changes when the engine acknowledges.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import numpy as np
import torch

from nemo_dcr.apply.placement import RankPlacement
from nemo_dcr.codec import Identity, encode_deltas
from nemo_dcr.types import SparseDelta
from nemo_dcr.verify.checksum import tensor_checksum, updated_checksum

from .mirror import SenderMirror
from .payloads import buckets, resync_payload


@dataclass
class Fanout:
    """Per-engine-rank encoding for the tensors this trainer rank owns.

    Args:
        routes: engine rank -> its placement (canonical name -> held elements).
        mirror: this trainer rank's sender mirror (canonical index space).
    """

    routes: Mapping[int, RankPlacement]
    mirror: SenderMirror
    _checksums: dict[tuple[int, str], int] = field(default_factory=dict)
    _staged: tuple[int, dict[int, list[SparseDelta]]] | None = None

    def view_bits(self, rank: int, name: str, bits: np.ndarray | None = None) -> np.ndarray:
        """Mirror bits (or ``bits``, canonical flat) of ``name`` in ``rank``'s view order."""
        canon, _ = self.routes[rank][name].runs.expand()
        return (self.mirror.bits[name] if bits is None else bits)[canon]

    def _checksum(self, rank: int, name: str) -> int:
        key = (rank, name)
        if key not in self._checksums:
            self._checksums[key] = tensor_checksum(self.view_bits(rank, name))
        return self._checksums[key]

    def view_checksum(self, rank: int, name: str) -> int:
        """What engine ``rank`` must report for its view of ``name`` (from the committed mirror)."""
        return self._checksum(rank, name)

    def view_mismatches(self, names: Sequence[str], views: Mapping[int, Mapping[str, int] | None],
                        current: Callable[[str], np.ndarray] | None = None
                        ) -> tuple[list[tuple[str, int, int, int | None]], int]:
        """Compare the views of ``names`` each engine rank in ``views`` reported (None: it did not
        answer, so every view it holds differs) with the expected values: from the committed
        mirror, or from ``current(name)`` (canonical flat bits: the trainer's state) when given.

        Returns:
            ``(name, rank, expected, reported)`` of each differing view, and the views compared.
        """
        out, compared = [], 0
        for name in names:
            bits = None if current is None else current(name)
            for rank, placement in self.routes.items():
                if name not in placement or rank not in views:
                    continue
                compared += 1
                got = None if views[rank] is None else views[rank].get(name)
                want = self._checksum(rank, name) if bits is None else tensor_checksum(self.view_bits(rank, name, bits))
                if got != want:
                    out.append((name, rank, want, got))
        return out, compared

    def split(self, deltas: Sequence[SparseDelta]) -> dict[int, list[SparseDelta]]:
        """Canonical deltas cut into each engine rank's view index space (held elements only)."""
        out: dict[int, list[SparseDelta]] = {r: [] for r in self.routes}
        for rank, placement in self.routes.items():
            for d in deltas:
                tp = placement.get(d.name)
                if tp is None:
                    continue
                held, view, _ = tp.runs.select(d.positions)
                old = None if d.old_bits is None else d.old_bits[held]
                out[rank].append(SparseDelta(d.name, d.dtype, (tp.numel,), view, d.new_bits[held], old))
        return out

    def encode(self, deltas: Sequence[SparseDelta], identity: Identity, encoding: str, key: bytes | None,
               max_changes: int) -> dict[int, list[bytes]]:
        """Payload parts per engine rank (at least one each); stages the changes."""
        per_rank = self.split(deltas)
        self._staged = (identity.target_version, per_rank)
        out = {}
        for rank, ds in per_rank.items():
            base = {d.name: self.view_bits(rank, d.name) for d in ds}
            cks = {d.name: self._checksum(rank, d.name) for d in ds}
            groups = list(buckets(ds, max_changes)) or [[]]
            out[rank] = [encode_deltas(g, base, identity, encoding, key, cks) for g in groups]
        return out

    def commit(self, version: int) -> None:
        """The engines acknowledged ``version``: move the view checksums by the staged changes."""
        if self._staged is not None and self._staged[0] == version:
            for rank, ds in self._staged[1].items():
                for d in ds:
                    ck = self._checksum(rank, d.name)
                    self._checksums[(rank, d.name)] = updated_checksum(ck, d.positions, d.old_bits, d.new_bits)
        self._staged = None

    def reset(self) -> None:
        """After a resync or attach: view checksums are recomputed from the mirror on demand."""
        self._checksums.clear()
        self._staged = None

    def resync_payloads(self, names: Sequence[str], target: int, key: bytes | None, model: str = "",
                        run: str = "") -> dict[int, list[bytes]]:
        """Per engine rank, one resync payload with its views of the trainer-side ``names``."""
        current = self.mirror.current(names)
        out = {}
        for rank, placement in self.routes.items():
            views = {}
            for n in names:
                if n in placement:
                    flat = current[n].reshape(-1)
                    views[n] = flat[torch.from_numpy(placement[n].runs.expand()[0])]
            out[rank] = [resync_payload(views, target, key, model=model, run=run)]
        return out
