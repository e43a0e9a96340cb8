"""The straightforward group-by-group ``dcr`` coder: the second, independent implementation the
byte-identity tests and benchmarks compare the vectorized coder (:mod:`.encode`, :mod:`.decode`)
against.  The decoder validates everything and writes nothing."""

from __future__ import annotations

import numpy as np

from nemo_dcr.types import DtypeSpec
from . import bitio
from nemo_dcr.codec.errors import MalformedRecordError
from .decode import literal_new
from .encode import literal_choice, zigzag
from .groups import GroupIndex, choose_groups, set_rice_k
from .keys import apply_signed_steps, signed_steps
from .table import Group, read_group, read_groups
from .xp import NumpyOps


class _Writer:
    """Collects the class table bytes and the Rice-coded quotient/remainder bit streams."""

    def __init__(self):
        self.table = bytearray()
        self.q, self.r = [], []

    def rice(self, values: np.ndarray, k: int) -> None:
        self.q.append(bitio.unary_bits(values >> np.uint64(k)))
        self.r.append(bitio.fixed_bits(values, k))

    def coded_set(self, ranks: np.ndarray, size: int) -> None:
        """The minority side of a subset of ``range(size)`` given as sorted ``ranks``."""
        n = ranks.size
        if n == 0 or n == size:
            return
        if 2 * n > size:
            keep = np.ones(size, dtype=bool)
            keep[ranks] = False
            ranks = np.flatnonzero(keep)
        self.rice((np.diff(ranks, prepend=-1) - 1).astype(np.uint64), set_rice_k(ranks.size, size))

    def finish(self) -> bytes:
        q = np.concatenate(self.q) if self.q else np.zeros(0, np.uint8)
        r = np.concatenate(self.r) if self.r else np.zeros(0, np.uint8)
        bitio.write_varint(self.table, int(q.size))
        bitio.write_varint(self.table, int(r.size))
        return bytes(self.table) + np.packbits(np.concatenate([q, r])).tobytes()


def _bits(w: _Writer) -> int:
    return sum(int(q.size) for q in w.q) + sum(int(r.size) for r in w.r)


def _encode_group(w: _Writer, ranks: np.ndarray, size: int, d: np.ndarray, new: np.ndarray, spec: DtypeSpec) -> None:

    n = ranks.size
    bitio.write_varint(w.table, n)
    if n == 0:
        return
    neg = np.flatnonzero(d < 0)
    mag = np.abs(d) - 1
    m_off = int(mag.min())
    nz = np.flatnonzero(mag > m_off)
    k_val = bitio.best_rice_k((mag[nz] - m_off - 1).astype(np.uint64))[0] if nz.size else 0
    steps = _Writer()
    steps.coded_set(neg, n)
    steps.coded_set(nz, n)
    if nz.size:
        steps.rice((mag[nz] - m_off - 1).astype(np.uint64), k_val)
    mb = spec.exp_shift
    new = new.astype(np.int64) & ((1 << spec.bits) - 1)
    e_new = (new >> mb) & ((1 << spec.exp_bits) - 1)
    e_ref = int(np.argmax(np.bincount(e_new, minlength=spec.n_exponents)))
    zz = zigzag(e_new - e_ref).astype(np.uint64)
    k_lit = bitio.best_rice_k(zz)[0]
    lit_v = (zz << np.uint64(mb + 1)) | ((new >> (spec.bits - 1)) << mb).astype(np.uint64) | (new & ((1 << mb) - 1)).astype(np.uint64)
    literal = _Writer()
    literal.rice(lit_v, k_lit + mb + 1)
    one = lambda v: np.array([v], np.int64)  # noqa: E731
    w.coded_set(ranks, size)
    if literal_choice(one(n), one(neg.size), one(m_off), one(nz.size), one(_bits(steps)), one(_bits(literal)),
                      one(e_ref), one(k_lit))[0]:
        for v in (n + 1, e_ref, k_lit):
            bitio.write_varint(w.table, v)
        w.q += literal.q
        w.r += literal.r
        return
    for v in (neg.size, m_off, nz.size):
        bitio.write_varint(w.table, v)
    if nz.size:
        w.table.append(k_val)
    w.q += steps.q
    w.r += steps.r


def encode_dcr_per_group(base_bits: np.ndarray, positions: np.ndarray, new_bits: np.ndarray, spec: DtypeSpec) -> bytes:
    """The straightforward group-by-group encoder (reference for tests and benchmarks)."""
    lo, widths = choose_groups(spec.exponent(base_bits[positions]), spec.n_exponents)
    index = GroupIndex.build(base_bits, spec, lo, widths)
    mask = np.zeros(base_bits.size, dtype=bool)
    mask[positions] = True
    changed_sorted = mask[index.order]
    w = _Writer()
    for v in (lo, len(widths), *widths):
        bitio.write_varint(w.table, v)
    for g in range(len(widths)):
        ranks = np.flatnonzero(changed_sorted[index.starts[g] : index.starts[g + 1]])
        pos_g = index.members(g)[ranks]
        sel = np.searchsorted(positions, pos_g)
        _encode_group(w, ranks, index.size(g), signed_steps(base_bits[pos_g], new_bits[sel], spec), new_bits[sel], spec)
    return w.finish()


