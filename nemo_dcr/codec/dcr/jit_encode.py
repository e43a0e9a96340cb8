"""Compiled ``dcr`` encoder (docs/wire_format.md section 4.4), byte-identical to the oracles of
the tests (tests/oracles: a vectorized numpy coder and a group-by-group one).

Input: the changes in position order with their (class, index)-order positions ``s`` (from a
kept :class:`~nemo_dcr.codec.dcr.class_index.DcrIndex` or :func:`onepass_ranks`) and the class
histogram.  Work is proportional to the changes: a counting sort by class, per-group statistics
(pass A, which also fixes the table and both stream lengths), then the streams (pass B).
"""

from __future__ import annotations

import numpy as np

from ...kernels.jit import njit
from .jit_bits import best_k, close_streams, put_bitmap, put_code, put_varint, set_rice_k, signed_step, varint_len, writer

# a group closes once it holds this many changes (measured: merging exponents costs more than the table saves)
MIN_GROUP_CHANGES = 1
# per-group statistics, columns of ``st``
N, NNEG, MOFF, NNZ, KVAL, EREF, KLIT, LIT, QB, RB = range(10)


@njit
def onepass_ranks(bits, positions, shift, emask, out):
    """Class histogram and, in ``out``, each change's (class, index)-order position, in one pass
    over ``bits`` (four counter tables break the store-to-load chains).  Returns
    ``(hist, bad)``: ``bad`` the first entry out of order or range, else -1."""
    E = emask + 1
    t = np.zeros((4, E), np.int64)
    i, n = 0, bits.size
    for j in range(positions.size):
        p = positions[j]
        if p < i or p >= n:
            return t[0], j
        while i + 4 <= p:
            for u in range(4):
                t[u, (np.int64(bits[i + u]) >> shift) & emask] += 1
            i += 4
        while i < p:
            t[0, (np.int64(bits[i]) >> shift) & emask] += 1
            i += 1
        c = (np.int64(bits[p]) >> shift) & emask
        out[j] = t[0, c] + t[1, c] + t[2, c] + t[3, c]
        t[0, c] += 1
        i = p + 1
    while i < n:
        t[0, (np.int64(bits[i]) >> shift) & emask] += 1
        i += 1
    hist = t[0] + t[1] + t[2] + t[3]
    first = np.cumsum(hist) - hist
    for j in range(positions.size):
        out[j] += first[(np.int64(bits[positions[j]]) >> shift) & emask]
    return hist, -1


@njit
def _groups(ccount, min_group):
    """Greedy groups: from the lowest class holding a change, a group closes once it holds
    ``min_group`` changes; a short tail joins the last group.  ``(lo, widths)``."""
    nz = np.flatnonzero(ccount)
    lo, hi = nz[0], nz[-1]
    widths = np.zeros(hi - lo + 1, np.int64)
    g, acc, width = 0, 0, 0
    for e in range(lo, hi + 1):
        acc += ccount[e]
        width += 1
        if acc >= min_group:
            widths[g] = width
            g, acc, width = g + 1, 0, 0
    if width:
        if g:
            widths[g - 1] += width
        else:
            widths[0] = width
            g = 1
    return lo, widths[:g]


@njit(inline=True)
def _set_bits(flags, gs, n, emit, w, out, rbuf):
    """Q and R bits of the coded set ``{x < n : flags[gs + x]}``, and the writer (its codes written
    when ``emit``): ``(q, r, w)``."""
    c = 0
    for x in range(n):
        c += flags[gs + x]
    if c == 0 or c == n:
        return 0, 0, w
    side = 2 * c <= n  # members coded, else non-members
    coded = c if side else n - c
    k = set_rice_k(coded, n)
    if k == 0:  # the codes are the membership bits up to the last coded element
        last = n - 1
        while flags[gs + last] != side:
            last -= 1
        if emit:
            w = put_bitmap(flags, gs, last + 1, side, w, out)
        return last + 1, 0, w
    q, prev = 0, -1
    for x in range(n):
        if flags[gs + x] == side:
            q += ((x - prev - 1) >> k) + 1
            if emit:
                w = put_code(x - prev - 1, k, w, out, rbuf)
            prev = x
    return q, coded * k, w


@njit(inline=True)
def _rank_bits(rank, gs, n, size, emit, w, out, rbuf):
    """Q and R bits of the coded set of changed ranks ``rank[gs:gs + n]`` among ``size``, and the
    writer: ``(q, r, w)``."""
    if n == 0 or n == size:
        return 0, 0, w
    side = 2 * n <= size
    coded = n if side else size - n
    k = set_rice_k(coded, size)
    q, prev = 0, -1
    if side:
        for i in range(gs, gs + n):
            q += ((rank[i] - prev - 1) >> k) + 1
            if emit:
                w = put_code(rank[i] - prev - 1, k, w, out, rbuf)
            prev = rank[i]
        return q, coded * k, w
    j = gs
    for x in range(size):
        if j < gs + n and rank[j] == x:
            j += 1
            continue
        q += ((x - prev - 1) >> k) + 1
        if emit:
            w = put_code(x - prev - 1, k, w, out, rbuf)
        prev = x
    return q, coded * k, w


