"""Vectorized pieces of the ``dcr`` bit streams shared by the encoder and decoder kernels:
varints, Rice parameters for whole arrays of groups, coded-set gaps, segment sums."""

from __future__ import annotations

import numpy as np

from . import bitio
from .groups import set_rice_k as _one_set_rice_k

MAX_K = bitio.MAX_K
_EXACT = 1 << 53


def varints(values) -> bytes:
    """Unsigned LEB128 of each value, concatenated."""
    if all(0 <= v < 128 for v in values):
        return bytes(values)
    out = bytearray()
    for v in values:
        bitio.write_varint(out, int(v))
    return bytes(out)


def set_rice_k(m: np.ndarray, size: np.ndarray) -> np.ndarray:
    """:func:`.groups.set_rice_k` for arrays (host int64); 0 where ``m`` is 0."""
    m, size = np.asarray(m, np.int64), np.asarray(size, np.int64)
    if size.size and int(size.max()) >= 1 << 36:  # products could leave float64's exact range
        return np.array([_one_set_rice_k(int(a), int(b)) for a, b in zip(m, size)], dtype=np.int64)
    x = (((size - m) // np.maximum(m, 1)) * 45426) >> 16
    bitlen = np.frexp(x.astype(np.float64))[1].astype(np.int64)  # exact: x < 2**53
    return np.where(m > 0, np.maximum(0, bitlen - 1), 0)


def seg_sum(ops, values, counts):
    """Sum of each contiguous segment of ``values`` (segment lengths ``counts``), exact int64."""
    cs = ops.cat([ops.zeros(1), ops.cumsum(values)])
    ends = ops.cumsum(counts)
    return cs[ends] - cs[ends - counts]


def best_k(ops, values, gid, counts_h: np.ndarray):
    """Per group, the Rice ``k`` of :func:`bitio.best_rice_k` on that group's ``values``.

    ``values`` are grouped contiguously by ``gid``; ``counts_h`` (host) are the group sizes.
    """
    G = counts_h.size
    counts = ops.dev(counts_h)
    sums = ops.host(seg_sum(ops, values, counts))
    has = counts_h > 0
    mean = sums / np.maximum(counts_h, 1)
    guess = np.clip(np.ceil(np.log2(mean + 1.0)), 0, MAX_K).astype(np.int64)
    kmin, kmax = np.maximum(0, guess - 8), np.minimum(MAX_K, guess + 1)
    costs = np.empty((10, G), np.int64)
    for j in range(10):
        kk = np.minimum(kmin + j, kmax)
        shifted = values >> ops.dev(kk)[gid]
        costs[j] = counts_h * (kk + 1) + ops.host(seg_sum(ops, shifted, counts))
    k = np.minimum(kmin + np.argmin(costs, axis=0), kmax)
    big = np.flatnonzero(has & (sums >= _EXACT))
    if big.size:  # float means could differ from numpy's pairwise mean: do those exactly as before
        ends = np.cumsum(counts_h)
        host_vals = ops.host(values).astype(np.uint64)
        for g in big:
            k[g] = bitio.best_rice_k(host_vals[ends[g] - counts_h[g] : ends[g]])[0]
    return np.where(has, k, 0)


def gaps_in_groups(ops, loc, gid):
    """Gaps ``r_j - r_{j-1} - 1`` (``r_{-1} = -1``) of sorted ranks ``loc`` within each group."""
    if loc.shape[0] == 0:
        return loc
    prev = ops.cat([loc[:1] * 0 - 1, loc[:-1]])
    new_group = ops.cat([gid[:1] * 0 + 1, gid[1:] - gid[:-1]])
    prev = prev * (new_group == 0) - 1 * (new_group != 0)
    return loc - prev - 1


def coded_set(ops, loc, gid, count_h: np.ndarray, size_h: np.ndarray):
    """Gaps of the coded side of each group's subset, their group ids and each group's ``k``.

    ``loc`` are the members' ranks (sorted within each group, groups in order), ``gid`` their
    groups, ``count_h``/``size_h`` (host) the subset and universe sizes per group.
    """
    trivial = (count_h == 0) | (count_h == size_h)
    comp = ~trivial & (2 * count_h > size_h)
    coded = np.where(comp, size_h - count_h, np.where(trivial, 0, count_h))
    k = set_rice_k(coded, size_h)
    keep = ops.nonzero(ops.dev(~trivial & ~comp)[gid])
    vals, ids = [gaps_in_groups(ops, loc[keep], gid[keep])], [gid[keep]]
    if comp.any():
        cg = np.flatnonzero(comp)
        usz = size_h[cg]
        off = np.cumsum(usz) - usz
        offmap = np.zeros(count_h.size, np.int64)
        offmap[cg] = off
        mark = ops.ones_bool(int(usz.sum()))
        sel = ops.nonzero(ops.dev(comp)[gid])
        mark[ops.dev(offmap)[gid[sel]] + loc[sel]] = False
        nm = ops.nonzero(mark)
        ci = ops.searchsorted(ops.dev(off), nm, right=True) - 1
        cgid = ops.dev(cg)[ci]
        vals.append(gaps_in_groups(ops, nm - ops.dev(off)[ci], cgid))
        ids.append(cgid)
    return ops.cat(vals), ops.cat(ids), k
