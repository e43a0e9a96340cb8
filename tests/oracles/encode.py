"""Vectorized ``dcr`` encoder (docs/wire_format.md section 4.4) over a backend of :mod:`.xp`.

No loop runs per element or per group on arrays: groups, coded sets, Rice parameters and both
bit streams are built with whole-array operations, then packed to bytes on the backend's
device.  Only per-group counts (at most 2**exp_bits numbers) and the final body go to the host.
"""

from __future__ import annotations

import numpy as np

from nemo_dcr.types import DtypeSpec
from .groups import groups_from_counts
from .index import encoder_sorted_pos_np
from .rice import best_k, coded_set, seg_sum, varints
from .xp import NumpyOps


def signed_steps(ops, old, new, spec: DtypeSpec):
    """Magnitude-direction ULP steps (int64) from unsigned int64 old/new bits."""
    ones, sign = (1 << spec.bits) - 1, spec.sign_mask
    neg_old = (old & sign) != 0
    k_old = old ^ (neg_old * ones) | (~neg_old * sign)
    neg_new = (new & sign) != 0
    k_new = new ^ (neg_new * ones) | (~neg_new * sign)
    s = k_new - k_old
    return s - 2 * s * neg_old


def _table(lo, widths, n, n_neg, m_off, n_nz, k_val, lit, e_ref, k_lit, q_len, r_len) -> bytes:
    vals = [lo, len(widths), *widths]
    for g in range(len(widths)):
        vals.append(int(n[g]))
        if n[g] and lit[g]:
            vals += [int(n[g]) + 1, int(e_ref[g]), int(k_lit[g])]  # n_neg = n + 1 marks a literal group
        elif n[g]:
            vals += [int(n_neg[g]), int(m_off[g]), int(n_nz[g])]
            if n_nz[g]:
                vals.append(int(k_val[g]))  # k <= 63: its byte equals its varint
    return varints(vals + [q_len, r_len])


def varint_len(x: np.ndarray) -> np.ndarray:
    """Bytes of the unsigned LEB128 of each (host, int64, >= 0) value."""
    x = np.asarray(x, np.int64)
    return np.maximum(1, (np.frexp(x.astype(np.float64))[1] + 6) // 7)


def literal_choice(n, n_neg, m_off, n_nz, step_bits, lit_bits, e_ref, k_lit) -> np.ndarray:
    """Groups coded as literals: where literal bits + table bytes beat the steps' (strictly).

    ``step_bits``/``lit_bits`` (host, per group) are the bits the sign/magnitude items or the
    literal items would take in the streams; the ranks set is the same either way.
    """
    step_tab = varint_len(n_neg) + varint_len(m_off) + varint_len(n_nz) + (n_nz > 0)
    lit_tab = varint_len(n + 1) + varint_len(e_ref) + 1
    return (n > 0) & (lit_bits + 8 * lit_tab < step_bits + 8 * step_tab)


def zigzag(x):
    """0, -1, 1, -2, ... -> 0, 1, 2, 3, ... (int64)."""
    return (x << 1) ^ (x >> 63)


def _group_bits(ops, items, G: int) -> np.ndarray:
    """Per group, the stream bits of ``(values, group id, k)`` items (host int64)."""
    out = np.zeros(G, np.int64)
    for v, gid, k in items:
        if v.shape[0] == 0:
            continue
        perm = ops.argsort_stable(gid)
        out += ops.host(seg_sum(ops, ((v >> k) + 1 + k)[perm], ops.bincount(gid, G)))
    return out


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
    mb = spec.exp_shift
    e_new = (new >> mb) & mask
    e_ref = np.argmax(ops.host(ops.bincount(g * n_exp + e_new, G * n_exp)).reshape(G, n_exp), axis=1)
    zz = zigzag(e_new - ops.dev(e_ref)[g])
    k_lit = best_k(ops, zz, g, n)
    lit_v = (zz << (mb + 1)) | ((new >> (spec.bits - 1)) << mb) | (new & ((1 << mb) - 1))
    lit_k = ops.dev(k_lit + mb + 1)[g]
    sets = []
    for loc, gid, cnt, size in ((local[neg], g[neg], n_neg, n), (local[nz], g_ex, n_nz, n)):
        vals, ids, k = coded_set(ops, loc, gid, cnt, size)
        sets.append((vals, ids, ops.dev(k)[ids]))
    steps = sets + [(extra, g_ex, ops.dev(k_val)[g_ex])]
    m_off = np.where(n > 0, ops.host(m_off_dev), 0)
    lit = literal_choice(n, n_neg, m_off, n_nz, _group_bits(ops, steps, G),
                         _group_bits(ops, [(lit_v, g, lit_k)], G), e_ref, k_lit)
    vals, ids, k = coded_set(ops, rank, g, n, sizes)
    items = [(vals, ids * 4, ops.dev(k)[ids])]
    lit_dev = ops.dev(lit)
    for t, (v, gid, kk) in enumerate(steps, start=1):
        keep = ops.nonzero(~lit_dev[gid])
        items.append((v[keep], gid[keep] * 4 + t, kk[keep]))
    if lit.any():
        sel = ops.nonzero(lit_dev[g])
        items.append((lit_v[sel], g[sel] * 4 + 1, lit_k[sel]))
    q_len, r_len, packed = _streams(ops, items)
    return _table(lo, widths, n, n_neg, m_off, n_nz, k_val, lit, e_ref, k_lit, q_len, r_len) + packed


def encode_dcr_np(base_bits: np.ndarray, positions: np.ndarray, new_bits: np.ndarray, spec: DtypeSpec) -> bytes:
    """Body of a ``dcr`` record for a non-empty change set.

    Vectorized over groups : one blocked pass over the base for the
    class ranks, then whole-array work proportional to the changes.
    """

    return encode_body(NumpyOps(), base_bits, np.asarray(positions, np.int64), new_bits, spec, encoder_sorted_pos_np)
