"""The sender mirror: what the engine holds of the tensors this trainer rank owns.

``dcr`` coding conditions on the receiver's old bits of each element, so the owner of a tensor
keeps a copy of the engine's bits of it.  Over all trainer ranks the mirror is one model copy,
never gathered on one rank.  It moves only when the engine acknowledged a version
(:meth:`SenderMirror.commit`); a refused version is dropped and its changes are re-sent with
the next one (capture also reports changes against the last acknowledged baseline).

The mirror is the sender side's one owner of checksum bookkeeping: the checksum of each owned
tensor (what payload records name as base and target, and what an engine holding tensors whole
reports) and of each engine shard's view of it (:meth:`SenderMirror.view_checksum`, what a shard
holding part of a tensor reports), both moved by the same committed changes.
"""

from __future__ import annotations

from typing import Hashable, Mapping, Sequence

import numpy as np
import torch

from nemo_dcr.apply.placement import Runs, view_delta
from nemo_dcr.codec import DcrIndexes, Identity, MovedIndexes, encode_deltas
from nemo_dcr.kernels import write_bits
from nemo_dcr.kernels.scan import changes_at
from nemo_dcr.kernels.traffic import host_bits
from nemo_dcr.types import DTYPES, SparseDelta, carrier
from nemo_dcr.verify.checksum import checksum_after, checksums_after, tensor_checksum
from nemo_dcr.verify.sample import Sample, runs_checksum

from .payloads import buckets


