"""One refit as a transaction over named tensors (any device: writes are ``index_put`` on
integer views).

Phases (docs/refit.md, "Transactions"):

1. **validate**: every part is decoded by :func:`nemo_dcr.codec.decode_parts` against the live
   tensors (authentication, names, dtypes, shapes, bounds, base checksum, target checksum)
   and the versions are checked: each part's base is the engine's version, all parts share one
   target.  Nothing is written before all parts passed.
2. **write** (:func:`write_deltas`): for each tensor, its old bits at the changed positions
   (those the decode of phase 1 read) go into the :class:`UndoLog` *before* the new bits are
   scattered in (nnz-sized).
3. **verify** (:func:`verify_written`): after all writes the written positions are read back and
   must hold the new bits, whose incremental checksum ``C' = C - sum h(i, old) + sum h(i, new)``
   phase 1 checked against the record's target checksum.
4. **commit** (caller moves its version) or, on any exception in 2-3, **roll back**: the undo
   log restores every touched element in reverse order, bit for bit.

An engine spread over several ranks (one process per TP rank) needs every rank to have passed 3
before any rank commits: :func:`prepare_parts` / :func:`prepare_resync` stop after 3 and return
a :class:`Prepared` that keeps the undo log, so the caller commits (drops the log) or rolls back
later, when it has heard from all ranks.  :func:`apply_parts` / :func:`resync_parts` are
prepare-then-commit on one rank.
"""

from __future__ import annotations

from collections import ChainMap
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator, Mapping, Sequence, Union

import numpy as np
import torch

from nemo_dcr.codec import DcrIndexes, decode_parts, inspect
from nemo_dcr.codec.errors import MissingTensorError, ShapeMismatchError
from nemo_dcr.kernels import read_bits, unequal_at, write_bits
from nemo_dcr.kernels.inplace import width_of
from nemo_dcr.kernels.traffic import HostDeviceBytes, device_path, host_bits, measure, on_host, to_device, to_host
from nemo_dcr.kernels.workers import map_records, parallel
from nemo_dcr.types import SparseDelta, carrier, int_view, spec_of
from nemo_dcr.verify.checksum import tensor_checksum

from .errors import ApplyVerificationError, IncompletePartsError, VersionMismatchError
from .shard_view import ShardView
from .undo import UNDO_MEMORY_BYTES, UndoLog

RESYNC_BASE_VERSION = 0
"""Base version of every resync payload: it is encoded against all-zero tensors."""

FaultHook = Callable[[str], None]
"""Called after each tensor is written (chaos and tests raise from it)."""

PayloadCheck = Callable[[Mapping[str, torch.Tensor], Sequence[SparseDelta], bool], object]
"""Engine-specific rules on decoded changes, run after validation and before anything is written:
``check(bases, deltas, resync)`` raises to refuse the version.  ``bases`` are the tensors the
deltas apply to: the live ones, or for a resync all-zero tensors for those in the payload (whose
deltas then list every nonzero element).  An FP8 engine checks its scales and bytes here
(:class:`nemo_dcr.quant.Fp8TransactionCheck`)."""

Live = Union[torch.Tensor, ShardView]
"""A live tensor, or the view of a canonical tensor inside a fused/sharded engine param."""


class Bases(Mapping):
    """What ``decode`` checks payloads against: tensors as they are, views gathered on demand."""

    def __init__(self, tensors: Mapping[str, Live]):
        self._t = tensors

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self._t[name]
        return t.gather() if isinstance(t, ShardView) else t

    def __contains__(self, name) -> bool:  # Mapping's default would gather the view
        return name in self._t

    def __iter__(self) -> Iterator[str]:
        return iter(self._t)

    def __len__(self) -> int:
        return len(self._t)


def _target(t: Live, positions: np.ndarray) -> tuple[torch.Tensor | np.ndarray, torch.Tensor | np.ndarray]:
    """(flat integer view to write, positions in it) for record positions of ``t``: for a host
    tensor its numpy bits and the positions as they are (so the writes, the undo log and the
    read-back take no torch op per record)."""
    if isinstance(t, ShardView):
        return t.flat(), t.locate(positions)
    if on_host(t):
        return host_bits(t), positions
    view = int_view(t)
    return view, to_device(np.ascontiguousarray(positions, np.int64), view.device)


def _storage(t: Live) -> int:
    """Address of the storage ``t`` (or the engine param a view lies in) writes into."""
    return (t.param if isinstance(t, ShardView) else t).untyped_storage().data_ptr()


