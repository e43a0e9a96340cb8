"""An engine over named tensors: version state, transactional apply, checksums, a read guard.

Real engines (``nemo_dcr.integrations.hf.engine``, the vLLM worker extension) hand their live
parameters to a :class:`TensorEngine` and wrap their generate call in :meth:`serving`.

An engine spread over several processes (vLLM's TP ranks) commits a version only when every
rank verified it: each rank :meth:`TensorEngine.prepare`-s (written, verified, undo log kept,
write guard held), then the driver tells all ranks to :meth:`~TensorEngine.commit` or to
:meth:`~TensorEngine.rollback`.  :meth:`TensorEngine.apply` is prepare-then-commit.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Callable, Iterator, Mapping, Sequence

import torch

from nemo_dcr.codec import DcrIndexes
from nemo_dcr.types import host_bits, int_view, spec_of
from nemo_dcr.verify.checksum import tensor_checksum

from .errors import RefitRefusedError
from .guard import VersionGuard
from .shard_view import ShardView
from .transaction import ApplyResult, Bases, FaultHook, Prepared, UndoSettings, prepare_parts, prepare_resync
from .undo import UNDO_MEMORY_BYTES


class PendingVersionError(RefitRefusedError):
    """A prepared version is waiting for commit or rollback (or none is, when one was expected)."""


def full_checksums(tensors: Mapping[str, "torch.Tensor | ShardView"]) -> dict[str, int]:
    """Checksum of every tensor by a full scan (index = flat index, or view index for a view)."""
    out = {}
    for name, t in tensors.items():
        t = t.gather() if isinstance(t, ShardView) else t
        out[name] = tensor_checksum(int_view(t).cpu().numpy().view(spec_of(t.dtype).uint))
    return out


class TensorEngine:
    """Named live tensors that move from version to version only by whole transactions.

    Args:
        tensors: canonical name -> live tensor (contiguous; written in place).
        version: the version these tensors hold.
        key: HMAC key every payload must carry (None: unauthenticated payloads).
        keep_index: keep a ``dcr`` class index per tensor between versions (host memory of about
            2.3 bytes per element of the tensors that receive ``dcr`` records), so decoding costs
            in proportion to the changes instead of a pass over each tensor.
        undo_limit_bytes: old bits a transaction's undo log holds in memory at most; the rest is
            spilled to a temporary file (:mod:`nemo_dcr.apply.undo`).
        spill_dir: folder of that file (default: the system's temporary folder).
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor], version: int = 0, key: bytes | None = None,
                 keep_index: bool = True, undo_limit_bytes: int = UNDO_MEMORY_BYTES, spill_dir: str | None = None):
        self.tensors = dict(tensors)
        self.key = key
        self.indexes = DcrIndexes() if keep_index else None
        self.undo = UndoSettings(undo_limit_bytes, spill_dir)
        self.guard = VersionGuard(version)
        self._checksums = full_checksums(self.tensors)
        self.fault: FaultHook | None = None
        self._pending: tuple[Prepared, ExitStack] | None = None

    @property
    def version(self) -> int:
        """The version every tensor holds (never a mix)."""
        return self.guard.version

    def apply(self, parts: Sequence[bytes]) -> ApplyResult:
        """Apply one version's parts as a transaction (see :func:`~.transaction.apply_parts`)."""
        self.prepare(parts)
        return self.commit()

    def resync(self, parts: Sequence[bytes]) -> ApplyResult:
        """Overwrite the named tensors from a full resync (see :func:`~.transaction.resync_parts`)."""
        self.prepare(parts, resync=True)
        return self.commit()

    def prepare(self, parts: Sequence[bytes], resync: bool = False) -> ApplyResult:
        """Validate, write and verify one version; keep its undo log and the write guard.

        Until :meth:`commit` or :meth:`rollback`, :attr:`version` stays the old one and readers
        (:meth:`serving`) wait.  A failure rolls back at once and releases the guard.

        Raises:
            PendingVersionError: another prepared version is pending (nothing written).
            RefitRefusedError, DeltaFormatError: as :func:`~.transaction.prepare_parts`.
        """
        if self._pending is not None:
            raise PendingVersionError(f"version {self._pending[0].result.target_version} is prepared and "
                                      "not yet committed or rolled back")
        hold = ExitStack()
        hold.enter_context(self.guard.write())
        try:
            if resync:
                prepared = prepare_resync(self.tensors, parts, self.version, self.key, self.fault, self.undo)
            else:
                prepared = prepare_parts(self.tensors, parts, self.version, self._checksums, self.key, self.fault,
                                         self.indexes, self.undo)
        except BaseException:
            hold.close()
            raise
        self._pending = (prepared, hold)
        return prepared.result

    @property
    def pending(self) -> ApplyResult | None:
        """The prepared, not yet committed version (None if there is none)."""
        return None if self._pending is None else self._pending[0].result

    def commit(self) -> ApplyResult:
        """Move to the prepared version (drops its undo log, releases the write guard)."""
        prepared, hold = self._take_pending("commit")
        with hold:
            prepared.release()
            self._commit(prepared.result)
            if self.indexes is not None:  # only a committed version moves the indexes
                if prepared.result.resync:
                    self.indexes.drop(prepared.result.touched)
                    self.build_indexes(prepared.result.touched)
                else:
                    self.indexes.update(prepared.result.deltas)
        return prepared.result

    def rollback(self) -> ApplyResult:
        """Undo the prepared version bit for bit (the engine keeps its old version)."""
        prepared, hold = self._take_pending("roll back")
        with hold:
            prepared.rollback()
        return prepared.result

    def _refuse_if_pending(self, what: str) -> None:
        """Raise instead of waiting on our own write guard (it is held while a version is pending)."""
        if self._pending is not None:
            raise PendingVersionError(f"{what} while version {self._pending[0].result.target_version} "
                                      "is prepared: commit or roll back first")

    def _take_pending(self, verb: str) -> tuple[Prepared, ExitStack]:
        if self._pending is None:
            raise PendingVersionError(f"nothing to {verb}: no version is prepared (engine at v{self.version})")
        pending, self._pending = self._pending, None
        return pending

    def dense_refit(self, write: Callable[[dict[str, torch.Tensor]], None], version: int) -> dict[str, int]:
        """A conventional dense refit (the baseline benchmarks compare against): ``write`` overwrites
        the live tensors under the write guard, then a full checksum scan; moves to ``version``.

        No undo log and no payload checks: a failure in ``write`` leaves the tensors mixed.

        Returns:
            The full checksums after the write.

        Raises:
            PendingVersionError: a prepared version waits for commit or rollback.
        """
        self._refuse_if_pending("a dense refit")
        with self.guard.write():
            write(self.tensors)
            self._checksums = full_checksums(self.tensors)
            if self.indexes is not None:  # keep the indexes of tensors whose bits did not change
                self.indexes.keep_current(self._checksums)
            self.guard.version = version
        return dict(self._checksums)

    def build_indexes(self, names=None) -> None:
        """Build the kept ``dcr`` class indexes of ``names`` (default: every tensor) now, so the next
        refit's decode costs in proportion to its changes (otherwise the first use builds them).
        Called when the tensors were (re)loaded: after a resync, or by an engine at start."""
        if self.indexes is None:
            return
        bases = Bases(self.tensors)
        for name in self.tensors if names is None else names:
            t = bases[name]
            self.indexes.get(name, host_bits(t), spec_of(t.dtype), self._checksums[name])

    def _commit(self, result: ApplyResult) -> None:
        self._checksums.update(result.checksums)
        self.guard.version = result.target_version

    def checksums(self, full: bool = False) -> dict[str, int]:
        """Per-tensor checksums: incremental (kept from each verified apply) or a full scan.

        A full scan also replaces the incremental values, so a later incremental check starts
        from what memory really holds.
        """
        if not full:
            return dict(self._checksums)
        self._refuse_if_pending("a full checksum scan")
        with self.guard.read():
            self._checksums = full_checksums(self.tensors)
        return dict(self._checksums)

    @contextmanager
    def serving(self) -> Iterator[int]:
        """Hold the current version for one generation; yields it."""
        with self.guard.read() as version:
            yield version