@njit(inline=True)
def _values_bits(vals, flags, gs, n, k, emit, w, out, rbuf):
    """Q bits of ``vals[gs + x]`` (``x < n``) where ``flags[gs + x]`` (every ``x`` when ``flags`` is
    empty), and the writer: ``(q, w)``."""
    q = 0
    for x in range(n):
        if flags.size == 0 or flags[gs + x]:
            q += (vals[gs + x] >> k) + 1
            if emit:
                w = put_code(vals[gs + x], k, w, out, rbuf)
    return q, w


@njit
def _steps(dd, gs, n, negf, nzf, extra):
    """Sign and magnitude fields of one group: ``(n_neg, m_off, n_nz, k_val)``; flags and extras
    (zero where the flag is off) filled in place."""
    m_off = abs(dd[gs]) - 1
    for i in range(gs, gs + n):
        m_off = min(m_off, abs(dd[i]) - 1)
    n_neg, n_nz = 0, 0
    for i in range(gs, gs + n):
        negf[i] = dd[i] < 0
        n_neg += negf[i]
        nzf[i] = abs(dd[i]) - 1 > m_off
        extra[i] = abs(dd[i]) - 2 - m_off if nzf[i] else 0
        n_nz += nzf[i]
    return n_neg, m_off, n_nz, best_k(extra, gs, gs + n, n_nz)


@njit
def _literals(nw, gs, n, litv, ehist, mb, nbits):
    """Literal fields of one group: ``(e_ref, k_lit)``; the literal values into ``litv`` (first
    their zigzag exponent offsets, which fix ``k_lit``)."""
    emask = ehist.size - 1
    ehist[:] = 0
    for i in range(gs, gs + n):
        ehist[(nw[i] >> mb) & emask] += 1
    e_ref = np.argmax(ehist)
    for i in range(gs, gs + n):
        x = ((nw[i] >> mb) & emask) - e_ref
        litv[i] = (x << 1) ^ (x >> 63)
    k_lit = best_k(litv, gs, gs + n, n)
    for i in range(gs, gs + n):
        litv[i] = (litv[i] << (mb + 1)) | ((nw[i] >> (nbits - 1)) << mb) | (nw[i] & ((1 << mb) - 1))
    return e_ref, k_lit


@njit
def _group_stats(g, gs, n, size, rank, dd, nw, work, stats, mb, nbits):
    """Pass A for group ``g`` (changes ``gs .. gs + n`` in rank order): every table field, the
    steps-or-literals choice and the group's Q and R bits."""
    negf, nzf, extra, litv, ehist, none = work
    w, out, rbuf = writer(0), np.zeros(0, np.uint8), np.zeros(0, np.uint8)  # nothing is written here
    n_neg, m_off, n_nz, k_val = _steps(dd, gs, n, negf, nzf, extra)
    q1, r1, w = _set_bits(negf, gs, n, False, w, out, rbuf)
    q2, r2, w = _set_bits(nzf, gs, n, False, w, out, rbuf)
    q3, w = _values_bits(extra, nzf, gs, n, k_val, False, w, out, rbuf)
    step = q1 + r1 + q2 + r2 + q3 + n_nz * k_val + 8 * (varint_len(n_neg) + varint_len(m_off) + varint_len(n_nz)
                                                        + (n_nz > 0))
    e_ref, k_lit, ql, lit = 0, 0, 0, False
    kl = mb + 1
    if n * (mb + 2) + 8 * (varint_len(n + 1) + 2) < step:  # literals could be smaller: cost them exactly
        e_ref, k_lit = _literals(nw, gs, n, litv, ehist, mb, nbits)
        kl += k_lit
        ql, w = _values_bits(litv, none, gs, n, kl, False, w, out, rbuf)
        lit = ql + n * kl + 8 * (varint_len(n + 1) + varint_len(e_ref) + 1) < step
    qr, rr, w = _rank_bits(rank, gs, n, size, False, w, out, rbuf)
    qb = qr + (ql if lit else q1 + q2 + q3)
    rb = rr + (n * kl if lit else r1 + r2 + n_nz * k_val)
    stats[g, N], stats[g, NNEG], stats[g, MOFF], stats[g, NNZ], stats[g, KVAL] = n, n_neg, m_off, n_nz, k_val
    stats[g, EREF], stats[g, KLIT], stats[g, LIT], stats[g, QB], stats[g, RB] = e_ref, k_lit, lit, qb, rb


