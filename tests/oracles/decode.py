"""Vectorized ``dcr`` decoder (docs/wire_format.md section 4.4) over a backend of :mod:`.xp`.

The group table is parsed on the host (a few bytes per group); every Rice code of the record
is then decoded at once on the backend's device, and positions and new bits are rebuilt with
whole-array operations.  Every rule of section 4.4 is checked; nothing is written.
"""

from __future__ import annotations

import numpy as np

from nemo_dcr.types import DtypeSpec
from . import bitio
from nemo_dcr.codec.errors import MalformedRecordError
from .index import DecoderIndexNp
from .rice import seg_sum, set_rice_k
from .table import read_group, read_groups
from .xp import NumpyOps

_LIMIT = 1 << 62  # every valid Rice value is below this (gaps < numel < 2**62, steps < 2**32)


def _plan(n, size, n_neg, n_nz, k_val, lit, k_item):
    """Per Rice-coded item in stream order: group, type (0 ranks, 1 signs or a literal group's
    values, 2 magnitudes set, 3 extras), count coded, k, and whether a set is coded by its
    complement."""
    G = n.size
    cnt = np.stack([n, n_neg, n_nz, n_nz], 1)
    uni = np.stack([size, n, n, n], 1)
    trivial = (cnt == 0) | (cnt == uni)
    comp = ~trivial & (2 * cnt > uni)
    comp[:, 3] = False  # extras are a plain list of n_nz values
    coded = np.where(comp, uni - cnt, cnt)
    k = set_rice_k(coded.ravel(), uni.ravel()).reshape(G, 4)
    k[:, 3] = k_val
    present = ~trivial
    present[:, 3] = n_nz > 0
    present &= (n > 0)[:, None]
    lg = lit & (n > 0)  # literal groups: ranks, then n literal values as item 1
    present[lg, 1], coded[lg, 1], k[lg, 1], comp[lg, 1] = True, n[lg], k_item[lg], False
    gi, ti = np.nonzero(present)
    return gi, ti, coded[gi, ti], k[gi, ti], comp[gi, ti], cnt, uni


def _rice_values(ops, reader, counts, ks, name):
    """All Rice values of the record (int64, stream order), validated."""
    q_len, r_len = reader.varint(), reader.varint()
    data = bytes(reader.rest())
    if (q_len + r_len + 7) // 8 != len(data):
        raise MalformedRecordError(f"bit streams of {q_len}+{r_len} bits do not fill {len(data)} bytes", name)
    bits = ops.unpack(data)
    if ops.any(bits[q_len + r_len :] != 0):
        raise MalformedRecordError("non-zero padding after the bit streams", name)
    total = int(counts.sum())
    ends = ops.nonzero(bits[:q_len])
    if ends.shape[0] != total or (total and int(ends[-1]) != q_len - 1) or (not total and q_len):
        raise MalformedRecordError(f"unary stream holds {ends.shape[0]} codes in {q_len} bits, expected {total}", name)
    if r_len != int((counts * ks).sum()):
        raise MalformedRecordError("remainder stream length does not match the group table", name)
    q = ends - ops.cat([ends[:1] * 0 - 1, ends[:-1]]) - 1
    kv = ops.repeat(ops.dev(ks), ops.dev(counts), total)
    if total and ops.any((q >> ops.clamp0(62 - kv)) != 0):
        raise MalformedRecordError("Rice quotient overflows 64 bits", name)
    r = ops.zeros(total)
    if r_len:
        vi = ops.repeat(ops.arange(total), kv, r_len)
        j = ops.arange(r_len) - (ops.cumsum(kv) - kv)[vi]
        r = seg_sum(ops, ops.i64(bits[q_len : q_len + r_len]) << (kv[vi] - 1 - j), kv)
    v = (q << kv) | r
    if ops.any((v < 0) | (v >= _LIMIT)):
        raise MalformedRecordError("Rice value beyond 2**62", name)
    return v


def _members(ops, vals, gi, coded, comp, cnt, uni, name, what):
    """Members (local index, group) of each group's subset, sorted by (group, index)."""
    ids = ops.repeat(ops.dev(gi), ops.dev(coded), int(coded.sum()))
    u = ops.dev(uni)[ids]
    if ops.any(vals >= u):
        raise MalformedRecordError(f"{what}: gap beyond its set", name)
    cs = ops.cumsum(vals + 1)
    item_start = ops.dev(np.cumsum(coded) - coded)
    iid = ops.repeat(ops.arange(gi.size), ops.dev(coded), int(coded.sum()))
    base = ops.cat([ops.zeros(1), cs])[item_start][iid]
    ranks = cs - base - 1
    if ops.any(ranks >= u):
        raise MalformedRecordError(f"{what}: rank beyond its set", name)
    full = np.flatnonzero((cnt == uni) & (cnt > 0))
    cg = gi[comp]
    direct = ops.nonzero(ops.dev(~comp)[iid])
    locs, gids = [ranks[direct]], [ids[direct]]
    for groups, drop in ((full, None), (cg, ops.dev(comp)[iid])):
        if groups.size == 0:
            continue
        usz = uni[groups]
        off = np.cumsum(usz) - usz
        mark = ops.ones_bool(int(usz.sum()))
        if drop is not None:
            offmap = np.zeros(cnt.size, np.int64)
            offmap[groups] = off
            sel = ops.nonzero(drop)
            mark[ops.dev(offmap)[ids[sel]] + ranks[sel]] = False
        nm = ops.nonzero(mark)
        ci = ops.searchsorted(ops.dev(off), nm, right=True) - 1
        locs.append(nm - ops.dev(off)[ci])
        gids.append(ops.dev(groups)[ci])
    loc, gid = ops.cat(locs), ops.cat(gids)
    perm = ops.argsort_stable(gid)
    return loc[perm], gid[perm]


