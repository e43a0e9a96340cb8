"""Which trainer rank encodes which engine tensor, and how sparse changes travel to it.

Every engine tensor has one *owner* trainer rank (:func:`assign_owners`: greedy balance by
size, deterministic on every rank).  After remapping, each trainer rank sends the canonical
changes of tensor ``t`` to ``owner(t)``; the owner merges the pieces from all ranks
(:func:`merge`) and encodes them against its mirror.  Messages are :func:`pack`-ed as a JSON
head plus raw little-endian arrays (no pickle, docs/wire_format.md section 7.5), so cost is
proportional to the changes; :func:`unpack` refuses a malformed pack with a
:class:`RoutingPackError` naming what is wrong.
"""

from __future__ import annotations

import heapq
import json
import struct
from collections import defaultdict
from typing import Iterable, Mapping, Sequence

import numpy as np

from nemo_dcr.types import DTYPES, SparseDelta

_LEN = struct.Struct("<Q")
_ENTRY_KEYS = ("name", "dtype", "shape", "nnz", "old")


class RoutingPackError(ValueError):
    """A routing pack that breaks docs/wire_format.md section 7.5 (the message names what)."""


def assign_owners(sizes: Mapping[str, int], world: int) -> dict[str, int]:
    """Owner rank of every tensor: largest first onto the least-loaded rank (ties: lower rank).

    A heap of ``(load, rank)`` pops exactly the rank ``min(range(world), key=(load, rank))``
    would pick, in O(log world) per tensor (70k tensors on 1024 ranks in well under a second).
    """
    heap = [(0, r) for r in range(world)]
    owners = {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        load, rank = heapq.heappop(heap)
        owners[name] = rank
        heapq.heappush(heap, (load + sizes[name], rank))
    return owners


def by_owner(deltas: Iterable[SparseDelta], owners: Mapping[str, int], world: int) -> list[list[SparseDelta]]:
    """Bucket canonical deltas by the rank that owns their tensor."""
    out: list[list[SparseDelta]] = [[] for _ in range(world)]
    for d in deltas:
        out[owners[d.name]].append(d)
    return out


def pack(deltas: Sequence[SparseDelta]) -> bytes:
    """Serialize canonical deltas (positions, new bits, old bits) without pickle."""
    head = [dict(name=d.name, dtype=d.dtype, shape=list(d.shape), nnz=d.nnz, old=d.old_bits is not None)
            for d in deltas]
    raw = json.dumps(head).encode()
    arrays = []
    for d in deltas:
        arrays += [np.ascontiguousarray(d.positions, "<i8").tobytes(), np.ascontiguousarray(d.new_bits).tobytes()]
        if d.old_bits is not None:
            arrays.append(np.ascontiguousarray(d.old_bits).tobytes())
    return _LEN.pack(len(raw)) + raw + b"".join(arrays)


def unpack(data: bytes) -> list[SparseDelta]:
    """Inverse of :func:`pack`.

    Raises:
        RoutingPackError: a short or malformed head, an entry of the wrong form, arrays beyond the
            end, bytes after the last array, or a position outside its tensor.
    """
    if len(data) < _LEN.size:
        raise RoutingPackError(f"routing pack of {len(data)} bytes is shorter than its {_LEN.size}-byte head length")
    (n,) = _LEN.unpack_from(data)
    if n > len(data) - _LEN.size:
        raise RoutingPackError(f"routing pack head of {n} bytes, but only {len(data) - _LEN.size} follow")
    try:
        head = json.loads(data[_LEN.size:_LEN.size + n])
    except (UnicodeDecodeError, ValueError) as exc:
        raise RoutingPackError(f"routing pack head is not UTF-8 JSON: {exc}") from None
    if not isinstance(head, list):
        raise RoutingPackError(f"routing pack head is a JSON {type(head).__name__}, not a list")
    off, out = _LEN.size + n, []
    for i, h in enumerate(head):
        d, off = _entry(data, off, i, h)
        out.append(d)
    if off != len(data):
        raise RoutingPackError(f"routing pack has {len(data) - off} bytes after its last array")
    return out


def _entry(data: bytes, off: int, i: int, h) -> tuple[SparseDelta, int]:
    """Entry ``i`` of a pack's head and its arrays at ``off``; returns the delta and the next offset."""
    if not isinstance(h, dict) or sorted(h) != sorted(_ENTRY_KEYS):
        got = sorted(h) if isinstance(h, dict) else type(h).__name__
        raise RoutingPackError(f"routing pack entry {i}: keys {got}, expected {sorted(_ENTRY_KEYS)}")
    name, dtype, shape, nnz, has_old = (h[k] for k in _ENTRY_KEYS)
    if not isinstance(name, str) or dtype not in DTYPES or type(has_old) is not bool:
        raise RoutingPackError(f"routing pack entry {i}: name {name!r}, dtype {dtype!r} (known: {sorted(DTYPES)}), "
                               f"old {has_old!r}")
    if not isinstance(shape, list) or not all(type(s) is int and s >= 0 for s in shape) or type(nnz) is not int \
            or nnz < 0:
        raise RoutingPackError(f"routing pack entry {i} ({name}): shape {shape!r} and nnz {nnz!r} must be "
                               "non-negative integers")
    uint = DTYPES[dtype].uint
    need = nnz * (8 + uint.itemsize * (2 if has_old else 1))
    if off + need > len(data):
        raise RoutingPackError(f"routing pack entry {i} ({name}): {need} bytes of arrays at offset {off}, "
                               f"the pack has {len(data)}")
    pos = np.frombuffer(data, "<i8", nnz, off)
    new = np.frombuffer(data, uint, nnz, off + 8 * nnz)
    old = np.frombuffer(data, uint, nnz, off + (8 + uint.itemsize) * nnz) if has_old else None
    numel = int(np.prod(shape)) if shape else 1
    if nnz and (int(pos.min()) < 0 or int(pos.max()) >= numel):
        raise RoutingPackError(f"routing pack entry {i} ({name}): positions outside [0, {numel})")
    return SparseDelta(name, dtype, tuple(shape), pos, new, old), off + need


def merge(pieces: Iterable[SparseDelta]) -> list[SparseDelta]:
    """One delta per tensor from pieces sent by several ranks, sorted by position.

    Raises:
        ValueError: two pieces carry the same element (two ranks captured it: a broken layout).
    """
    groups: dict[str, list[SparseDelta]] = defaultdict(list)
    for p in pieces:
        groups[p.name].append(p)
    out = []
    for name, ps in sorted(groups.items()):
        pos = np.concatenate([p.positions for p in ps])
        order = np.argsort(pos, kind="stable")
        pos = pos[order]
        if pos.size > 1 and bool((np.diff(pos) <= 0).any()):
            dup = int(pos[np.flatnonzero(np.diff(pos) <= 0)[0]])
            raise ValueError(f"{name}: element {dup} was captured twice (two ranks own it)")
        new = np.concatenate([p.new_bits for p in ps])[order]
        old = None if any(p.old_bits is None for p in ps) else np.concatenate([p.old_bits for p in ps])[order]
        out.append(SparseDelta(name, ps[0].dtype, ps[0].shape, pos, new, old))
    return out
