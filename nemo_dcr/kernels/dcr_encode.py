"""Vectorized ``dcr`` encoder (docs/wire_format.md section 4.4) over a backend of :mod:`.xp`.

No loop runs per element or per group on arrays: groups, coded sets, Rice parameters and both
bit streams are built with whole-array operations, then packed to bytes on the backend's
device.  Only per-group counts (at most 2**exp_bits numbers) and the final body go to the host.
"""

from __future__ import annotations

import numpy as np

from ..codec.dcr import groups_from_counts
from ..codec.dtypes import DtypeSpec
from .rice import best_k, coded_set, varints


def signed_steps(ops, old, new, spec: DtypeSpec):
    """Magnitude-direction ULP steps (int64) from unsigned int64 old/new bits."""
    ones, sign = (1 << spec.bits) - 1, spec.sign_mask
    neg_old = (old & sign) != 0
    k_old = old ^ (neg_old * ones) | (~neg_old * sign)
    neg_new = (new & sign) != 0
    k_new = new ^ (neg_new * ones) | (~neg_new * sign)
    s = k_new - k_old
    return s - 2 * s * neg_old


def _table(lo, widths, n, n_neg, m_off, n_nz, k_val, q_len, r_len) -> bytes:
    vals = [lo, len(widths), *widths]
    for g in range(len(widths)):
        vals.append(int(n[g]))
        if n[g]:
            vals += [int(n_neg[g]), int(m_off[g]), int(n_nz[g])]
            if n_nz[g]:
                vals.append(int(k_val[g]))  # k <= 63: its byte equals its varint
    return varints(vals + [q_len, r_len])


def _streams(ops, items) -> tuple[int, int, bytes]:
    """Interleave ``(values, key, k)`` items by key, write Q (unary) and R (fixed) bits, pack."""
    v = ops.cat([i[0] for i in items])
    key = ops.cat([i[1] for i in items])
    kk = ops.cat([i[2] for i in items])
    perm = ops.argsort_stable(key)
    v, kk = v[perm], kk[perm]
    q1 = (v >> kk) + 1
    ends = ops.cumsum(q1)
    q_len = int(ends[-1]) if v.shape[0] else 0
    r_len = int(kk.sum()) if v.shape[0] else 0
    bits = ops.zeros(q_len + r_len, "u8")
    if q_len:
        bits[ends - 1] = 1
    if r_len:
        vi = ops.repeat(ops.arange(v.shape[0]), kk, r_len)
        j = ops.arange(r_len) - (ops.cumsum(kk) - kk)[vi]
        bits[q_len:] = ops.u8((v[vi] >> (kk[vi] - 1 - j)) & 1)
    return q_len, r_len, ops.pack(bits)


def encode_body(ops, base, positions, new_bits, spec: DtypeSpec, sorted_pos) -> bytes:
    """Body of a ``dcr`` record for a non-empty change set (``sorted_pos`` from :mod:`.index`)."""
    n_exp, mask = spec.n_exponents, (1 << spec.exp_bits) - 1
    old = ops.unsigned(base[positions], spec.bits)
    new = ops.unsigned(new_bits, spec.bits)
    cls = (old >> spec.exp_shift) & mask
    lo, widths = groups_from_counts(ops.host(ops.bincount(cls, n_exp)))
    G = len(widths)
    hist, s = sorted_pos(base, positions, spec)
    hist = np.asarray(ops.host(hist), np.int64)
    first = np.concatenate([[0], np.cumsum(hist)])
    bounds = lo + np.concatenate([[0], np.cumsum(widths)]).astype(np.int64)
    starts = first[bounds]
    sizes = np.diff(starts)
    perm = ops.argsort_stable(ops.u8(cls))  # (class, index) order = (group, rank) order
    cls, s, old, new = cls[perm], s[perm], old[perm], new[perm]
    g = ops.searchsorted(ops.dev(bounds), cls, right=True) - 1
    rank = s - ops.dev(starts)[g]
    d = signed_steps(ops, old, new, spec)
    n_dev = ops.bincount(g, G)
    n = ops.host(n_dev)
    local = ops.arange(g.shape[0]) - (ops.cumsum(n_dev) - n_dev)[g]
    mag = abs(d) - 1
    m_off_dev = ops.seg_min(mag, g, None, G)
    nz = ops.nonzero(mag > m_off_dev[g])
    neg = ops.nonzero(d < 0)
    n_neg, n_nz = ops.host(ops.bincount(g[neg], G)), ops.host(ops.bincount(g[nz], G))
    g_ex = g[nz]
    extra = mag[nz] - m_off_dev[g_ex] - 1
    k_val = best_k(ops, extra, g_ex, n_nz)
    items = []
    for t, (loc, gid, cnt, size) in enumerate(((rank, g, n, sizes), (local[neg], g[neg], n_neg, n),
                                               (local[nz], g_ex, n_nz, n))):
        vals, ids, k = coded_set(ops, loc, gid, cnt, size)
        items.append((vals, ids * 4 + t, ops.dev(k)[ids]))
    items.append((extra, g_ex * 4 + 3, ops.dev(k_val)[g_ex]))
    q_len, r_len, packed = _streams(ops, items)
    m_off = np.where(n > 0, ops.host(m_off_dev), 0)
    return _table(lo, widths, n, n_neg, m_off, n_nz, k_val, q_len, r_len) + packed