@dataclass(frozen=True)
class ApplyResult:
    """What one committed transaction did.

    Attributes:
        base_version: version before.
        target_version: version after.
        touched: tensor name -> elements written (only tensors with changes).
        checksums: tensor name -> checksum after the apply, for every tensor in the payload.
        resync: the transaction was a full resync.
        undo_bytes: old bits the undo log held in memory (at most its bound).
        undo_spilled_bytes: old bits the undo log spilled to its temporary file.
        host_device: bytes this transaction copied between the host and the tensors' device
            (decode, writes, read-back; :mod:`nemo_dcr.kernels.traffic`), counted on any device.
        deltas: the changes written (record index space; old and new bits), for callers that keep
            further sums (a routed engine's canonical checksums); empty for a resync.
    """

    base_version: int
    target_version: int
    touched: dict[str, int]
    checksums: dict[str, int]
    resync: bool = False
    undo_bytes: int = 0
    deltas: tuple[SparseDelta, ...] = ()
    undo_spilled_bytes: int = 0
    host_device: HostDeviceBytes = field(default_factory=HostDeviceBytes)


def _check_versions(headers, version: int, resync: bool) -> int:
    targets = {h.target_version for h in headers}
    if not headers or len(targets) != 1:
        raise IncompletePartsError(f"parts disagree on the target version: {sorted(targets)}")
    target = targets.pop()
    for h in headers:
        base = RESYNC_BASE_VERSION if resync else version
        if h.base_version != base or (resync and target <= version):
            raise VersionMismatchError(version, h.base_version, h.target_version)
    names = [r.name for h in headers for r in h.records]
    if len(set(names)) != len(names):
        raise IncompletePartsError("two parts carry a record for the same tensor")
    return target


@dataclass(frozen=True)
class UndoSettings:
    """Bound of the undo log's memory and the folder it spills to (see :mod:`nemo_dcr.apply.undo`)."""

    limit_bytes: int = UNDO_MEMORY_BYTES
    spill_dir: str | None = None


@dataclass
class Prepared:
    """A version written and verified but not committed: the undo log is still held.

    Attributes:
        result: what the transaction did (as :func:`apply_parts` would return it).
        undo: the old bits of every written element; :meth:`rollback` restores them.
    """

    result: ApplyResult
    undo: UndoLog

    def rollback(self) -> None:
        """Restore every written element, bit for bit (and drop the log)."""
        self.undo.rollback()

    def release(self) -> ApplyResult:
        """The version is committed: drop the undo log (and its spill file)."""
        self.undo.close()
        return self.result


def _transact(writes: Callable[[UndoLog], dict[str, int]],
              settings: UndoSettings) -> tuple[dict[str, int], UndoLog]:
    undo = UndoLog(settings.limit_bytes, settings.spill_dir)
    try:
        touched = writes(undo)
        return touched, undo
    except BaseException:
        undo.rollback()
        raise


def apply_parts(tensors: Mapping[str, torch.Tensor], parts: Sequence[bytes], version: int,
                checksums: Mapping[str, int], key: bytes | None = None,
                fault: FaultHook | None = None, indexes: DcrIndexes | None = None,
                undo: UndoSettings = UndoSettings(), check: PayloadCheck | None = None,
                threads: int = 1) -> ApplyResult:
    """Apply all parts of one version as one transaction (see the module docstring).

    Same arguments and errors as :func:`prepare_parts`; commits at once (the undo log is dropped).
    """
    return prepare_parts(tensors, parts, version, checksums, key, fault, indexes, undo, check, threads).release()


def prepare_parts(tensors: Mapping[str, torch.Tensor], parts: Sequence[bytes], version: int,
                  checksums: Mapping[str, int], key: bytes | None = None,
                  fault: FaultHook | None = None, indexes: DcrIndexes | None = None,
                  undo: UndoSettings = UndoSettings(), check: PayloadCheck | None = None,
                  threads: int = 1) -> Prepared:
    """Validate, write and verify one version, keeping the undo log (phases 1-3).

    Args:
        tensors: the engine's live tensors by canonical name (contiguous, any device).
        parts: payloads of one version (one per sender or bucket).
        version: the version the engine holds.
        checksums: the engine's current checksum of each tensor.
        key: HMAC key the payloads must carry.
        fault: hook called after each tensor written (fault injection).
        indexes: the engine's kept ``dcr`` class indexes, used to decode; this function never
            updates them (the caller does, with ``result.deltas``, once it committed).
        undo: the undo log's memory bound and spill folder.
        check: engine-specific rules on the decoded changes (:data:`PayloadCheck`).
        threads: worker threads over the records of all parts (``dcr.threads``): decode, write and
            read-back; the same state, refusals and messages as one thread.

    Raises:
        DeltaFormatError, VersionMismatchError, IncompletePartsError, or whatever ``check``
            raises: refused, nothing written.
        ApplyVerificationError, or whatever ``fault`` raises: rolled back exactly.
    """
    with measure() as crossed:
        prepared = _prepare_delta(tensors, parts, version, checksums, key, fault, indexes, undo, check, threads)
    return replace(prepared, result=replace(prepared.result, host_device=crossed))


