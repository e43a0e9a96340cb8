"""Decoder of the ``dcr`` record coding: parse the whole table, decode all Rice codes at once,
then rebuild positions and new bits group by group.  Every count, rank, parameter and step is
bounds-checked before use; nothing is written."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import bitio
from .dtypes import DtypeSpec
from .errors import MalformedRecordError
from .keys import apply_signed_steps


@dataclass
class _Group:
    n: int
    size: int
    n_neg: int = 0
    m_off: int = 0
    n_nz: int = 0
    k_val: int = 0
    lit: bool = False  # literal group: new bits coded directly (n_neg = n + 1 on the wire)
    e_ref: int = 0
    k_lit: int = 0
    k_item: int = 0  # Rice k of a literal value: k_lit + mantissa bits + 1


def _read_groups(reader: bitio.ByteReader, spec: DtypeSpec, name: str):
    lo, n_groups = reader.varint(), reader.varint()
    if lo >= spec.n_exponents or not 1 <= n_groups <= spec.n_exponents:
        raise MalformedRecordError(f"group table lo={lo}, groups={n_groups} invalid for {spec.name}", name)
    widths = [reader.varint() for _ in range(n_groups)]
    if min(widths) < 1 or lo + sum(widths) > spec.n_exponents:
        raise MalformedRecordError(f"group widths {widths} from exponent {lo} exceed {spec.name}", name)
    return lo, widths


def _read_group(reader: bitio.ByteReader, size: int, g: int, spec: DtypeSpec, name: str) -> _Group:
    grp = _Group(reader.varint(), size)
    if grp.n > size:
        raise MalformedRecordError(f"group {g}: {grp.n} changes but only {size} elements", name)
    if grp.n == 0:
        return grp
    grp.n_neg = reader.varint()
    if grp.n_neg == grp.n + 1:
        grp.lit, grp.n_neg, grp.e_ref, grp.k_lit = True, 0, reader.varint(), reader.byte()
        if grp.e_ref >= spec.n_exponents:
            raise MalformedRecordError(f"group {g}: literal reference exponent {grp.e_ref} invalid for {spec.name}", name)
        if grp.k_lit + spec.exp_shift + 1 > bitio.MAX_K:
            raise MalformedRecordError(f"group {g}: literal Rice parameter {grp.k_lit} too large", name)
        grp.k_item = grp.k_lit + spec.exp_shift + 1
        return grp
    grp.m_off, grp.n_nz = reader.varint(), reader.varint()
    if grp.n_neg > grp.n or grp.n_nz > grp.n:
        raise MalformedRecordError(f"group {g}: sign/magnitude counts exceed {grp.n} changes", name)
    if grp.m_off + 1 >= (1 << spec.bits):
        raise MalformedRecordError(f"group {g}: m_off {grp.m_off} puts steps beyond the {spec.bits}-bit key space", name)
    if grp.n_nz:
        grp.k_val = reader.byte()
        if grp.k_val > bitio.MAX_K:
            raise MalformedRecordError(f"group {g}: Rice parameter {grp.k_val} over {bitio.MAX_K}", name)
    return grp


def _rice_plan(groups: list[_Group]):
    """(count, k) of every Rice-coded list, in stream order, as the encoder wrote them."""
    from .dcr import set_rice_k

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


def _group_steps(lists: list, grp: _Group, spec: DtypeSpec, name: str) -> np.ndarray:
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


def decode_dcr(body, base_bits: np.ndarray, spec: DtypeSpec, name: str) -> tuple[np.ndarray, np.ndarray]:
    """Positions (int64, increasing) and new bits of a ``dcr`` record; validates, writes nothing.

    Vectorized over groups (``nemo_dcr.kernels``): one blocked pass over the base, then
    whole-array work proportional to the changes.
    """
    from ..kernels.dcr_decode import decode_body
    from ..kernels.index import DecoderIndexNp
    from ..kernels.xp import NumpyOps

    pos, new = decode_body(NumpyOps(), body, base_bits, spec, name, DecoderIndexNp)
    return pos, new.astype(spec.uint)


def decode_dcr_per_group(body, base_bits: np.ndarray, spec: DtypeSpec, name: str) -> tuple[np.ndarray, np.ndarray]:
    """The straightforward group-by-group decoder (reference for tests and benchmarks)."""
    from ..kernels.dcr_decode import literal_new
    from ..kernels.xp import NumpyOps
    from .dcr import GroupIndex

    reader = bitio.ByteReader(body, name)
    lo, widths = _read_groups(reader, spec, name)
    index = GroupIndex.build(base_bits, spec, lo, widths)
    groups = [_read_group(reader, index.size(g), g, spec, name) for g in range(len(widths))]
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