def _as_tensor(bits: np.ndarray, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    return carrier(bits).view(DTYPES[dtype].torch_dtype).reshape(shape)


class SenderMirror:
    """Flat bits of owned tensors as the engine holds them, plus one staged version.

    Args:
        shapes: owned tensor name -> (wire dtype name, shape); bits start at zero.
        version: version of the engine the mirror describes.
    """

    def __init__(self, shapes: Mapping[str, tuple[str, tuple[int, ...]]], version: int = 0):
        self.meta = dict(shapes)
        self.bits = {n: np.zeros(int(np.prod(s)), DTYPES[d].uint) for n, (d, s) in self.meta.items()}
        self.checksums = {n: tensor_checksum(b) for n, b in self.bits.items()}
        self.version = version
        self._staged: tuple[int, list[SparseDelta]] | None = None
        self._views: dict[str, dict[Hashable, tuple[Runs, int]]] = {}  # name -> view key -> (runs, checksum)
        self._kept = MovedIndexes("nemo-dcr-mirror-index")  # dcr class indexes of the mirror bits, moved by commit

    @property
    def indexes(self) -> DcrIndexes:
        """The kept ``dcr`` class indexes of the mirror bits, once the last commit has moved them
        (waits for that move; an error it ended with is raised here, once)."""
        return self._kept.current

    def view_checksum(self, name: str, runs: Runs, key: Hashable) -> int:
        """Checksum of an engine shard's view of ``name`` (the elements at ``runs``, in view index
        order) as the mirror's bits make it: the tensor's own for a view of every element, else
        computed once per distinct view ``key`` and then moved by every :meth:`commit`."""
        _, shape = self.meta[name]
        if runs.numel == int(np.prod(shape)):
            return self.checksums[name]
        views = self._views.setdefault(name, {})
        if key not in views:
            views[key] = (runs, tensor_checksum(self.bits[name][runs.expand()[0]]))
        return views[key][1]

    def changes(self, pieces: Sequence[SparseDelta]) -> list[SparseDelta]:
        """Merged deltas of owned tensors with ``old_bits`` from the mirror; no-ops removed."""
        out = []
        for d in pieces:
            pos, new, old = changes_at(self.bits[d.name], d.positions, d.new_bits)
            if pos.size == d.positions.size and d.positions.flags.c_contiguous and d.new_bits.flags.c_contiguous:
                pos, new = d.positions, d.new_bits  # every entry changes: keep the piece's arrays (no copy of them)
                if d.old_bits is not None and d.old_bits.flags.c_contiguous and np.array_equal(old, d.old_bits):
                    old = d.old_bits
            out.append(SparseDelta(d.name, d.dtype, d.shape, pos, new, old))
        return out

    def encode(self, deltas: Sequence[SparseDelta], identity: Identity, encoding: str, key: bytes | None,
               max_changes: int, threads: int = 1, from_changes: bool = True) -> list[bytes]:
        """Payload parts (at least one, maybe without records) for ``deltas``; stages them
        (``threads``: worker threads over each part's records, ``dcr.threads``).

        ``from_changes``: the deltas are this mirror's :meth:`changes`, whose old bits were read
        from its bits there, so the encoder does not read them again; False for deltas made
        elsewhere (the FP8 mirror's quantized changes), whose old bits the encoder reads."""
        self.stage(deltas, identity.target_version)
        groups = list(buckets(deltas, max_changes)) or [[]]
        return [encode_deltas(g, self.bits, identity, encoding, key, self.checksums, self.indexes, threads,
                              old_from_base=from_changes) for g in groups]

    def stage(self, deltas: Sequence[SparseDelta], version: int) -> list[SparseDelta]:
        """Hold ``deltas`` (canonical, with mirror old bits) until :meth:`commit` of ``version``;
        returns what the engine receives for them (here: the same deltas)."""
        self._staged = (version, list(deltas))
        return self._staged[1]

    def current_bits(self, name: str) -> np.ndarray:
        """Trainer-side flat bits of ``name`` (mirror plus staged changes; a copy only if staged)."""
        for d in (self._staged[1] if self._staged else []):
            if d.name == name:
                bits = self.bits[name].copy()
                bits[d.positions] = d.new_bits
                return bits
        return self.bits[name]

    def current(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """Trainer-side bits (mirror plus staged changes) of ``names`` as tensors (copies)."""
        out = {}
        for n in names:
            bits = self.current_bits(n)
            out[n] = _as_tensor(bits.copy() if bits is self.bits[n] else bits, *self.meta[n])
        return out

    def current_checksums(self) -> dict[str, int]:
        """Checksums of the trainer-side bits (mirror plus staged changes)."""
        return checksums_after(self.checksums, self._staged[1] if self._staged else [])

    def commit(self, version: int, threads: int = 1) -> None:
        """The engine acknowledged ``version``: write the staged changes; the tensors' and their
        partial views' checksums move by them.  The kept class indexes move on a thread of their
        own (``threads``: its worker threads), so the refit's report does not wait for them:
        :attr:`indexes` waits, so the next encode, build or reset sees them moved (the numba
        kernels release the GIL; in an RL job the move runs beside the next training step)."""
        if self._staged is not None and self._staged[0] == version:
            staged = self._staged[1]
            for d in staged:
                views = self._views.get(d.name, {})
                for key, (runs, c) in views.items():
                    views[key] = (runs, checksum_after(c, view_delta(d, runs)))
                write_bits(self.bits[d.name], d.positions, d.new_bits)
            self.checksums = checksums_after(self.checksums, staged)
            self._kept.move(staged, threads)
        self._staged = None
        self.version = version

    def build_indexes(self) -> None:
        """Build the kept ``dcr`` class index of every owned tensor now (after a (re)sync), so the
        next refit encodes in proportion to its changes instead of building them on first use."""
        for n, bits in self.bits.items():
            self.indexes.get(n, bits, DTYPES[self.meta[n][0]], self.checksums[n])

    def settle(self, names: Sequence[str], version: int) -> None:
        """The engine holds the trainer-side bits (:meth:`current`) of ``names`` at ``version``
        (tensor by tensor: one tensor's copy at a time, not a second copy of every one)."""
        for n in names:
            self._install(n, self.current_bits(n))
        self._installed(names, version)

    # -- the engine format: the engine holds the canonical tensors (see refit/fp8_mirror.py) ------------

    def engine_names(self, names: Sequence[str]) -> list[str]:
        """The engine tensors of canonical tensors ``names`` (here: the same names)."""
        return list(names)

    def canonical_name(self, engine_name: str) -> str:
        """The canonical tensor an engine tensor belongs to (here: itself)."""
        return engine_name

    def trainer_side(self, checksums: Mapping[str, int], sample: Sample | None = None) -> Mapping[str, int]:
        """The trainer's partial checksums to compare with the engine's: its live params' own
        (``checksums``, of ``sample``'s slice for a sampled check), independent of this mirror."""
        return checksums

    def sampled_view(self, name: str, runs: Runs, sample: Sample) -> int:
        """``sample``'s slice of an engine shard's view of ``name`` (the elements at ``runs``,
        hashed by canonical index) as the committed mirror bits make it: what that shard's
        sampled view sum must be."""
        return runs_checksum(self.bits[name], runs.canon, runs.canon, runs.length, sample, name)

    def telemetry(self, encoding: str | None) -> dict[str, int]:
        """Counts of the engine format for the report (none for canonical tensors)."""
        return {}

    def dense_bytes(self) -> int:
        """Bytes of the mirrored tensors whole (what a dense refit of them sends)."""
        return sum(int(np.prod(s)) * DTYPES[d].width for d, s in self.meta.values())

    def reset(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """After a resync: the engine holds ``tensors`` (owned names) at ``version``."""
        for n, t in tensors.items():
            self._install(n, host_bits(t).view(self.bits[n].dtype).copy())
        self._installed(list(tensors), version)

    def _install(self, name: str, bits: np.ndarray) -> None:
        self.bits[name] = bits
        self.checksums[name] = tensor_checksum(bits)
        self._views.pop(name, None)  # recomputed from the new bits on demand

    def _installed(self, names: Sequence[str], version: int) -> None:
        self._staged = None
        self.indexes.keep_current({n: self.checksums[n] for n in names})
        self.version = version