def _prepare_delta(tensors, parts, version, checksums, key, fault, indexes, undo, check, threads) -> Prepared:
    decoded = decode_parts(parts, Bases(tensors), key, checksums, indexes, threads)
    target = _check_versions([d.header for d in decoded], version, resync=False)
    records = {r.name: r for d in decoded for r in d.header.records}
    deltas = [x for d in decoded for x in d.deltas]
    if check is not None:
        check(Bases(tensors), deltas, False)
    new_ck = {d.name: int(records[d.name].target_checksum, 16) for d in deltas}

    def writes(undo: UndoLog) -> dict[str, int]:
        written = write_deltas(undo, tensors, deltas, fault, threads)
        verify_written(written, threads)
        return {d.name: d.nnz for d, _, _ in written}

    touched, log = _transact(writes, undo)
    result = ApplyResult(version, target, touched, new_ck, False, log.nbytes, tuple(deltas), log.spilled_bytes)
    return Prepared(result, log)


Written = list[tuple[SparseDelta, "torch.Tensor | np.ndarray", "torch.Tensor | np.ndarray"]]
"""What :func:`write_deltas` wrote: each delta with the integer view (a host tensor's numpy bits)
and the positions in it."""


def write_deltas(undo: UndoLog, tensors: Mapping[str, Live], deltas: Sequence[SparseDelta],
                 fault: FaultHook | None = None, threads: int = 1) -> Written:
    """Phase 2: each delta's new bits into its live tensor, its decoded old bits (what the tensor
    held there when it was validated) into the undo log first; ``fault`` after each tensor.

    With ``threads`` > 1 and a part large enough (:func:`~nemo_dcr.kernels.workers.parallel`)
    worker threads locate the positions; every delta's old bits are then logged first, in order,
    and the workers write the tensors, those that share memory (views of one fused param, tied
    weights) in order on one worker, each memory beside the others.  A failure in any of them rolls
    back all of it and reports like one thread: the first failing tensor in delta order."""
    deltas = [d for d in deltas if d.nnz]
    targets = map_records(lambda d: _target(tensors[d.name], d.positions), deltas, threads, _nnz)
    written = [(d, view, pos) for d, (view, pos) in zip(deltas, targets)]
    memories: dict[int, list[int]] = {}
    for i, (d, _, _) in enumerate(written):
        memories.setdefault(_storage(tensors[d.name]), []).append(i)
    if len(memories) < 2 or not parallel(deltas, threads, _nnz):
        for d, view, pos in written:
            undo.scatter(view, pos, d.new_bits, d.old_bits)
            if fault is not None:
                fault(d.name)
        return written
    for d, view, pos in written:
        undo.save(view, pos, d.old_bits)

    def write(memory: list[int]) -> tuple[int, Exception] | None:
        for i in memory:
            d, view, pos = written[i]
            try:
                write_bits(view, pos, d.new_bits)
                if fault is not None:
                    fault(d.name)
            except Exception as exc:  # raised below: the first failing tensor in delta order
                return i, exc
        return None

    failed = [f for f in map_records(write, list(memories.values()), threads,
                                     lambda memory: sum(written[i][0].nnz for i in memory)) if f is not None]
    if failed:
        raise min(failed, key=lambda f: f[0])[1]
    return written


def _nnz(d: SparseDelta) -> int:
    return d.nnz


