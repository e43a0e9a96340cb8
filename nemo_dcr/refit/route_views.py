"""Trainer-to-trainer routing coded as compactly as the payload: each sender's *view* of a tensor.

Trainer rank ``r`` captures part of canonical tensor ``T``: its *view* of ``T``, the canonical
elements of ``T`` it captures in canonical order (view index ``j = 0..n-1``, a
:class:`~nemo_dcr.apply.placement.Runs` map like an engine shard's).  When ``r`` does not own
``T``, both ``r`` and the owner keep that view: its bits in view order (what ``r``'s capture
baseline holds there) and its kept ``dcr`` class index (:class:`~nemo_dcr.codec.DcrIndex`).

* At attach ``r`` sends the view itself (a ``VIEW`` entry: its runs and bits, section 7.5), which
  both sides index once.
* Each refit ``r`` sends the view's changes as a ``dcr`` record body (section 4.4) coded against
  the view's bits with the kept index (a ``DCR`` entry): cost follows the changes, bytes per
  change are the payload's.  The owner decodes them against its copy of the view and hands
  canonical changes (:meth:`Runs.view_to_canon`) to its mirror.
* Both sides stage the changes and move their views only when the refit committed
  (:meth:`Router.end`), exactly when ``r``'s capture baseline moves, so the two copies stay
  equal.  Every entry names the checksums of the view before and after it: a disagreement is
  refused, never decoded into wrong bits.

Memory: per element of a routed view, its bits and index on each side (2 + 2.28 bytes for bf16).
Changes of the tensors a rank owns itself never leave it.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import numpy as np

from nemo_dcr.apply.placement import Runs
from nemo_dcr.codec import DcrIndex, DeltaFormatError
from nemo_dcr.codec.dcr import StaleIndexError, decode_dcr, encode_dcr
from nemo_dcr.kernels.workers import Behind
from nemo_dcr.types import DTYPES, DtypeSpec, SparseDelta
from nemo_dcr.verify.checksum import updated_checksum

from .group import TrainerGroup
from .routing import Coding, PackEntry, RoutingPackError, by_owner, merge, pack, unpack

_RUNS = struct.Struct("<Q")


@dataclass
class View:
    """One rank's view of one tensor, as both the sender and the owner keep it.

    Attributes:
        runs: canonical flat index -> view index (``local`` is the view index of each run).
        bits: the view's bits in view order.
        index: the kept ``dcr`` class index of :attr:`bits`.
        staged: changes ``(view positions, old bits, new bits)`` of the refit in flight.
    """

    runs: Runs
    bits: np.ndarray
    index: DcrIndex
    staged: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    @classmethod
    def build(cls, runs: Runs, bits: np.ndarray, spec: DtypeSpec) -> "View":
        """A view of ``bits`` (view order) at ``runs``, indexed now (one pass)."""
        bits = np.ascontiguousarray(bits)
        return cls(runs, bits, DcrIndex.build(bits, spec))

    @property
    def checksum(self) -> int:
        """Checksum of :attr:`bits` in view index space (section 5)."""
        return self.index.checksum

    def end(self, committed: bool) -> Callable[[], None] | None:
        """Write the staged changes' bits (``committed``) or drop them; returns the move of
        :attr:`index` by them, for the caller to run (:meth:`Router.end` runs it on a thread), or None."""
        staged, self.staged = self.staged, None
        if staged is None or not committed:
            return None
        j, old, new = staged
        self.bits[j] = new
        return lambda: self._move(j, old, new)

    def _move(self, j: np.ndarray, old: np.ndarray, new: np.ndarray) -> None:
        try:
            self.index.update(j, old, new)
        except StaleIndexError:  # never expected: rebuild from the bits, which are right
            self.index = DcrIndex.build(self.bits, self.index.spec)


def view_runs(positions: np.ndarray) -> Runs:
    """The view of strictly increasing canonical ``positions`` (view index = place in the list)."""
    return Runs.from_pairs(positions, np.arange(positions.size, dtype=np.int64))


def view_body(view: View, spec: DtypeSpec) -> bytes:
    """A ``VIEW`` entry's body: run count, run starts, run lengths, then the bits (section 7.5)."""
    le = spec.uint.newbyteorder("<")
    return (_RUNS.pack(view.runs.canon.size) + np.ascontiguousarray(view.runs.canon, "<i8").tobytes()
            + np.ascontiguousarray(view.runs.length, "<i8").tobytes() + np.ascontiguousarray(view.bits, le).tobytes())