def _rice_plan(groups: list[Group]):
    """(count, k) of every Rice-coded list, in stream order, as the encoder wrote them."""

    plan = []
    for grp in groups:
        if grp.n == 0:
            continue
        if grp.lit:
            if grp.n < grp.size:
                coded = min(grp.n, grp.size - grp.n)
                plan.append((coded, set_rice_k(coded, grp.size)))
            plan.append((grp.n, grp.k_item))
            continue
        for count, size in ((grp.n, grp.size), (grp.n_neg, grp.n), (grp.n_nz, grp.n)):
            if 0 < count < size:
                coded = min(count, size - count)
                plan.append((coded, set_rice_k(coded, size)))
        if grp.n_nz:
            plan.append((grp.n_nz, grp.k_val))
    return plan


def _decode_rice(reader: bitio.ByteReader, plan, name: str) -> list[np.ndarray]:
    q_len, r_len = reader.varint(), reader.varint()
    data = reader.rest()
    if (q_len + r_len + 7) // 8 != len(data):
        raise MalformedRecordError(f"bit streams of {q_len}+{r_len} bits do not fill {len(data)} bytes", name)
    bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8))
    if bits[q_len + r_len :].any():
        raise MalformedRecordError("non-zero padding after the bit streams", name)
    q = bitio.read_unary(bits[:q_len], sum(c for c, _ in plan), name)
    if r_len != sum(c * k for c, k in plan):
        raise MalformedRecordError("remainder stream length does not match the group table", name)
    out, qi, ri = [], 0, q_len
    for count, k in plan:
        qs = q[qi : qi + count]
        if k and count and int(qs.max()) >> (64 - k):
            raise MalformedRecordError("Rice quotient overflows 64 bits", name)
        out.append((qs << np.uint64(k)) | bitio.read_fixed(bits[ri : ri + count * k], count, k))
        qi, ri = qi + count, ri + count * k
    return out


def _subset(lists: list, count: int, size: int, name: str, what: str) -> np.ndarray:
    """Sorted ranks of a coded set (reads one Rice list when the set is not trivial)."""
    if count == 0:
        return np.zeros(0, np.int64)
    if count == size:
        return np.arange(size, dtype=np.int64)
    gaps = lists.pop(0)
    if gaps.size and int(gaps.max()) >= size:
        raise MalformedRecordError(f"{what}: gap beyond {size} elements", name)
    ranks = np.cumsum(gaps.astype(np.int64) + 1) - 1
    if ranks.size and ranks[-1] >= size:
        raise MalformedRecordError(f"{what}: rank {int(ranks[-1])} beyond {size} elements", name)
    if 2 * count <= size:
        return ranks
    keep = np.ones(size, dtype=bool)
    keep[ranks] = False
    return np.flatnonzero(keep)


def _group_steps(lists: list, grp: Group, spec: DtypeSpec, name: str) -> np.ndarray:
    neg = _subset(lists, grp.n_neg, grp.n, name, "signs")
    nz = _subset(lists, grp.n_nz, grp.n, name, "magnitudes")
    mag = np.full(grp.n, grp.m_off, dtype=np.uint64)
    if grp.n_nz:
        extra = lists.pop(0)
        if int(extra.max()) + grp.m_off + 2 >= (1 << spec.bits):
            raise MalformedRecordError(f"step beyond the {spec.bits}-bit key space", name)
        mag[nz] += extra + np.uint64(1)
    d = mag.astype(np.int64) + 1
    d[neg] = -d[neg]
    return d


def decode_dcr_per_group(body, base_bits: np.ndarray, spec: DtypeSpec, name: str) -> tuple[np.ndarray, np.ndarray]:
    """The straightforward group-by-group decoder (reference for tests and benchmarks)."""

    reader = bitio.ByteReader(body, name)
    lo, widths = read_groups(reader, spec, name)
    index = GroupIndex.build(base_bits, spec, lo, widths)
    groups = [read_group(reader, index.size(g), g, spec, name) for g in range(len(widths))]
    lists = _decode_rice(reader, _rice_plan(groups), name)
    pos_parts, new_parts = [], []
    for g, grp in enumerate(groups):
        if grp.n == 0:
            continue
        ranks = _subset(lists, grp.n, grp.size, name, f"group {g} positions")
        pos_g = index.members(g)[ranks]
        pos_parts.append(pos_g)
        if grp.lit:
            old = base_bits[pos_g].astype(np.int64) & ((1 << spec.bits) - 1)
            v = lists.pop(0).astype(np.int64)
            new_parts.append(literal_new(NumpyOps(), v, grp.e_ref, old, spec, name).astype(spec.uint))
            continue
        new_parts.append(apply_signed_steps(base_bits[pos_g], _group_steps(lists, grp, spec, name), spec))
    if not pos_parts:
        return np.zeros(0, np.int64), np.zeros(0, spec.uint)
    positions, new_bits = np.concatenate(pos_parts), np.concatenate(new_parts)
    perm = np.argsort(positions, kind="stable")
    return positions[perm].astype(np.int64), new_bits[perm]