def verify_written(written: Written, threads: int = 1) -> None:
    """Phase 3: every written element is read back after all writes and must hold its new bits.

    The new bits' incremental checksum ``C - sum h(i, old) + sum h(i, new)`` matched the record's
    target checksum in phase 1, so a tensor whose written elements read back equal holds the
    target checksum (an element-wise comparison: stronger than comparing the sums).

    ``threads``: worker threads over the tensors; the error is the first failing tensor's, as with one.

    Raises:
        ApplyVerificationError: an element does not hold what was written (another write, a
            device fault, an aliased tensor); the caller rolls back.
    """
    def check(w) -> None:
        d, view, pos = w
        bad = unequal_at(view, pos, d.new_bits)
        if bad >= 0:
            got = int(read_bits(view, pos[bad : bad + 1])[0]) & ((1 << (8 * width_of(view))) - 1)
            raise ApplyVerificationError(f"{d.name}: element {int(d.positions[bad])} reads back {got:#x} after the "
                                         f"write, the version writes {int(d.new_bits[bad]):#x}")

    map_records(check, written, threads, lambda w: w[0].nnz)


def _zero_base(tensors: Mapping[str, Live], parts: Sequence[bytes], key) -> dict[str, torch.Tensor]:
    base = {}
    for p in parts:
        for r in inspect(p, key, receiver=tensors).records:
            t = tensors.get(r.name)
            if t is None:
                raise MissingTensorError(f"receiver has no such tensor ({len(tensors)} tensors)", r.name)
            if tuple(t.shape) != r.shape:
                raise ShapeMismatchError(f"payload shape {list(r.shape)}, receiver {list(t.shape)}", r.name)
            base[r.name] = torch.zeros(t.shape, dtype=t.dtype)
    return base


def resync_parts(tensors: Mapping[str, torch.Tensor], parts: Sequence[bytes], version: int,
                 key: bytes | None = None, fault: FaultHook | None = None,
                 undo: UndoSettings = UndoSettings(), check: PayloadCheck | None = None) -> ApplyResult:
    """Full resync: payloads encoded against all-zero tensors overwrite the named tensors.

    The target version must be newer than ``version``; tensors not in the payload keep their
    bits.  The undo log saves whole tensors (a resync is a 100%-density delta), spilling beyond
    ``undo.limit_bytes``.  Commits at once; :func:`prepare_resync` keeps the undo log instead.
    """
    return prepare_resync(tensors, parts, version, key, fault, undo, check).release()


def prepare_resync(tensors: Mapping[str, torch.Tensor], parts: Sequence[bytes], version: int,
                   key: bytes | None = None, fault: FaultHook | None = None,
                   undo: UndoSettings = UndoSettings(), check: PayloadCheck | None = None) -> Prepared:
    """A full resync written and verified, not committed (see :func:`resync_parts`)."""
    with measure() as crossed:
        prepared = _prepare_resync(tensors, parts, version, key, fault, undo, check)
    return replace(prepared, result=replace(prepared.result, host_device=crossed))


def _prepare_resync(tensors, parts, version, key, fault, undo, check) -> Prepared:
    zeros = _zero_base(tensors, parts, key)
    with device_path(False):  # the zeros are host memory
        decoded = decode_parts(parts, zeros, key)
    target = _check_versions([d.header for d in decoded], version, resync=True)
    records = {r.name: r for d in decoded for r in d.header.records}
    deltas = [x for d in decoded for x in d.deltas]
    if check is not None:
        check(ChainMap(zeros, Bases(tensors)), deltas, True)
    del zeros

    def writes(undo: UndoLog) -> dict[str, int]:
        touched = {}
        for d in deltas:
            t = tensors[d.name]
            full = torch.zeros(d.numel, dtype=int_view(torch.zeros(1, dtype=t.dtype)).dtype)
            full[torch.from_numpy(np.ascontiguousarray(d.positions))] = carrier(d.new_bits)
            _overwrite(undo, t, full)
            touched[d.name] = d.numel
            if fault is not None:
                fault(d.name)
            now = Bases(tensors)[d.name]
            got = tensor_checksum(to_host(int_view(now)).numpy().view(spec_of(now.dtype).uint))
            if got != int(records[d.name].target_checksum, 16):
                raise ApplyVerificationError(f"{d.name}: checksum after resync {got:016x}, "
                                             f"payload target {records[d.name].target_checksum}")
        return touched

    touched, log = _transact(writes, undo)
    new_ck = {n: int(r.target_checksum, 16) for n, r in records.items()}
    return Prepared(ApplyResult(version, target, touched, new_ck, True, log.nbytes, (), log.spilled_bytes), log)


def _overwrite(undo: UndoLog, t: Live, full: torch.Tensor) -> None:
    """Replace every element of ``t`` by ``full`` (flat bits), saving the old ones."""
    if isinstance(t, ShardView):
        undo.scatter(t.flat(), t.locate(np.arange(t.runs.numel)), full.numpy())
    else:
        view = int_view(t)
        undo.overwrite(view, to_device(full.numpy(), view.device))