def parse_view(entry: PackEntry, spec: DtypeSpec, numel: int, where: str) -> View:
    """The view a ``VIEW`` entry carries, checked against rule 24a.

    Raises:
        RoutingPackError: a body of the wrong size, runs that are empty, out of order,
            overlapping or outside ``[0, numel)``, a count that is not their total, bits that do
            not match the entry's target checksum.
    """
    body = entry.body
    if len(body) < _RUNS.size:
        raise RoutingPackError(f"{where}: a view body of {len(body)} bytes has no run count")
    (n,) = _RUNS.unpack_from(body)
    need = _RUNS.size + 16 * n + entry.count * spec.width
    if len(body) != need:
        raise RoutingPackError(f"{where}: a view of {n} runs and {entry.count} elements takes {need} bytes, "
                               f"the body has {len(body)}")
    canon = np.frombuffer(body, "<i8", n, _RUNS.size).astype(np.int64)
    length = np.frombuffer(body, "<i8", n, _RUNS.size + 8 * n).astype(np.int64)
    ends = canon + length
    if n and (length.min() <= 0 or length.max() > numel or canon.min() < 0 or canon.max() >= numel
              or ends[-1] > numel or bool((canon[1:] < ends[:-1]).any())):
        raise RoutingPackError(f"{where}: view runs must be non-empty, increasing, disjoint and inside [0, {numel})")
    if int(length.sum()) != entry.count or entry.base != 0:
        raise RoutingPackError(f"{where}: runs of {int(length.sum())} elements for a count of {entry.count}, "
                               f"base {entry.base:#x} (must be 0)")
    bits = np.frombuffer(body, spec.uint.newbyteorder("<"), entry.count, _RUNS.size + 16 * n).astype(spec.uint)
    view = View.build(Runs(canon, np.cumsum(length) - length, length), bits, spec)
    if view.checksum != entry.target:
        raise RoutingPackError(f"{where}: view bits have checksum {view.checksum:016x}, the entry says "
                               f"{entry.target:016x}")
    return view


@dataclass(frozen=True)
class RouteBytes:
    """Routing pack bytes of one route on this rank.

    Attributes:
        to_others: bytes put on the trainer group for other trainer ranks.
        to_other_hosts: the part of them addressed to ranks on another host.
    """

    to_others: int = 0
    to_other_hosts: int = 0