def decode_body(ops, body, base, spec: DtypeSpec, name: str, make_index):
    """Positions (int64, increasing) and new bits (unsigned, int64) of a ``dcr`` record."""
    reader = bitio.ByteReader(body, name)
    lo, widths = read_groups(reader, spec, name)
    index = make_index(base, spec)
    first = np.concatenate([[0], np.cumsum(np.asarray(index.hist, np.int64))])
    starts = first[lo + np.concatenate([[0], np.cumsum(widths)]).astype(np.int64)]
    sizes = np.diff(starts)
    grps = [read_group(reader, int(sizes[g]), g, spec, name) for g in range(len(widths))]
    n, n_neg, m_off, n_nz, k_val, e_ref, k_item = (np.array([getattr(x, a) for x in grps], np.int64) for a in
                                                   ("n", "n_neg", "m_off", "n_nz", "k_val", "e_ref", "k_item"))
    lit = np.array([x.lit for x in grps], bool)
    gi, ti, coded, ks, comp, cnt, uni = _plan(n, sizes, n_neg, n_nz, k_val, lit, k_item)
    vals = _rice_values(ops, reader, coded, ks, name)
    item_of = np.repeat(np.where(lit[gi] & (ti == 1), 4, ti), coded)  # 4: literal values
    parts = {}
    for t, what in ((0, "positions"), (1, "signs"), (2, "magnitudes")):
        sel = (ti == t) & ~(lit[gi] & (ti == 1))
        v = vals[ops.dev(np.flatnonzero(item_of == t))]
        parts[t] = _members(ops, v, gi[sel], coded[sel], comp[sel], cnt[:, t], uni[:, t], name, what)
    extra = vals[ops.dev(np.flatnonzero(item_of == 3))]
    literal = (vals[ops.dev(np.flatnonzero(item_of == 4))], lit, e_ref)
    return _rebuild(ops, base, spec, index, starts, n, m_off, parts, extra, literal, name)


def literal_new(ops, v, e_ref, old, spec: DtypeSpec, name: str):
    """New bits of literal changes from their Rice values (int64; wire_format.md 4.4).

    ``v = zigzag(e_new - e_ref) << (mb + 1) | sign << mb | mantissa`` with ``mb`` mantissa bits;
    the exponent must fit its field and the new bits must differ from ``old``
    [MalformedRecordError].
    """
    mb = spec.exp_shift
    zz = v >> (mb + 1)
    e = e_ref + ((zz >> 1) ^ -(zz & 1))
    if ops.any((e < 0) | (e >= spec.n_exponents)):
        raise MalformedRecordError("literal exponent outside its field", name)
    new = (((v >> mb) & 1) << (spec.bits - 1)) | (e << mb) | (v & ((1 << mb) - 1))
    if ops.any(new == old):
        raise MalformedRecordError("literal equals the old bits (not a change)", name)
    return new


def _rebuild(ops, base, spec, index, starts, n, m_off, parts, extra, literal, name):
    rank, g = parts[0]
    positions = index.select(ops.dev(starts)[g] + rank)
    seg = ops.dev(np.cumsum(n) - n)
    m = ops.dev(m_off)[g]
    nz_loc, nz_g = parts[2]
    nz = seg[nz_g] + nz_loc
    if extra.shape[0] and ops.any(extra + m[nz] + 2 >= (1 << spec.bits)):
        raise MalformedRecordError(f"step beyond the {spec.bits}-bit key space", name)
    mag = m + 0
    mag[nz] += extra + 1
    d = mag + 1
    neg_loc, neg_g = parts[1]
    d[seg[neg_g] + neg_loc] *= -1
    old = ops.unsigned(base[positions], spec.bits)
    new = apply_steps(old, d, spec)
    lit_vals, lit, e_ref = literal
    if lit.any():
        ls = ops.nonzero(ops.dev(lit)[g])
        new[ls] = literal_new(ops, lit_vals, ops.dev(e_ref)[g[ls]], old[ls], spec, name)
    perm = ops.argsort_stable(positions)
    return positions[perm], new[perm]


def apply_steps(old, d, spec: DtypeSpec):
    """Inverse of the encoder's signed steps on unsigned int64 bits."""
    ones, sign = (1 << spec.bits) - 1, spec.sign_mask
    neg_old = (old & sign) != 0
    key = old ^ (neg_old * ones) | (~neg_old * sign)
    s = d - 2 * d * neg_old
    k = (key + s) & ones
    neg_new = (k & sign) == 0
    return k ^ (neg_new * ones) ^ (~neg_new * sign)


def decode_dcr_np(body, base_bits: np.ndarray, spec: DtypeSpec, name: str) -> tuple[np.ndarray, np.ndarray]:
    """Positions (int64, increasing) and new bits of a ``dcr`` record; validates, writes nothing.

    Vectorized over groups : one blocked pass over the base, then
    whole-array work proportional to the changes.
    """

    pos, new = decode_body(NumpyOps(), body, base_bits, spec, name, DecoderIndexNp)
    return pos, new.astype(spec.uint)
