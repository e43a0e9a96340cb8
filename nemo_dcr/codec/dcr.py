"""The ``dcr`` record coding (docs/wire_format.md section 4.4).

Positions are coded per *class* (the exponent of the base element, which the receiver holds),
as Rice-coded gaps between ranks within the class, so the code length adapts to how likely each
class is to change.  Values are folded ULP steps in monotone key space, Rice-coded per class.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import bitio
from .dtypes import DtypeSpec
from .errors import MalformedRecordError
from .keys import fold_steps, unfold_steps


@dataclass(frozen=True)
class ClassIndex:
    """Elements of a base tensor grouped by class, in increasing flat order within a class.

    Attributes:
        order: flat indices sorted stably by class.
        starts: ``starts[c]`` is where class ``c`` begins in ``order`` (length n_classes + 1).
    """

    order: np.ndarray
    starts: np.ndarray

    @classmethod
    def build(cls, base_bits: np.ndarray, spec: DtypeSpec) -> "ClassIndex":
        e = spec.exponent(base_bits)
        order = np.argsort(e, kind="stable")
        counts = np.bincount(e, minlength=spec.n_exponents)
        return cls(order, np.concatenate([[0], np.cumsum(counts)]))

    def size(self, c: int) -> int:
        return int(self.starts[c + 1] - self.starts[c])

    def members(self, c: int) -> np.ndarray:
        return self.order[self.starts[c] : self.starts[c + 1]]


def _class_ranks(index: ClassIndex, c: int, changed_sorted: np.ndarray) -> np.ndarray:
    return np.flatnonzero(changed_sorted[index.starts[c] : index.starts[c + 1]])


def _gaps(ranks: np.ndarray) -> np.ndarray:
    return (np.diff(ranks, prepend=-1) - 1).astype(np.uint64)


def encode_dcr(base_bits: np.ndarray, positions: np.ndarray, new_bits: np.ndarray, spec: DtypeSpec) -> bytes:
    """Body of a ``dcr`` record for a non-empty change set."""
    index = ClassIndex.build(base_bits, spec)
    mask = np.zeros(base_bits.size, dtype=bool)
    mask[positions] = True
    changed_sorted = mask[index.order]
    classes = spec.exponent(base_bits[positions])
    lo, hi = int(classes.min()), int(classes.max())
    table = bytearray()
    bitio.write_varint(table, lo)
    bitio.write_varint(table, hi)
    streams = [[], [], [], []]  # PQ, PR, VQ, VR
    for c in range(lo, hi + 1):
        ranks = _class_ranks(index, c, changed_sorted)
        n, size = ranks.size, index.size(c)
        bitio.write_varint(table, n)
        if n == 0:
            continue
        if n < size:
            coded = ranks if 2 * n <= size else np.flatnonzero(~changed_sorted[index.starts[c] : index.starts[c + 1]])
            gaps = _gaps(coded)
            k_pos, _ = bitio.best_rice_k(gaps)
            table.append(k_pos)
            streams[0].append(bitio.unary_bits(gaps >> np.uint64(k_pos)))
            streams[1].append(bitio.fixed_bits(gaps, k_pos))
        pos_c = index.members(c)[ranks]
        sel = np.searchsorted(positions, pos_c)
        u = fold_steps(base_bits[pos_c], new_bits[sel], spec)
        k_val, _ = bitio.best_rice_k(u)
        table.append(k_val)
        streams[2].append(bitio.unary_bits(u >> np.uint64(k_val)))
        streams[3].append(bitio.fixed_bits(u, k_val))
    flat = [np.concatenate(s) if s else np.zeros(0, np.uint8) for s in streams]
    for s in flat:
        bitio.write_varint(table, int(s.size))
    return bytes(table) + np.packbits(np.concatenate(flat)).tobytes()


@dataclass
class _ClassEntry:
    c: int
    n: int
    k_pos: int | None
    k_val: int


def _read_table(reader: bitio.ByteReader, index: ClassIndex, spec: DtypeSpec, name: str) -> list[_ClassEntry]:
    lo, hi = reader.varint(), reader.varint()
    if not lo <= hi < spec.n_exponents:
        raise MalformedRecordError(f"class range [{lo}, {hi}] invalid for {spec.name}", name)
    entries = []
    for c in range(lo, hi + 1):
        n, size = reader.varint(), index.size(c)
        if n > size:
            raise MalformedRecordError(f"class {c}: {n} changes but only {size} elements", name)
        if n == 0:
            continue
        k_pos = reader.byte() if n < size else None
        k_val = reader.byte()
        if max(k_pos or 0, k_val) > bitio.MAX_K:
            raise MalformedRecordError(f"class {c}: Rice parameter over {bitio.MAX_K}", name)
        entries.append(_ClassEntry(c, n, k_pos, k_val))
    return entries


def _split_streams(reader: bitio.ByteReader, name: str) -> list[np.ndarray]:
    lengths = [reader.varint() for _ in range(4)]
    data = reader.rest()
    total = sum(lengths)
    if (total + 7) // 8 != len(data):
        raise MalformedRecordError(f"bit streams need {total} bits but body has {len(data)} bytes", name)
    bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8))
    if bits[total:].any():
        raise MalformedRecordError("non-zero padding after bit streams", name)
    cuts = np.cumsum([0] + lengths)
    return [bits[cuts[i] : cuts[i + 1]] for i in range(4)]


def _rice_decode(q_bits, r_bits, counts, ks, name):
    """Decode concatenated Rice codes of several groups (count_i values with parameter k_i)."""
    total = int(sum(counts))
    q = bitio.read_unary(q_bits, total, name)
    if r_bits.size != sum(n * k for n, k in zip(counts, ks)):
        raise MalformedRecordError("remainder stream length does not match the class table", name)
    out, qi, ri = [], 0, 0
    for n, k in zip(counts, ks):
        r = bitio.read_fixed(r_bits[ri : ri + n * k], n, k)
        if k and n and int(q[qi : qi + n].max()) >> (64 - k):
            raise MalformedRecordError("Rice quotient overflows 64 bits", name)
        out.append((q[qi : qi + n] << np.uint64(k)) | r)
        qi, ri = qi + n, ri + n * k
    return out


def decode_dcr(body, base_bits: np.ndarray, spec: DtypeSpec, name: str) -> tuple[np.ndarray, np.ndarray]:
    """Positions (int64, increasing) and new bits of a ``dcr`` record; validates, writes nothing."""
    index = ClassIndex.build(base_bits, spec)
    reader = bitio.ByteReader(body, name)
    entries = _read_table(reader, index, spec, name)
    pq, pr, vq, vr = _split_streams(reader, name)
    sparse = [e for e in entries if e.k_pos is not None]
    coded_n = [min(e.n, index.size(e.c) - e.n) for e in sparse]
    gap_groups = _rice_decode(pq, pr, coded_n, [e.k_pos for e in sparse], name)
    steps = _rice_decode(vq, vr, [e.n for e in entries], [e.k_val for e in entries], name)
    ranks_of = {e.c: _ranks_from_gaps(g, e, index, name) for e, g in zip(sparse, gap_groups)}
    pos_parts, new_parts = [], []
    for e, u in zip(entries, steps):
        members = index.members(e.c)
        pos_c = members[ranks_of[e.c]] if e.c in ranks_of else members
        if u.size and int(u.max() >> np.uint64(1)) + 1 >= (1 << spec.bits):
            raise MalformedRecordError(f"class {e.c}: step beyond the {spec.bits}-bit key space", name)
        pos_parts.append(pos_c)
        new_parts.append(unfold_steps(base_bits[pos_c], u, spec))
    positions = np.concatenate(pos_parts) if pos_parts else np.zeros(0, np.int64)
    new_bits = np.concatenate(new_parts) if new_parts else np.zeros(0, spec.uint)
    perm = np.argsort(positions, kind="stable")
    return positions[perm].astype(np.int64), new_bits[perm]


def _ranks_from_gaps(gaps: np.ndarray, e: _ClassEntry, index: ClassIndex, name: str) -> np.ndarray:
    size = index.size(e.c)
    if gaps.size and int(gaps.max()) >= size:
        raise MalformedRecordError(f"class {e.c}: gap beyond class size {size}", name)
    ranks = np.cumsum(gaps.astype(np.int64) + 1) - 1
    if ranks.size and ranks[-1] >= size:
        raise MalformedRecordError(f"class {e.c}: rank {int(ranks[-1])} beyond class size {size}", name)
    if 2 * e.n <= size:
        return ranks
    keep = np.ones(size, dtype=bool)
    keep[ranks] = False
    return np.flatnonzero(keep)