class Router:
    """This rank's side of the routing: views it sends and views it receives (module docstring).

    Args:
        group: the trainer ranks.
        owners: canonical name -> owning rank.
        canonical: every canonical tensor, name -> (wire dtype, shape).
        key: HMAC key of the packs (None: unauthenticated, as the payloads).
        hosts: host of each trainer-group rank (None: unknown, nothing counts as another host).
    """

    def __init__(self, group: TrainerGroup, owners: Mapping[str, int],
                 canonical: Mapping[str, tuple[str, tuple[int, ...]]], key: bytes | None = None,
                 hosts: Sequence[str] | None = None):
        self.group, self.owners, self.key = group, dict(owners), key
        self.meta = dict(canonical)
        self.names = sorted(self.meta)
        self._index = {n: i for i, n in enumerate(self.names)}
        self.hosts = None if hosts is None else tuple(hosts)
        self.outgoing: dict[str, View] = {}
        """Views of the tensors this rank captures but does not own."""
        self.incoming: dict[tuple[str, int], View] = {}
        """``(owned tensor, sender rank)`` -> that sender's view."""
        self.sent = RouteBytes()
        """Bytes of the last :meth:`route`."""
        self._moving = Behind("nemo-dcr-route-views")  # the last end's index moves

    def route(self, pieces: Sequence[SparseDelta], attach: bool = False) -> list[SparseDelta]:
        """Send each canonical piece to its owner; return the merged changes of the tensors this
        rank owns (collective).  ``attach``: ``pieces`` are every captured element, sent as views.

        Raises:
            ValueError: a change outside the view this rank sent at attach, or an element captured twice.
            RoutingPackError: a pack received breaks section 7.5.
        """
        me = self.group.rank
        self.wait()
        for view in self._views():  # a route whose refit never ended (it raised) committed nothing
            view.end(False)
        if attach:
            self.outgoing, self.incoming = {}, {}
        buckets = by_owner(pieces, self.owners, self.group.size)
        out = [b"" if r == me or not ds else self._pack(ds, r, attach) for r, ds in enumerate(buckets)]
        blobs = self.group.exchange(out)
        far = [r != me and self.hosts is not None and self.hosts[r] != self.hosts[me] for r in range(len(out))]
        self.sent = RouteBytes(sum(len(b) for r, b in enumerate(out) if r != me),
                               sum(len(b) for r, b in enumerate(out) if far[r]))
        received = [d for r, blob in enumerate(blobs) if r != me and len(blob) for d in self._receive(blob, r)]
        return merge(buckets[me] + received)

    def end(self, committed: bool) -> None:
        """The refit of the last :meth:`route` ended: move every view by its staged changes
        (``committed``, the capture baseline moves too) or drop them.  The bits move now; the
        kept indexes on a thread of its own (the numba kernels release the GIL), which the next
        :meth:`route` (or :meth:`wait`) waits for, so the refit's report goes out first."""
        self.wait()
        moves = [m for m in (view.end(committed) for view in self._views()) if m is not None]
        if moves:
            self._moving.start(lambda: [move() for move in moves])

    def wait(self) -> None:
        """Wait until the views' kept indexes are moved by the last :meth:`end`."""
        self._moving.wait()

    def _views(self):
        return list(self.outgoing.values()) + list(self.incoming.values())

    # -- sender ---------------------------------------------------------------------------------

    def _pack(self, deltas: Sequence[SparseDelta], owner: int, attach: bool) -> bytes:
        entries = []
        for d in merge(deltas):
            spec = DTYPES[d.dtype]
            if attach:
                view = self.outgoing[d.name] = View.build(view_runs(d.positions), d.new_bits.copy(), spec)
                entries.append(PackEntry(self._index[d.name], Coding.VIEW, d.nnz, 0, view.checksum,
                                         view_body(view, spec)))
            elif d.nnz:
                entries += self._changes(d, spec)
        return pack(entries, self.group.rank, owner, self.key) if entries else b""

    def _changes(self, d: SparseDelta, spec: DtypeSpec) -> list[PackEntry]:
        """The ``DCR`` entry of one tensor's changes (none when nothing differs from the view)."""
        view = self.outgoing.get(d.name)
        if view is None:
            raise ValueError(f"{d.name}: changes captured by trainer rank {self.group.rank}, which sent no view of "
                             "it at attach")
        held, j, _ = view.runs.select(d.positions)
        if not held.all():
            raise ValueError(f"{d.name}: canonical element {int(d.positions[~held][0])} changed on trainer rank "
                             f"{self.group.rank} outside the view it captured at attach")
        old = view.bits[j]
        keep = old != d.new_bits
        j, old, new = j[keep], old[keep], np.ascontiguousarray(d.new_bits[keep])
        if not j.size:
            return []
        body = encode_dcr(view.bits, j, new, spec, view.index, old)
        view.staged = (j, old, new)
        return [PackEntry(self._index[d.name], Coding.DCR, int(j.size), view.checksum,
                          updated_checksum(view.checksum, j, old, new), body)]

    # -- owner ----------------------------------------------------------------------------------

    def _receive(self, blob: bytes, sender: int) -> list[SparseDelta]:
        """Canonical changes of one pack; views are installed or staged only once all of it is valid."""
        me = self.group.rank
        out, views, staged = [], {}, []
        for i, e in enumerate(unpack(blob, sender, me, self.key, len(self.names))):
            name = self.names[e.tensor]
            where = f"routing pack from trainer rank {sender}, entry {i} ({name})"
            if self.owners[name] != me:
                raise RoutingPackError(f"{where}: owned by trainer rank {self.owners[name]}, not by rank {me}")
            dtype, shape = self.meta[name]
            spec, numel = DTYPES[dtype], math.prod(shape)
            if e.coding is Coding.VIEW:
                view = views[(name, sender)] = parse_view(e, spec, numel, where)
                out.append(SparseDelta(name, dtype, shape, view.runs.expand()[0], view.bits))
                continue
            view = self.incoming.get((name, sender))
            j, old, new = self._decode(e, view, spec, name, where)
            staged.append((view, (j, old, new)))
            out.append(SparseDelta(name, dtype, shape, view.runs.view_to_canon(j), new, old))
        self.incoming.update(views)
        for view, changes in staged:
            view.staged = changes
        return out

    @staticmethod
    def _decode(e: PackEntry, view: View | None, spec: DtypeSpec, name: str, where: str):
        """``(view positions, old bits, new bits)`` of a ``DCR`` entry, checked against rule 24b."""
        if view is None:
            raise RoutingPackError(f"{where}: changes of a view this rank was never sent (no attach)")
        if e.base != view.checksum:
            raise RoutingPackError(f"{where}: coded against view bits with checksum {e.base:016x}, this rank "
                                   f"holds {view.checksum:016x}")
        try:
            j, new, old = decode_dcr(e.body, view.bits, spec, name, view.index, with_old=True)
        except (DeltaFormatError, StaleIndexError) as exc:
            raise RoutingPackError(f"{where}: {exc}") from None
        if j.size != e.count or updated_checksum(e.base, j, old, new) != e.target:
            raise RoutingPackError(f"{where}: decoded {j.size} changes for a count of {e.count}, or the view's "
                                   f"checksum after them is not the entry's target {e.target:016x}")
        return j, old, new
