"""The one owner of an engine rank's checksum bookkeeping (:class:`HeldSums`).

An engine rank keeps two values per canonical tensor it holds:

* its **view** checksum ``Σ h(view index, bits)`` over the elements it holds, in the index space
  payload records name (the whole tensor's flat index, or the view of a tensor placed inside an
  engine param: :class:`~.shard_view.ShardView`).  The transaction checks every record's base and
  target checksum against it, and the sender's mirror expects it of each shard.
* its **canonical** partial sum ``Σ h(canonical index, bits)`` over the elements it is the primary
  holder of (:func:`~.placement.assign_primary`), so that summing every engine rank's values gives
  each canonical tensor's total with replicated elements counted once, whatever the layout.

For tensors held whole both are the same value, and so are they for a placed tensor whose view is
*whole*: every canonical element held here, this rank their primary holder (view index =
canonical index: a TP=1 engine's fused params).  Both move only with a committed version: views
to the records' verified target checksums, canonical sums by the written changes (cost ∝
changes; a whole view's takes its view's value, cost per tensor), both rescanned after a resync
or on a full scan.
"""

from __future__ import annotations

from typing import Iterable, Mapping

import numpy as np

from nemo_dcr.kernels.traffic import host_bits
from nemo_dcr.types import SparseDelta
from nemo_dcr.verify.checksum import checksums_after, tensor_checksum
from nemo_dcr.verify.sample import Sample, runs_checksum, whole_checksum

from .contract import EngineChecksums
from .placement import Runs, TensorPlacement
from .shard_view import ShardView
from .transaction import ApplyResult, Live


def _bits(t: Live) -> np.ndarray:
    return host_bits(t.gather() if isinstance(t, ShardView) else t)


def full_checksums(tensors: Mapping[str, Live]) -> dict[str, int]:
    """Checksum of every tensor by a full scan (index = flat index, or view index for a view)."""
    return {name: tensor_checksum(_bits(t)) for name, t in tensors.items()}


def _in_primary(tp: TensorPlacement, view: np.ndarray) -> np.ndarray:
    starts = np.array([s for s, _ in tp.primary], np.int64)
    ends = np.array([s + n for s, n in tp.primary], np.int64)
    r = np.searchsorted(starts, view, side="right") - 1
    return (r >= 0) & (view < ends[np.maximum(r, 0)]) if starts.size else np.zeros(view.size, bool)


def _canonical_delta(d: SparseDelta, tp: TensorPlacement) -> SparseDelta:
    """A view-space delta's primary elements at their canonical indices."""
    keep = _in_primary(tp, d.positions)
    return SparseDelta(d.name, d.dtype, tp.shape, tp.runs.view_to_canon(d.positions[keep]), d.new_bits[keep],
                       d.old_bits[keep])


def _whole(tp: TensorPlacement) -> bool:
    """Whether ``tp``'s view is the whole canonical tensor with every element primary here (its view
    index is the canonical index, so its canonical sum is its view checksum)."""
    n = int(np.prod(tp.shape, dtype=np.int64))
    return tp.runs.numel == n and tuple(tp.primary) == (((0, n),) if n else ())


def _same_runs(a: Runs, b: Runs) -> bool:
    """Whether two run maps hold the same elements the same way (every held element primary:
    its canonical sum is its view's, computed once)."""
    return all(np.array_equal(x, y) for x, y in ((a.canon, b.canon), (a.local, b.local), (a.length, b.length),
                                                   (a.step, b.step)))


class HeldSums:
    """View checksums and canonical partial sums of what one engine rank holds (module docstring).

    Args:
        tensors: record name -> live tensor or view (what the transaction writes).
        placed: canonical name -> placement on this rank (primaries assigned); empty when the
            tensors are the canonical tensors, held whole.
    """

    def __init__(self, tensors: Mapping[str, Live], placed: Mapping[str, TensorPlacement]):
        self.tensors, self.placed = tensors, placed
        self.views: dict[str, int] = {}
        self._canonical: dict[str, int] = {}
        self._primary_runs: dict[str, Runs] = {}
        self._whole = frozenset(n for n, tp in placed.items() if _whole(tp))
        self.rescan()

    def _scan_canonical(self, name: str) -> int:
        """Canonical partial sum of ``name``'s primary elements, from the runs of the primary view
        intervals (no per-element index arrays); a whole view's is its view checksum (``views``
        already moved to the current bits)."""
        if name in self._whole:
            return self.views[name]
        tp = self.placed[name]
        r = tp.runs
        primary = Runs(r.canon, r.view_start, r.length).of_view(tp.primary)  # local: the view index
        return runs_checksum(_bits(self.tensors[name]), primary.local, primary.canon, primary.length)

    def rescan(self, names: Iterable[str] | None = None) -> None:
        """Both values of ``names`` (default: every tensor) from what memory holds."""
        names = list(self.tensors if names is None else names)
        self.views.update(full_checksums({n: self.tensors[n] for n in names}))
        if self.placed:
            self._canonical.update({n: self._scan_canonical(n) for n in names})

    def commit(self, result: ApplyResult) -> None:
        """A version committed: views take the records' verified targets; canonical sums move by
        the changes written (rescanned for a resync, which carries no deltas)."""
        self.views.update(result.checksums)
        if not self.placed:
            return
        if result.resync:
            self._canonical.update({n: self._scan_canonical(n) for n in result.touched})
            return
        moved = [_canonical_delta(d, self.placed[d.name]) for d in result.deltas if d.nnz and d.name not in self._whole]
        self._canonical = checksums_after(self._canonical, moved)
        self._canonical.update({d.name: self._scan_canonical(d.name) for d in result.deltas if d.name in self._whole})

    def sampled(self, sample: Sample) -> EngineChecksums:
        """The sums of ``sample``'s slice recomputed from the live tensors (nothing kept changes):
        canonical partial sums over the primary elements and, when placed, each view's sum over
        every element it holds (replicas included), both hashed by canonical index."""
        if not self.placed:
            return EngineChecksums({n: whole_checksum(_bits(t), sample, n) for n, t in self.tensors.items()})
        canonical, views = {}, {}
        for n, view in self.tensors.items():
            bits, runs = host_bits(view.param), self.placed[n].runs
            primary = self._primaries(n)
            views[n] = runs_checksum(bits, runs.local, runs.canon, runs.length, sample, n, runs.step)
            canonical[n] = views[n] if _same_runs(primary, runs) else \
                runs_checksum(bits, primary.local, primary.canon, primary.length, sample, n, primary.step)
        return EngineChecksums(canonical, {0: views})

    def _primaries(self, name: str) -> Runs:
        """Runs of the elements of ``name`` this rank is the primary holder of (built once, from
        the runs and the primary intervals: cost ∝ runs, never a pass over the elements)."""
        if name not in self._primary_runs:
            tp = self.placed[name]
            self._primary_runs[name] = tp.runs.of_view(tp.primary)
        return self._primary_runs[name]

    @property
    def canonical(self) -> dict[str, int]:
        """Canonical partial sums (the view checksums for tensors held whole)."""
        return dict(self._canonical if self.placed else self.views)

    def value(self) -> EngineChecksums:
        """What this rank reports: canonical sums, and its views as shard 0 when placed."""
        return EngineChecksums(self.canonical, {0: dict(self.views)} if self.placed else {})
