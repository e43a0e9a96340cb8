"""An engine over live tensors: version state, transactional apply, checksums, a read guard.

:class:`TensorEngine` implements the engine contract (:class:`~.contract.Engine`) over either

* **named tensors**: canonical name -> live tensor, held whole (a transformers model's
  parameters, a CPU engine of zeros), or
* **engine params plus a placement** (``placement=``): each canonical tensor is the view of the
  elements this rank holds inside one engine param (:class:`~.shard_view.ShardView`: fused
  ``qkv_proj``, a TP shard, a range of MoE experts), probed from the engine's own loaders
  (:mod:`~.placement`).  Payload records then index the view, so the transaction, its undo log
  and its codec checksums work unchanged, and the engine reports the layout-independent canonical
  sums of its primary elements (:class:`~.sums.HeldSums`, the one owner of both checksum spaces).

An engine spread over several processes (vLLM's TP ranks) commits a version only when every
rank verified it: each rank :meth:`TensorEngine.prepare`-s (written, verified, undo log kept,
write guard held), then the driver tells all ranks to :meth:`~TensorEngine.commit` or to
:meth:`~TensorEngine.rollback`.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable, Iterator, Mapping

import numpy as np
import torch

from nemo_dcr.codec import DcrIndexes, MovedIndexes
from nemo_dcr.kernels.traffic import host_bits
from nemo_dcr.kernels.workers import resolve_threads
from nemo_dcr.types import int_view, spec_of
from nemo_dcr.verify.sample import Sample

from .contract import EngineChecksums, Parts, shard_parts, tensor_digests
from .guard import PendingSlot, VersionGuard
from .placement import Fills, RankPlacement, fills_outside_views, placement_to_json
from .shard_view import ShardView
from .sums import HeldSums
from .transaction import (ApplyResult, Bases, FaultHook, PayloadCheck, Prepared, UndoSettings, prepare_parts,
                          prepare_resync)
from .undo import UNDO_MEMORY_BYTES, UndoLog

class TensorEngine:
    """Live tensors that move from version to version only by whole transactions.

    Args:
        tensors: canonical name -> live tensor (contiguous; written in place); with ``placement``,
            engine param name -> live param instead.
        version: the version these tensors hold.
        key: HMAC key every payload must carry (None: unauthenticated payloads).
        keep_index: keep a ``dcr`` class index per tensor between versions (host memory of about
            2.3 bytes per element of the tensors that receive ``dcr`` records), so decoding costs
            in proportion to the changes instead of a pass over each tensor.
        undo_limit_bytes: old bits a transaction's undo log holds in memory at most; the rest is
            spilled to a temporary file (:mod:`nemo_dcr.apply.undo`).
        spill_dir: folder of that file (default: the system's temporary folder).
        placement: canonical name -> where this rank holds it (primary holders assigned); None:
            ``tensors`` are the canonical tensors, held whole.
        fills: constants the engine's loaders write into params (``{param: [(positions, values)]}``,
            vocab padding); after a resync those outside every view are written into the resynced
            params in the same transaction, so a resync ends bit-identical to a fresh load.
        threads: worker threads over the records of a version's parts (``dcr.threads``: a positive int, or
            ``auto``: the cores this process may run on); decode, write, read-back and the index
            update, with the same state and errors as one thread.
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor], version: int = 0, key: bytes | None = None,
                 keep_index: bool = True, undo_limit_bytes: int = UNDO_MEMORY_BYTES, spill_dir: str | None = None,
                 *, placement: RankPlacement | None = None, fills: Fills | None = None,
                 threads: int | str = "auto"):
        self.params = dict(tensors)
        self.placed = dict(placement or {})
        self.tensors = self.params if placement is None else {
            n: ShardView(self.params[tp.param], tp.runs) for n, tp in self.placed.items()}
        self.fills = fills_outside_views(fills or {}, self.placed)
        self.key = key
        self._kept = MovedIndexes("nemo-dcr-index-update") if keep_index else None
        self.undo = UndoSettings(undo_limit_bytes, spill_dir)
        self.threads = resolve_threads(threads, processes=1)
        self.guard = VersionGuard(version)
        self.sums = HeldSums(self.tensors, self.placed)
        self.fault: FaultHook | None = None
        self.check: PayloadCheck | None = None  # engine-specific rules on decoded changes (an FP8 engine's)
        self._pending: PendingSlot[tuple[Prepared, UndoLog | None]] = PendingSlot(self.guard)
        if placement is not None:
            self.build_indexes()  # the first refit then decodes in proportion to its changes (if kept)

    @property
    def version(self) -> int:
        """The version every tensor holds (never a mix)."""
        return self.guard.version

    @property
    def indexes(self) -> DcrIndexes | None:
        """The kept ``dcr`` class indexes (None: not kept), once the last commit has moved them
        (each commit moves them on a thread of its own, so it returns, and the engine answers,
        first: :class:`~nemo_dcr.codec.MovedIndexes`)."""
        return None if self._kept is None else self._kept.current

    def settle(self) -> float:
        """Wait for the kept indexes' move the last commit started (none kept, or none running:
        returns at once); the seconds waited."""
        t0 = time.perf_counter()
        self.indexes  # noqa: B018 -- waits for the move in flight
        return time.perf_counter() - t0

    def placement(self) -> list[dict]:
        """This rank's placement as one shard (JSON form), or none for tensors held whole."""
        return [placement_to_json(self.placed)] if self.placed else []

    def prepare(self, parts: Parts, resync: bool = False) -> ApplyResult:
        """Validate, write and verify one version (shard 0's parts); keep its undo log and the
        write guard.

        Until :meth:`commit` or :meth:`rollback`, :attr:`version` stays the old one and readers
        (:meth:`serving`) wait.  A failure rolls back at once and releases the guard.

        Raises:
            PendingVersionError: another prepared version is pending (nothing written).
            IncompletePartsError: parts for another shard (nothing written).
            RefitRefusedError, DeltaFormatError: as :func:`~.transaction.prepare_parts`.
        """
        [mine] = shard_parts(parts, 1)
        hold = self._pending.open()
        try:
            if resync:
                prepared = prepare_resync(self.tensors, mine, self.version, self.key, self.fault, self.undo,
                                          self.check)
            else:
                prepared = prepare_parts(self.tensors, mine, self.version, self.sums.views, self.key, self.fault,
                                         self.indexes, self.undo, self.check, self.threads)
            fills = self._write_fills(prepared) if resync else None
        except BaseException:
            hold.close()
            raise
        self._pending.keep((prepared, fills), prepared.result.target_version, hold)
        return prepared.result

    def _write_fills(self, prepared: Prepared) -> UndoLog | None:
        """The loaders' constants in the params a resync wrote (rolled back with it on failure)."""
        params = sorted({self.placed[n].param for n in prepared.result.touched if n in self.placed} & set(self.fills))
        if not params:
            return None
        undo = UndoLog()
        try:
            for param in params:
                flat = int_view(self.params[param])
                for pos, values in self.fills[param]:
                    bits = int_view(torch.from_numpy(values).to(self.params[param].dtype).reshape(-1))
                    where = torch.from_numpy(np.ascontiguousarray(pos)).to(flat.device)
                    undo.scatter(flat, where, bits.to(flat.device))
        except BaseException:
            undo.rollback()
            prepared.rollback()
            raise
        return undo

    @property
    def pending(self) -> ApplyResult | None:
        """The prepared, not yet committed version (None if there is none)."""
        return None if self._pending.item is None else self._pending.item[0].result

    def commit(self) -> ApplyResult:
        """Move to the prepared version (drops its undo log, releases the write guard)."""
        (prepared, fills), hold = self._pending.take("commit")
        with hold:
            prepared.release()
            if fills is not None:
                fills.close()
            self.sums.commit(prepared.result)
            self.guard.version = prepared.result.target_version
            if self.indexes is not None:  # only a committed version moves the indexes
                if prepared.result.resync:
                    self.indexes.drop(prepared.result.touched)
                    self.build_indexes(prepared.result.touched)
                else:
                    self._kept.move(prepared.result.deltas, self.threads)
        return prepared.result

    def rollback(self) -> ApplyResult:
        """Undo the prepared version bit for bit (the engine keeps its old version)."""
        (prepared, fills), hold = self._pending.take("roll back")
        with hold:
            if fills is not None:
                fills.rollback()
            prepared.rollback()
        return prepared.result

    def dense_refit(self, write: Callable[[dict[str, torch.Tensor]], None], version: int) -> EngineChecksums:
        """A conventional dense refit (the baseline benchmarks compare against): ``write`` overwrites
        the live tensors (:attr:`params`) by its own means under the write guard, then a full
        checksum scan; moves to ``version``.

        No undo log and no payload checks: a failure in ``write`` leaves the tensors mixed.

        Raises:
            PendingVersionError: a prepared version waits for commit or rollback.
        """
        self._pending.refuse("a dense refit")
        with self.guard.write():
            write(self.params)
            self.sums.rescan()
            if self.indexes is not None:  # keep the indexes of tensors whose bits did not change
                self.indexes.keep_current(self.sums.views)
            self.guard.version = version
        return self.sums.value()

    def build_indexes(self, names=None) -> None:
        """Build the kept ``dcr`` class indexes of ``names`` (default: every tensor) now, so the next
        refit's decode costs in proportion to its changes (otherwise the first use builds them).
        Called when the tensors were (re)loaded: after a resync, or by an engine at start."""
        if self.indexes is None:
            return
        bases = Bases(self.tensors)
        for name in self.tensors if names is None else names:
            t = bases[name]
            self.indexes.get(name, host_bits(t), spec_of(t.dtype), self.sums.views[name])

    def checksums(self, full: bool = False, sample: Sample | None = None) -> EngineChecksums:
        """Canonical sums and views: incremental (kept from each verified apply), a full scan, or
        the sums of ``sample``'s slice recomputed from the live tensors (:meth:`HeldSums.sampled`).

        A full scan also replaces the incremental values, so a later incremental check starts
        from what memory really holds; a sampled one changes nothing.

        Raises:
            PendingVersionError: a full scan or a sample while a version is prepared.
        """
        if sample is not None:
            self._pending.refuse("a sampled checksum")
            with self.guard.read():
                return self.sums.sampled(sample)
        if full:
            self._pending.refuse("a full checksum scan")
            with self.guard.read():
                self.sums.rescan()
        return self.sums.value()

    def digests(self) -> dict[str, str]:
        """sha256 of every live tensor's bits: the canonical tensors, or the engine params.

        Raises:
            PendingVersionError: while a version is prepared.
        """
        self._pending.refuse("digests")
        with self.guard.read():
            return tensor_digests(self.params)

    @contextmanager
    def serving(self) -> Iterator[int]:
        """Hold the current version for one generation; yields it."""
        with self.guard.read() as version:
            yield version

    def preflight(self) -> list[str]:
        """No differences: these tensors are what a load of them holds (no loader of its own to
        compare with; an engine that has one, e.g. ``VllmEngine``, compares with it)."""
        return []
