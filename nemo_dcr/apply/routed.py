"""An engine rank that holds only some canonical elements (TP shards, fused params, EP experts).

Payload records it receives are in the view index space of each canonical tensor
(:class:`nemo_dcr.apply.shard_view.ShardView`), so the transaction, its undo log and its
codec checksums work unchanged.  For the trainer/engine comparison it reports the
*layout-independent* checksum ``sum h(canonical index, bits)`` over the elements it is the
primary holder of (:func:`nemo_dcr.apply.placement.assign_primary`), so summing the replies of
all engine ranks gives each canonical tensor's total, replicated elements counted once.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import numpy as np
import torch

from nemo_dcr.types import int_view, spec_of
from nemo_dcr.verify.checksum import MASK64, hash_sum

from .engine import TensorEngine
from .placement import RankPlacement, TensorPlacement, placement_to_json
from .shard_view import ShardView
from .transaction import ApplyResult


def _primary_view(tp: TensorPlacement) -> np.ndarray:
    if not tp.primary:
        return np.zeros(0, np.int64)
    return np.concatenate([np.arange(s, s + n, dtype=np.int64) for s, n in tp.primary])


def _in_primary(tp: TensorPlacement, view: np.ndarray) -> np.ndarray:
    starts = np.array([s for s, _ in tp.primary], np.int64)
    ends = np.array([s + n for s, n in tp.primary], np.int64)
    r = np.searchsorted(starts, view, side="right") - 1
    return (r >= 0) & (view < ends[np.maximum(r, 0)]) if starts.size else np.zeros(view.size, bool)


class RoutedEngine:
    """Engine over the views this rank holds.

    Args:
        params: engine param name -> live param (contiguous).
        placement: canonical name -> placement on this rank (with primary holders assigned).
        version: the version the params hold.
        key: HMAC key every payload must carry.
        keep_index: keep ``dcr`` class indexes of the views (see :class:`~.engine.TensorEngine`).
    """

    def __init__(self, params: Mapping[str, torch.Tensor], placement: RankPlacement, version: int = 0,
                 key: bytes | None = None, keep_index: bool = True):
        self.params = dict(params)
        self.placement = dict(placement)
        views = {n: ShardView(self.params[tp.param], tp.runs) for n, tp in self.placement.items()}
        self.inner = TensorEngine(views, version, key, keep_index)
        self.inner.build_indexes()  # the first refit then decodes in proportion to its changes (if kept)
        self._canonical = {n: self._scan(n) for n in self.placement}

    @property
    def version(self) -> int:
        return self.inner.version

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """The live engine params (what digests and generation read)."""
        return self.params

    @property
    def guard(self):
        return self.inner.guard

    def _scan(self, name: str) -> int:
        tp = self.placement[name]
        view = _primary_view(tp)
        g = self.inner.tensors[name].gather()
        bits = int_view(g).cpu().numpy().view(spec_of(g.dtype).uint)[view]
        return hash_sum(tp.runs.view_to_canon(view), bits)

    def apply(self, parts: Sequence[bytes]) -> ApplyResult:
        """One version, transactional; canonical checksums move by the changes written."""
        self.prepare(parts)
        return self.commit()

    def resync(self, parts: Sequence[bytes]) -> ApplyResult:
        """Full resync of the named views (transactional); their canonical sums are rescanned."""
        self.prepare(parts, resync=True)
        return self.commit()

    def prepare(self, parts: Sequence[bytes], resync: bool = False) -> ApplyResult:
        """Write and verify one version, keep its undo log (see :meth:`TensorEngine.prepare`)."""
        return self.inner.prepare(parts, resync)

    @property
    def pending(self) -> ApplyResult | None:
        """The prepared, not yet committed version (None if there is none)."""
        return self.inner.pending

    def commit(self) -> ApplyResult:
        """Move to the prepared version; canonical sums move by its changes (rescanned for a resync)."""
        result = self.inner.commit()
        if result.resync:
            for n in result.touched:
                self._canonical[n] = self._scan(n)
            return result
        for d in result.deltas:
            tp = self.placement[d.name]
            keep = _in_primary(tp, d.positions)
            canon = tp.runs.view_to_canon(d.positions[keep])
            s = self._canonical[d.name] - hash_sum(canon, d.old_bits[keep]) + hash_sum(canon, d.new_bits[keep])
            self._canonical[d.name] = s & MASK64
        return result

    def rollback(self) -> ApplyResult:
        """Undo the prepared version bit for bit."""
        return self.inner.rollback()

    def dense_refit(self, write: Callable[[], None], version: int) -> dict[str, int]:
        """A conventional dense refit (``write`` overwrites the engine's params by its own means,
        e.g. the engine's ``load_weights``), then a full rescan; moves to ``version``.

        Returns:
            The canonical partial checksums after the write.
        """
        self.inner.dense_refit(lambda tensors: write(), version)
        self._canonical = {n: self._scan(n) for n in self.placement}
        return dict(self._canonical)

    def checksums(self, full: bool = False) -> dict[str, int]:
        """Canonical partial checksums over this rank's primary elements."""
        if full:
            self.inner.checksums(full=True)  # refuses while a version is prepared
            with self.inner.guard.read():
                self._canonical = {n: self._scan(n) for n in self.placement}
        return dict(self._canonical)

    def view_checksums(self) -> dict[str, int]:
        """Checksum of every view this rank holds, in view index space (replicated elements
        included): what the sender expects from its mirror, per engine rank."""
        return self.inner.checksums()

    def serving(self):
        """Hold the current version for one generation."""
        return self.inner.serving()

    def placement_json(self) -> dict:
        """This rank's placement in JSON form (what the refit path asks engines for)."""
        return placement_to_json(self.placement)

