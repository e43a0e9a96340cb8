"""An engine over named tensors: version state, transactional apply, checksums, a read guard.

Real engines (``nemo_dcr.integrations.hf.engine``, the vLLM worker extension) hand their live
parameters to a :class:`TensorEngine` and wrap their generate call in :meth:`serving`.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator, Mapping, Sequence

import torch

from nemo_dcr.types import int_view, spec_of
from nemo_dcr.verify.checksum import tensor_checksum

from .guard import VersionGuard
from .shard_view import ShardView
from .transaction import ApplyResult, FaultHook, UndoSettings, apply_parts, resync_parts
from .undo import UNDO_MEMORY_BYTES


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
        undo_limit_bytes: old bits a transaction's undo log holds in memory at most; the rest is
            spilled to a temporary file (:mod:`nemo_dcr.apply.undo`).
        spill_dir: folder of that file (default: the system's temporary folder).
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor], version: int = 0, key: bytes | None = None,
                 undo_limit_bytes: int = UNDO_MEMORY_BYTES, spill_dir: str | None = None):
        self.tensors = dict(tensors)
        self.key = key
        self.undo = UndoSettings(undo_limit_bytes, spill_dir)
        self.guard = VersionGuard(version)
        self._checksums = full_checksums(self.tensors)
        self.fault: FaultHook | None = None

    @property
    def version(self) -> int:
        """The version every tensor holds (never a mix)."""
        return self.guard.version

    def apply(self, parts: Sequence[bytes]) -> ApplyResult:
        """Apply one version's parts as a transaction (see :func:`apply_parts`)."""
        with self.guard.write():
            result = apply_parts(self.tensors, parts, self.version, self._checksums, self.key, self.fault,
                                 self.undo)
            self._commit(result)
        return result

    def resync(self, parts: Sequence[bytes]) -> ApplyResult:
        """Overwrite the named tensors from a full resync (see :func:`resync_parts`)."""
        with self.guard.write():
            result = resync_parts(self.tensors, parts, self.version, self.key, self.fault, self.undo)
            self._commit(result)
        return result

    def dense_refit(self, write: Callable[[dict[str, torch.Tensor]], None], version: int) -> dict[str, int]:
        """A conventional dense refit (the baseline benchmarks compare against): ``write`` overwrites
        the live tensors under the write guard, then a full checksum scan; moves to ``version``.

        No undo log and no payload checks: a failure in ``write`` leaves the tensors mixed.

        Returns:
            The full checksums after the write.
        """
        with self.guard.write():
            write(self.tensors)
            self._checksums = full_checksums(self.tensors)
            self.guard.version = version
        return dict(self._checksums)

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
        with self.guard.read():
            self._checksums = full_checksums(self.tensors)
        return dict(self._checksums)

    @contextmanager
    def serving(self) -> Iterator[int]:
        """Hold the current version for one generation; yields it."""
        with self.guard.read() as version:
            yield version
