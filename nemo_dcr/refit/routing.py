"""Which trainer rank encodes which canonical tensor, and the messages that carry changes to it.

Every canonical tensor has one *owner* trainer rank.  :func:`assign_owners` picks, for each
tensor (largest first), among the ranks that capture the largest share of it the least-loaded
one, so the fewest changes leave the rank that captured them and the encoding stays balanced;
the shares come from :func:`gather_captured` (one exchange when the refit is built, which also
tells every rank each member's host).  After remapping, each trainer rank sends the canonical
changes of tensor ``t`` to ``owner(t)`` as a :func:`pack` (docs/wire_format.md section 7.5): a
fixed head, one table row per tensor and the bodies, coded by :mod:`.route_views` (the ``dcr``
coder over the sender's view of the tensor), with an HMAC when the refit has a key.
:func:`unpack` refuses a malformed pack with a :class:`RoutingPackError` naming what is wrong;
:func:`merge` joins the pieces of one tensor from several ranks, refusing an element captured twice.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import json
import socket
import struct
from collections import defaultdict
from dataclasses import dataclass
from enum import IntEnum
from typing import Iterable, Mapping, Sequence

import numpy as np

from nemo_dcr.kernels.cpu import merge_sorted
from nemo_dcr.types import SparseDelta

from .group import TrainerGroup

MAGIC = b"NDCP"
FORMAT_VERSION = 2
FLAG_MAC = 1
MAC_BYTES = 32
HEAD = struct.Struct("<4sBBiiI")  # magic, format version, flags, sender, receiver, entries
ENTRY = struct.Struct("<IBQQQQ")  # tensor, coding, count, body bytes, base checksum, target checksum


class RoutingPackError(ValueError):
    """A routing pack that breaks docs/wire_format.md section 7.5 (the message names what)."""


class Coding(IntEnum):
    """How a pack entry's body is coded (section 7.5)."""

    VIEW = 1
    """The sender's view of the tensor: its runs and the bits of every element in it (attach)."""
    DCR = 2
    """Changes of the view as a ``dcr`` record body (section 4.4) against the view's bits."""


@dataclass(frozen=True)
class PackEntry:
    """One row of a pack's table and its body.

    Attributes:
        tensor: index of the canonical tensor among the sorted canonical names.
        coding: how :attr:`body` is coded.
        count: elements of the view (``VIEW``) or changed elements (``DCR``).
        base: checksum of the view bits the body is coded against (``DCR``; 0 for ``VIEW``).
        target: checksum of the view bits after the entry.
        body: the coded bytes.
    """

    tensor: int
    coding: Coding
    count: int
    base: int
    target: int
    body: bytes | memoryview


def _mac(key: bytes, data) -> bytes:
    return hmac.new(key, data, hashlib.sha256).digest()


def pack(entries: Sequence[PackEntry], sender: int, receiver: int, key: bytes | None) -> bytes:
    """The routing pack from trainer-group rank ``sender`` to ``receiver`` (section 7.5)."""
    flags = FLAG_MAC if key is not None else 0
    parts = [HEAD.pack(MAGIC, FORMAT_VERSION, flags, sender, receiver, len(entries))]
    parts += [ENTRY.pack(e.tensor, int(e.coding), e.count, len(e.body), e.base, e.target) for e in entries]
    parts += [bytes(e.body) for e in entries]
    data = b"".join(parts)
    return data + _mac(key, data) if key is not None else data


