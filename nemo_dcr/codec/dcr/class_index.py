"""The kept class index of ``dcr`` (docs/wire_format.md section 4.4): each element's rank in the
(exponent class, flat index) order of a tensor's base bits, kept between refits.

Without it every ``dcr`` encode and decode ranks the whole base tensor again (a pass over the
model per refit).  A :class:`DcrIndex` is built once from the base bits (one pass) and then
updated from each committed delta in time proportional to the changes: only elements whose
exponent changed move between classes.  Both sides of a refit keep one per tensor, through a
:class:`DcrIndexes` mapping:

* the sender (trainer mirror) passes it to :func:`nemo_dcr.codec.encode_deltas` and calls
  :meth:`DcrIndexes.update` with the committed deltas once the engine acknowledged;
* the receiver (engine) passes it to :func:`nemo_dcr.codec.decode` and calls
  :meth:`DcrIndexes.update` after a committed transaction (never after a rolled-back one);
* a resync calls :meth:`DcrIndexes.drop` (or :meth:`DcrIndexes.keep_current` with the new
  checksums, which keeps the indexes of tensors whose bits did not change).

Each index carries the checksum of the bits it describes; :meth:`DcrIndexes.get` rebuilds an
index whose checksum is not the base's, so a missed update costs a rebuild, never wrong bytes.

Memory per element: 2 bytes (``order``) plus ``(2 E + 2) * 2 / 4096 + E * 8 / 65536`` bytes of
tables for ``E`` exponent classes (bf16/fp32: 2.28 bytes, fp16 2.03, fp8 2.02).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Iterable, Mapping

import numpy as np

from ...kernels.workers import Behind, map_records
from ...types import DtypeSpec, SparseDelta
from ...verify.checksum import tensor_checksum, updated_checksum
from . import jit_index as K


_NONE_FOUND = np.zeros(0, np.uint16)


class StaleIndexError(ValueError):
    """A kept class index does not describe the bits it is used with (it is then dropped)."""


@dataclass(eq=False)
class DcrIndex:
    """Class-rank tables of one tensor's base bits (layout in :mod:`.jit_index`).

    Attributes:
        spec: dtype of the tensor.
        n: elements.
        order, lfirst, sbefore, sup: the tables.
        checksum: checksum of the bits described (``None`` once an update failed).
        found: the ``order`` entries the last :meth:`ranks` found (uint16, one per change), which
            the next :meth:`update` starts from when it has as many changes (a hint: checked
            entry by entry, so a stale one costs searches, never a wrong index); dropped by it.
    """

    spec: DtypeSpec
    n: int
    order: np.ndarray
    lfirst: np.ndarray
    sbefore: np.ndarray
    sup: np.ndarray
    checksum: int | None
    found: np.ndarray = field(default_factory=lambda: _NONE_FOUND, repr=False)

    @classmethod
    def build(cls, bits: np.ndarray, spec: DtypeSpec, checksum: int | None = None) -> "DcrIndex":
        """Index of flat base ``bits`` (one pass); ``checksum`` of them if known."""
        bits = np.ascontiguousarray(bits).reshape(-1)
        n, E = bits.size, spec.n_exponents
        nb = max(1, -(-n // K.BLOCK))
        nsb = -(-nb // (1 << K.SSHIFT))
        ix = cls(spec, n, np.zeros(nb * K.BLOCK, np.uint16), np.zeros((nb, E + 1), np.uint16),
                 np.zeros((E, nb), np.uint16), np.zeros((E, nsb + 1), np.int64),
                 tensor_checksum(bits) if checksum is None else checksum)
        K.build(bits, spec.exp_shift, E - 1, ix.order, ix.lfirst, ix.sbefore, ix.sup)
        return ix

    @property
    def hist(self) -> np.ndarray:
        """Elements per class."""
        return self.sup[:, -1]

    @property
    def nbytes(self) -> int:
        return self.order.nbytes + self.lfirst.nbytes + self.sbefore.nbytes + self.sup.nbytes

    def tables(self) -> tuple:
        """The arrays the codec kernels take, in their order."""
        return self.order, self.lfirst, self.sbefore, self.sup

    def ranks(self, positions: np.ndarray, old_bits: np.ndarray) -> np.ndarray:
        """(class, index)-order position of each of the increasing ``positions`` (base bits there:
        ``old_bits``)."""
        out, found = np.empty(positions.size, np.int64), np.empty(positions.size, np.uint16)
        bad = K.ranks(old_bits, positions, self.n, self.spec.exp_shift, self.spec.n_exponents - 1, *self.tables(),
                      out, found)
        self.found = found if bad < 0 else _NONE_FOUND
        if bad >= 0:
            raise StaleIndexError(f"position {int(positions[bad])} (entry {bad}) is out of order or range, or "
                                  f"the index does not hold its class")
        return out

    def update(self, positions: np.ndarray, old_bits: np.ndarray, new_bits: np.ndarray) -> int:
        """Move the elements whose class changed (``positions`` increasing); returns how many moved.

        Raises:
            StaleIndexError: an entry is out of order or range, or an old bit pattern's class is
                not where the index holds it; the index is then unusable (``checksum`` None).
        """
        if self.checksum is None:
            raise StaleIndexError("index was invalidated by a failed update")
        pos = np.ascontiguousarray(positions, np.int64)
        ck, found = self.checksum, self.found
        self.checksum, self.found = None, _NONE_FOUND  # until the update completed
        bad, moves = K.update(self.n, pos, np.ascontiguousarray(old_bits), np.ascontiguousarray(new_bits),
                              self.spec.exp_shift, self.spec.n_exponents - 1, *self.tables(), found)
        if bad >= 0:
            raise StaleIndexError(f"update entry {bad} (position {int(pos[bad])}) is out of order or range, "
                                  f"or its old class is not where the index holds it")
        self.checksum = updated_checksum(ck, pos, old_bits, new_bits)
        return int(moves)


class DcrIndexes:
    """Kept :class:`DcrIndex` per tensor name for one side of a refit (see the module docstring).

    Attributes:
        builds: indexes built so far (first use, after a drop, or a stale one replaced).
        moves: class moves applied by updates so far.
        failed: updates that found an index inconsistent (that index was dropped).
    """

    def __init__(self):
        self._ix: dict[str, DcrIndex] = {}
        self._lock = threading.Lock()  # worker threads (one record each) build and count
        self.builds = 0
        self.moves = 0
        self.failed = 0

    def get(self, name: str, bits: np.ndarray, spec: DtypeSpec, checksum: int) -> DcrIndex:
        """The index of ``name`` for base ``bits`` whose checksum is ``checksum``; built when
        missing or when the kept one describes other bits."""
        ix = self._ix.get(name)
        if ix is None or ix.checksum != checksum or ix.n != bits.size or ix.spec != spec:
            ix = DcrIndex.build(bits, spec, checksum)
            with self._lock:
                self._ix[name] = ix
                self.builds += 1
        return ix

    def kept(self, name: str, n: int, spec: DtypeSpec, checksum: int) -> DcrIndex | None:
        """The kept index of ``name`` when it describes ``n`` elements of ``spec`` whose checksum is
        ``checksum`` (usable without the base bits), else None."""
        ix = self._ix.get(name)
        return ix if ix is not None and ix.checksum == checksum and ix.n == n and ix.spec == spec else None

    def update(self, deltas: Iterable[SparseDelta], threads: int = 1) -> None:
        """Apply committed deltas (``old_bits`` set, one per tensor) to the indexes held; unknown
        names are skipped.  ``threads``: worker threads over the tensors (``dcr.threads``).

        Never raises for an inconsistent index: that index is dropped (rebuilt on next use) and
        counted in :attr:`failed`, since the version it follows is already committed.
        """
        def one(d: SparseDelta) -> int | None:
            try:
                return self._ix[d.name].update(d.positions, d.old_bits, d.new_bits)
            except StaleIndexError:
                return None

        held = [d for d in deltas if d.nnz and d.name in self._ix]
        if len({d.name for d in held}) < len(held):
            threads = 1  # two deltas of one tensor: in their order, on one thread
        for d, moved in zip(held, map_records(one, held, threads, lambda d: d.nnz)):
            if moved is None:
                del self._ix[d.name]
                self.failed += 1
            else:
                self.moves += moved

    def drop(self, names: Iterable[str] | None = None) -> None:
        """Forget the indexes of ``names`` (all when None): their tensors were overwritten."""
        if names is None:
            self._ix.clear()
        for n in names or ():
            self._ix.pop(n, None)

    def keep_current(self, checksums: Mapping[str, int]) -> None:
        """Forget the indexes of the named tensors whose bits are no longer the ones described
        (``checksums``: their checksums now); the others stay usable."""
        for n, ck in checksums.items():
            if n in self._ix and self._ix[n].checksum != ck:
                del self._ix[n]

    def __contains__(self, name: str) -> bool:
        return name in self._ix

    def __len__(self) -> int:
        return len(self._ix)

    @property
    def nbytes(self) -> int:
        """Bytes held by all indexes."""
        return sum(ix.nbytes for ix in self._ix.values())


class MovedIndexes:
    """The kept :class:`DcrIndexes` of one side of a refit, moved by each committed version on a
    thread of their own (:class:`~nemo_dcr.kernels.workers.Behind`), so the commit returns first.

    :attr:`current` waits for the move in flight, so the next encode, decode, build or drop sees
    the indexes moved; an error the move ended with is raised there, once (the numba kernels
    release the GIL: the move runs beside whatever the caller does next).

    Args:
        thread: the move's thread name.
    """

    def __init__(self, thread: str):
        self._indexes = DcrIndexes()
        self._moving = Behind(thread)

    @property
    def current(self) -> DcrIndexes:
        """The indexes, once the last :meth:`move` is done."""
        self._moving.wait()
        return self._indexes

    def move(self, deltas: Iterable[SparseDelta], threads: int = 1) -> None:
        """Start moving the indexes by a committed version's ``deltas`` (``old_bits`` set;
        ``threads``: worker threads over the tensors, ``dcr.threads``)."""
        indexes = self.current
        self._moving.start(lambda: indexes.update(deltas, threads))