@njit
def _table(lo, widths, stats, q_len, r_len):
    """The group table and both stream lengths as bytes."""
    G = widths.size
    buf = np.zeros(10 * (6 * G + 6), np.uint8)
    at = put_varint(buf, 0, lo)
    at = put_varint(buf, at, G)
    for g in range(G):
        at = put_varint(buf, at, widths[g])
    for g in range(G):
        n = stats[g, N]
        at = put_varint(buf, at, n)
        if n and stats[g, LIT]:
            for v in (n + 1, stats[g, EREF], stats[g, KLIT]):
                at = put_varint(buf, at, v)
        elif n:
            for v in (stats[g, NNEG], stats[g, MOFF], stats[g, NNZ]):
                at = put_varint(buf, at, v)
            if stats[g, NNZ]:
                at = put_varint(buf, at, stats[g, KVAL])
    at = put_varint(buf, at, q_len)
    at = put_varint(buf, at, r_len)
    return buf[:at]


@njit
def _sorted_changes(old_bits, new_bits, s, nbits, mb, emask):
    """Changes in (class, index) order: class counts, global class-order position, step, new bits,
    and the first change whose step is zero (new bits equal to the old; -1: none)."""
    m, zero = old_bits.size, -1
    ones, sign = (1 << nbits) - 1, 1 << (nbits - 1)
    ccount = np.zeros(emask + 1, np.int64)
    for i in range(m):
        ccount[((np.int64(old_bits[i]) & ones) >> mb) & emask] += 1
    nxt = np.cumsum(ccount) - ccount
    srt, dd, nw = np.empty(m, np.int64), np.empty(m, np.int64), np.empty(m, np.int64)
    for i in range(m):
        old = np.int64(old_bits[i]) & ones
        c = (old >> mb) & emask
        j = nxt[c]
        nxt[c] += 1
        nw[j] = np.int64(new_bits[i]) & ones
        dd[j] = signed_step(old, nw[j], ones, sign)
        if dd[j] == 0 and zero < 0:
            zero = i
        srt[j] = s[i]
    return ccount, srt, dd, nw, zero


@njit
def _emit(G, gstart, sizes, rank, stats, work, out, qoff, rbuf, mb):
    """Pass B: every group's items, in stream order; returns the writer."""
    negf, nzf, extra, litv, ehist, none = work
    w = writer(qoff)
    for g in range(G):
        gs, n = gstart[g], stats[g, N]
        if n == 0:
            continue
        _, _, w = _rank_bits(rank, gs, n, sizes[g], True, w, out, rbuf)
        if stats[g, LIT]:
            _, w = _values_bits(litv, none, gs, n, stats[g, KLIT] + mb + 1, True, w, out, rbuf)
            continue
        _, _, w = _set_bits(negf, gs, n, True, w, out, rbuf)
        _, _, w = _set_bits(nzf, gs, n, True, w, out, rbuf)
        _, w = _values_bits(extra, nzf, gs, n, stats[g, KVAL], True, w, out, rbuf)
    return w


@njit
def encode_kernel(old_bits, new_bits, s, hist, nbits, mb, exp_bits, min_group):
    """Body of a ``dcr`` record as uint8 from the changes' old and new bits and class-order
    positions ``s``; empty (no body is) when a change keeps its old bits: a zero step has no code."""
    m, emask = old_bits.size, (1 << exp_bits) - 1
    ccount, rank, dd, nw, zero = _sorted_changes(old_bits, new_bits, s, nbits, mb, emask)
    if zero >= 0:
        return np.zeros(0, np.uint8)
    lo, widths = _groups(ccount, min_group)
    G = widths.size
    bounds = np.zeros(G + 1, np.int64)
    bounds[0] = lo
    bounds[1:] = lo + np.cumsum(widths)
    first = np.zeros(hist.size + 1, np.int64)
    first[1:] = np.cumsum(hist)
    cfirst = np.zeros(ccount.size + 1, np.int64)
    cfirst[1:] = np.cumsum(ccount)
    starts, gstart = first[bounds], cfirst[bounds]
    sizes = starts[1:] - starts[:-1]
    for g in range(G):
        rank[gstart[g] : gstart[g + 1]] -= starts[g]
    stats = np.zeros((G, 10), np.int64)
    # every entry of these is written for its group before it is read (literals: once costed)
    work = (np.empty(m, np.bool_), np.empty(m, np.bool_), np.empty(m, np.int64), np.empty(m, np.int64),
            np.zeros(emask + 1, np.int64), np.zeros(0, np.bool_))
    for g in range(G):
        _group_stats(g, gstart[g], gstart[g + 1] - gstart[g], sizes[g], rank, dd, nw, work, stats, mb, nbits)
    q_len, r_len = stats[:, QB].sum(), stats[:, RB].sum()
    tab = _table(lo, widths, stats, q_len, r_len)
    out = np.zeros(tab.size + (q_len + r_len + 7) // 8, np.uint8)
    out[: tab.size] = tab
    rbuf = np.zeros(r_len // 8 + 2, np.uint8)
    w = _emit(G, gstart, sizes, rank, stats, work, out, tab.size, rbuf, mb)
    close_streams(w, out, tab.size, q_len, rbuf)
    return out