def unpack(data: bytes, sender: int, receiver: int, key: bytes | None, tensors: int) -> list[PackEntry]:
    """The entries of a pack that trainer-group rank ``sender`` sent to ``receiver``.

    Args:
        data: the pack.
        sender, receiver: the ranks it travelled between (the head must name them).
        key: the refit's HMAC key (None: the pack must carry no MAC).
        tensors: number of canonical tensors (tensor indices must lie below it).

    Raises:
        RoutingPackError: a short pack, another magic or format version, unknown flags, a MAC
            that is missing, unexpected or wrong, other ranks than the ones it travelled
            between, a table or body past the end, bytes after the last body, an unknown coding,
            a tensor index out of range or a tensor twice (rule 24).
    """
    data = memoryview(data)
    where = f"routing pack from trainer rank {sender}"
    if len(data) < HEAD.size:
        raise RoutingPackError(f"{where}: {len(data)} bytes, shorter than its {HEAD.size}-byte head")
    magic, version, flags, src, dst, n = HEAD.unpack_from(data)
    if magic != MAGIC:
        raise RoutingPackError(f"{where}: magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise RoutingPackError(f"{where}: format version {version}, this reader reads {FORMAT_VERSION}")
    if flags & ~FLAG_MAC or bool(flags & FLAG_MAC) != (key is not None):
        raise RoutingPackError(f"{where}: flags {flags:#x}, expected {FLAG_MAC if key is not None else 0:#x} "
                               f"({'a MAC: the refit has a key' if key is not None else 'no MAC: no key'})")
    end = len(data) - (MAC_BYTES if key is not None else 0)
    if end < HEAD.size:
        raise RoutingPackError(f"{where}: {len(data)} bytes, too short for its head and MAC")
    if key is not None and not hmac.compare_digest(_mac(key, data[:end]), bytes(data[end:])):
        raise RoutingPackError(f"{where}: MAC does not match (wrong key or altered pack)")
    if (src, dst) != (sender, receiver):
        raise RoutingPackError(f"{where} to {receiver}: the head names sender {src} and receiver {dst}")
    return _entries(data, end, n, tensors, where)


def _entries(data: memoryview, end: int, n: int, tensors: int, where: str) -> list[PackEntry]:
    """The ``n`` table rows after the head and their bodies, which must end exactly at ``end``."""
    off = HEAD.size + n * ENTRY.size
    if off > end:
        raise RoutingPackError(f"{where}: a table of {n} entries needs {off} bytes, the pack has {end}")
    out, seen = [], set()
    for i in range(n):
        t, coding, count, length, base, target = ENTRY.unpack_from(data, HEAD.size + i * ENTRY.size)
        if t >= tensors or t in seen:
            raise RoutingPackError(f"{where}, entry {i}: tensor {t} " +
                                   ("twice" if t in seen else f"outside the {tensors} canonical tensors"))
        if coding not in tuple(Coding):
            raise RoutingPackError(f"{where}, entry {i}: coding {coding}, known {[int(c) for c in Coding]}")
        if length > end - off:
            raise RoutingPackError(f"{where}, entry {i}: body of {length} bytes at offset {off}, the pack "
                                   f"ends at {end}")
        seen.add(t)
        out.append(PackEntry(t, Coding(coding), count, base, target, data[off:off + length]))
        off += length
    if off != end:
        raise RoutingPackError(f"{where}: {end - off} bytes after the last body")
    return out


# -- owners ---------------------------------------------------------------------------------------

def assign_owners(sizes: Mapping[str, int], world: int,
                  shares: Mapping[str, Mapping[int, int]] | None = None) -> dict[str, int]:
    """Owner rank of every tensor (identical on every rank for identical arguments).

    Tensors are taken largest first (ties: by name).  A tensor with ``shares`` (rank -> elements
    of it that rank captures) goes to the least-loaded of the ranks capturing the largest share,
    so the fewest of its changes are routed; one without goes to the least-loaded rank.  Ties of
    load go to the lower rank.  A heap of ``(load, rank)`` serves the second case in
    O(log world) per tensor (70k tensors on 1024 ranks in well under a second).
    """
    load = [0] * world
    heap = [(0, r) for r in range(world)]
    owners = {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        held = {r: c for r, c in (shares or {}).get(name, {}).items() if c > 0}
        if held:
            top = max(held.values())
            rank = min((r for r, c in held.items() if c == top), key=lambda r: (load[r], r))
        else:
            while heap[0][0] != load[heap[0][1]]:  # an entry left behind by a shares pick
                heapq.heappop(heap)
            rank = heapq.heappop(heap)[1]
        owners[name] = rank
        load[rank] += sizes[name]
        heapq.heappush(heap, (load[rank], rank))
    return owners


@dataclass(frozen=True)
class Members:
    """What every trainer rank learned about the others when the refit was built.

    Attributes:
        hosts: host name of each trainer-group rank.
        shares: canonical name -> {rank: elements of it that rank captures}.
    """

    hosts: tuple[str, ...]
    shares: dict[str, dict[int, int]]


def gather_captured(group: TrainerGroup, captured: Mapping[str, int], names: Sequence[str]) -> Members:
    """Every rank's host and captured counts (collective; section 7.5, rule 24c).

    Each rank sends every other the JSON object ``{"host": str, "captured": [[tensor index,
    elements], ...]}`` (tensor indices into the sorted ``names``, elements > 0).

    Raises:
        RoutingPackError: a member's message is not of that form (names the member).
    """
    index = {n: i for i, n in enumerate(names)}
    mine = json.dumps({"host": socket.gethostname(),
                       "captured": [[index[n], int(c)] for n, c in sorted(captured.items()) if c > 0]}).encode()
    hosts, shares = [], defaultdict(dict)
    for r, blob in enumerate(group.exchange([mine] * group.size)):
        try:
            msg = json.loads(blob)
            ok = isinstance(msg, dict) and sorted(msg) == ["captured", "host"] and isinstance(msg["host"], str) \
                and all(isinstance(p, list) and len(p) == 2 and all(type(x) is int for x in p)
                        and 0 <= p[0] < len(names) and p[1] > 0 for p in msg["captured"])
        except (UnicodeDecodeError, ValueError, TypeError):
            ok = False
        if not ok:
            raise RoutingPackError(f"captured counts of trainer rank {r}: not {{'host': str, 'captured': "
                                   f"[[tensor index < {len(names)}, elements > 0], ...]}}: {bytes(blob[:80])!r}")
        hosts.append(msg["host"])
        for t, c in msg["captured"]:
            shares[names[t]][r] = c
    return Members(tuple(hosts), dict(shares))


def by_owner(deltas: Iterable[SparseDelta], owners: Mapping[str, int], world: int) -> list[list[SparseDelta]]:
    """Bucket canonical deltas by the rank that owns their tensor."""
    out: list[list[SparseDelta]] = [[] for _ in range(world)]
    for d in deltas:
        out[owners[d.name]].append(d)
    return out


def _increasing(pos: np.ndarray) -> bool:
    return pos.size < 2 or bool((pos[1:] > pos[:-1]).all())


_MERGE_WAYS = 16
"""Pieces of one tensor up to which :func:`merge` takes their next entries in one pass (more: a sort)."""


def _first(p: SparseDelta) -> int:
    return int(p.positions[0]) if p.nnz else -1


def _in_range_order(ps: Sequence[SparseDelta]) -> list[SparseDelta] | None:
    """Increasing pieces ``ps`` sorted by their first position when their ranges are disjoint (a
    row-sliced tensor's: their concatenation is then their merge), else None."""
    by_start = sorted(ps, key=_first)
    held = [p for p in by_start if p.nnz]
    if all(int(a.positions[-1]) < int(b.positions[0]) for a, b in zip(held, held[1:])):
        return by_start
    return None


def merge(pieces: Iterable[SparseDelta]) -> list[SparseDelta]:
    """One delta per tensor from pieces sent by several ranks, sorted by position (increasing
    pieces, as capture and routing make them: one merge pass, no sort; pieces of disjoint ranges,
    a row-sliced tensor's, are concatenated in range order, with no merge pass).

    Raises:
        ValueError: two pieces carry the same element (two ranks captured it: a broken layout).
    """
    groups: dict[str, list[SparseDelta]] = defaultdict(list)
    for p in pieces:
        groups[p.name].append(p)
    out = []
    for name, ps in sorted(groups.items()):
        ordered = all(_increasing(p.positions) for p in ps)
        if len(ps) == 1 and ordered:
            out.append(ps[0])  # one piece already in order: no copy (the first sync's pieces are the model)
            continue
        with_old = all(p.old_bits is not None for p in ps)
        in_order = _in_range_order(ps) if ordered else None
        if in_order is not None:  # disjoint ranges: their concatenation in range order is the merge
            ps = in_order
        pos = np.concatenate([p.positions for p in ps]).astype(np.int64, copy=False)
        new = np.concatenate([p.new_bits for p in ps])
        old = np.concatenate([p.old_bits for p in ps]) if with_old else new[:0]
        if in_order is None and ordered and len(ps) <= _MERGE_WAYS:
            offsets = np.cumsum([0] + [p.positions.size for p in ps], dtype=np.int64)
            dup, merged, new, old = merge_sorted(pos, new, old, offsets, with_old)
            if dup >= 0:
                raise ValueError(f"{name}: element {int(pos[dup])} was captured twice (two ranks own it)")
            pos = merged
        elif in_order is None:
            order = np.argsort(pos, kind="stable")
            pos, new, old = pos[order], new[order], old[order] if with_old else old
            if pos.size > 1 and bool((np.diff(pos) <= 0).any()):
                dup = int(pos[np.flatnonzero(np.diff(pos) <= 0)[0]])
                raise ValueError(f"{name}: element {dup} was captured twice (two ranks own it)")
        out.append(SparseDelta(name, ps[0].dtype, ps[0].shape, pos, new, old if with_old else None))
    return out
