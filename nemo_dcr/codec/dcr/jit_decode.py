"""Compiled ``dcr`` decoder (docs/wire_format.md section 4.4): every rule checked, nothing written
(the same results as the oracles of the tests, tests/oracles).

Stages: :func:`parse` reads the group table and every Rice code in one sweep and gives each
change its (class, rank) place and its step or literal value; a select stage maps places to
flat indices (a kept :class:`~nemo_dcr.codec.dcr.class_index.DcrIndex`, or
:func:`onepass_select` over the base); :func:`finish` rebuilds new bits from the old ones and
:func:`position_order` sorts by position (two counting-sort passes).  Arrays are sized to keep
the peak memory a small constant per change (docs/performance.md).  A refusal comes back as a
non-zero int (:func:`refusal`): the rule broken, an index of :data:`ERR`, and where; the caller
turns it into a :class:`~nemo_dcr.codec.errors.MalformedRecordError` (:func:`describe`).
"""

from __future__ import annotations

import numpy as np

from ...kernels.jit import AHEAD, njit, prefetch
from . import jit_index as K
from .jit_index import select
from .jit_bits import LIMIT, MAX_K, peek, apply_step, get_bits, get_unary, get_varint, padded, set_rice_k

ERR = ("",
       "truncated field (a varint or a byte), or a varint longer than 10 bytes",
       "group table: lo or n_groups outside the exponent field (lo < 2^exp_bits, 1 <= n_groups <= 2^exp_bits)",
       "group table: a width below 1, or lo + sum of widths over 2^exp_bits",
       "n changes over the group's size",
       "literal reference exponent e_ref outside the exponent field",
       "literal Rice parameter too large (k_lit + exp_shift + 1 over 63)",
       "sign/magnitude counts exceed the group's n changes (n_neg or n_nz over n, n_neg not n + 1)",
       "m_off puts steps beyond the key space (m_off + 1 >= 2^bits)",
       "Rice parameter k_val over 63",
       "bit streams do not fill the body (the bytes after the stream lengths hold them, padded)",
       "non-zero padding after the bit streams",
       "unary stream does not hold exactly the codes the group table needs",
       "remainder stream length does not match the group table (sum of count * k)",
       "Rice quotient overflows 64 bits",
       "Rice value beyond 2**62",
       "gap or rank beyond its set",
       "step beyond the key space (|d| >= 2^bits)",
       "literal exponent outside its field",
       "literal equals the old bits (not a change)")
"""Rules of section 4.4 a body can break, by code; each kernel check returns its code by name."""
(VARINT, LO_GROUPS, WIDTHS, N_SIZE, E_REF, K_LIT, COUNTS, M_OFF, K_VAL, FILL, PADDING, UNARY, R_LEN, QUOTIENT,
 VALUE, GAP, STEP, LIT_EXP, LIT_SAME) = range(1, len(ERR))
WHERE = 5  # a refusal: code | (1 + index of the group or change it concerns, 0 for none) << WHERE
# group table columns
N, NNEG, MOFF, NNZ, KVAL, LIT, EREF, KITEM = range(8)


@njit
def _field(body, at):
    """Next varint: ``(value, next offset, code)``."""
    v, nxt = get_varint(body, at, body.size)
    return (0, at, VARINT) if nxt < 0 else (v, nxt, 0)


@njit
def refusal(code, where):
    """A refusal of rule ``code`` at group or change ``where`` (-1: the body as a whole)."""
    return code | ((where + 1) << WHERE)


def describe(refused: int) -> tuple[str, int]:
    """The rule a :func:`refusal` names (its text in :data:`ERR`) and where (-1: nowhere)."""
    return ERR[refused & ((1 << WHERE) - 1)], (refused >> WHERE) - 1


@njit
def _group_fields(body, at, size, tab, g, nbits, mb, E):
    """One group's fields into ``tab[g]``; returns ``(at, code)``."""
    n, at, e = _field(body, at)
    if e or n > size:
        return at, e or N_SIZE
    tab[g, N] = n
    if n == 0:
        return at, 0
    nneg, at, e = _field(body, at)
    if e:
        return at, e
    if nneg == n + 1:
        eref, at, e = _field(body, at)
        if e:
            return at, e
        if at >= body.size:
            return at, VARINT
        klit, at = np.int64(body[at]), at + 1
        if eref >= E:
            return at, E_REF
        if klit + mb + 1 > MAX_K:
            return at, K_LIT
        tab[g, LIT], tab[g, EREF], tab[g, KITEM] = 1, eref, klit + mb + 1
        return at, 0
    moff, at, e = _field(body, at)
    if e:
        return at, e
    nnz, at, e = _field(body, at)
    if e:
        return at, e
    if nneg > n or nnz > n:
        return at, COUNTS
    if moff + 1 >= (1 << nbits):
        return at, M_OFF
    tab[g, NNEG], tab[g, MOFF], tab[g, NNZ] = nneg, moff, nnz
    if nnz:
        if at >= body.size:
            return at, VARINT
        tab[g, KVAL], at = np.int64(body[at]), at + 1
        if tab[g, KVAL] > MAX_K:
            return at, K_VAL
    return at, 0


@njit
def _table(body, hist, nbits, mb, E):
    """``(lo, bounds, starts, tab, at, refused)``: group range, class-order starts, fields."""
    empty, none = np.zeros((0, 8), np.int64), np.zeros(1, np.int64)
    lo, at, e = _field(body, 0)
    if e:
        return 0, none, none, empty, at, e
    G, at, e = _field(body, at)
    if e or lo >= E or G < 1 or G > E:
        return 0, none, none, empty, at, e or LO_GROUPS
    bounds = np.zeros(G + 1, np.int64)
    bounds[0] = lo
    for g in range(G):
        w, at, e = _field(body, at)
        if e:
            return 0, bounds, bounds, empty, at, e
        if w < 1 or w > E or bounds[g] + w > E:
            return 0, bounds, bounds, empty, at, WIDTHS
        bounds[g + 1] = bounds[g] + w
    first = np.zeros(E + 1, np.int64)
    first[1:] = np.cumsum(hist)
    starts = first[bounds]
    tab = np.zeros((G, 8), np.int64)
    for g in range(G):
        at, e = _group_fields(body, at, starts[g + 1] - starts[g], tab, g, nbits, mb, E)
        if e:
            return lo, bounds, starts, tab, at, refusal(e, g)
    return lo, bounds, starts, tab, at, 0


# ------------------------------------------------------------------------------------------ streams
@njit
def _plan(tab, sizes):
    """Rice codes the table asks for and their remainder bits: ``(codes, r_bits)``."""
    codes, rbits = 0, 0
    for g in range(tab.shape[0]):
        n = tab[g, N]
        if n == 0:
            continue
        for t in range(1 if tab[g, LIT] else 3):
            cnt, uni = (n, sizes[g]) if t == 0 else (tab[g, NNEG if t == 1 else NNZ], n)
            if 0 < cnt < uni:
                coded = min(cnt, uni - cnt)
                codes += coded
                rbits += coded * set_rice_k(coded, uni)
        extra, k = (n, tab[g, KITEM]) if tab[g, LIT] else (tab[g, NNZ], tab[g, KVAL])
        codes += extra
        rbits += extra * k
    return codes, rbits


@njit
def _code(data, rd, q_len, k):
    """Next Rice value with parameter ``k``: ``(value, code)``; reader state ``rd = [q bit, r bit]``."""
    q, nxt = get_unary(data, rd[0], q_len)
    if nxt < 0:
        return 0, UNARY
    rd[0] = nxt
    if q >> max(0, 62 - k):
        return 0, QUOTIENT
    v = (q << k) | get_bits(data, rd[1], k)
    rd[1] += k
    return (0, VALUE) if v >= LIMIT else (v, 0)


@njit
def _bitmap_set(data, q0, q_len, cnt, uni, side, out, o):
    """Members of a coded set whose Rice ``k`` is 0, read as membership bits: the Q stream from bit
    ``q0`` holds one bit per element up to the last coded one (1: coded).  Writes the ``cnt``
    members, sorted, into ``out[o:o + cnt]`` and returns the next Q bit; -1 when the bits leave the
    set or the stream first (the caller then reads the codes one by one for the exact refusal)."""
    coded = cnt if side else uni - cnt
    x, t, ones = 0, 0, 0
    while ones < coded:
        bp = q0 + x
        span = min(56, uni - x, q_len - bp)
        if span <= 0:
            return -1
        window = peek(data, bp >> 3) << np.uint64(bp & 7)
        for b in range(span):
            bit = np.int64(window >> np.uint64(63 - b)) & 1
            if side:
                out[o + t] = x + b
                t += bit
            elif bit == 0:  # a member: only the set's own cnt slots are written
                if t >= cnt:  # more members than the set holds
                    return -1
                out[o + t] = x + b
                t += 1
            ones += bit
            if ones == coded:
                x += b + 1
                break
        else:
            x += span
    if not side:
        for y in range(x, uni):
            out[o + t] = y
            t += 1
    return q0 + x


@njit
def _read_set(data, rd, q_len, cnt, uni, out, o, scratch):
    """Members of a coded subset of ``range(uni)`` of size ``cnt``, sorted, into ``out[o:o + cnt]``."""
    if cnt == uni:
        for x in range(uni):
            out[o + x] = x
    if cnt == 0 or cnt == uni:
        return 0
    side = 2 * cnt <= uni
    coded = cnt if side else uni - cnt
    k, prev = set_rice_k(coded, uni), -1
    if k == 0:
        nxt = _bitmap_set(data, rd[0], q_len, cnt, uni, side, out, o)
        if nxt >= 0:
            rd[0] = nxt
            return 0
    dst, at = (out, o) if side else (scratch, 0)
    for j in range(coded):
        v, e = _code(data, rd, q_len, k)
        if e:
            return e
        if v >= uni or prev + v + 1 >= uni:
            return GAP
        prev += v + 1
        dst[at + j] = prev
    if not side:
        j, t = 0, 0
        for x in range(uni):
            if j < coded and scratch[j] == x:
                j += 1
            else:
                out[o + t] = x
                t += 1
    return 0


@njit
def _group(data, rd, q_len, tab, g, size, gs, rank, val, eref, nbits, sc):
    """Items of group ``g``: ranks into ``rank[gs:]``, steps (or literal values) into ``val[gs:]``."""
    n = tab[g, N]
    e = _read_set(data, rd, q_len, n, size, rank, gs, sc[0])
    if e:
        return e
    if tab[g, LIT]:
        for x in range(n):
            v, e = _code(data, rd, q_len, tab[g, KITEM])
            if e:
                return e
            val[gs + x], eref[gs + x] = v, tab[g, EREF]
        return 0
    neg, nz = sc[1], sc[2]
    e = _read_set(data, rd, q_len, tab[g, NNEG], n, neg, 0, sc[0])
    if e:
        return e
    e = _read_set(data, rd, q_len, tab[g, NNZ], n, nz, 0, sc[0])
    if e:
        return e
    moff = tab[g, MOFF]
    for x in range(n):
        val[gs + x], eref[gs + x] = moff + 1, -1
    for j in range(tab[g, NNZ]):
        v, e = _code(data, rd, q_len, tab[g, KVAL])
        if e:
            return e
        if v + moff + 2 >= (1 << nbits):
            return STEP
        val[gs + nz[j]] += v + 1
    for j in range(tab[g, NNEG]):
        val[gs + neg[j]] = -val[gs + neg[j]]
    return 0


@njit
def _places(bounds, starts, hist, tab, rank):
    """Class of each change; ``rank`` turned from rank in group into rank in class, in place."""
    first = np.zeros(hist.size + 1, np.int64)
    first[1:] = np.cumsum(hist)
    cls = np.empty(rank.size, np.int16)  # classes < 2**exp_bits <= 256
    gs = 0
    for g in range(tab.shape[0]):
        c = bounds[g]
        for i in range(gs, gs + tab[g, N]):
            s = starts[g] + rank[i]
            while first[c + 1] <= s:
                c += 1
            cls[i], rank[i] = c, s - first[c]
        gs += tab[g, N]
    return cls


@njit
def parse(body, hist, nbits, mb, exp_bits):
    """Every change of a body in (class, rank) order: ``(cls, rank in class, value, e_ref or -1,
    refused)``; value is the signed step, or the literal value where ``e_ref >= 0`` (class and e_ref
    as int16: 2 bytes per change); ``refused`` a :func:`refusal` naming a group, or 0."""
    E = 1 << exp_bits
    z, z16 = np.zeros(0, np.int64), np.zeros(0, np.int16)
    lo, bounds, starts, tab, at, e = _table(body, hist, nbits, mb, E)
    if e:
        return z16, z, z, z16, e
    q_len, at, e = _field(body, at)
    r_len, at, e2 = _field(body, at) if not e else (0, at, e)
    if e or e2:
        return z16, z, z, z16, VARINT
    data = body[at:]
    if (q_len + r_len + 7) // 8 != data.size:
        return z16, z, z, z16, FILL
    for bit in range(q_len + r_len, 8 * data.size):
        if (data[bit >> 3] >> (7 - (bit & 7))) & 1:
            return z16, z, z, z16, PADDING
    sizes = starts[1:] - starts[:-1]
    codes, rbits = _plan(tab, sizes)
    if rbits != r_len:
        return z16, z, z, z16, R_LEN
    data = padded(data)  # the readers load 8 bytes at a time
    m, big = tab[:, N].sum(), tab[:, N].max() + 1
    rank, val, eref = np.empty(m, np.int64), np.empty(m, np.int64), np.empty(m, np.int16)
    sc = (np.empty(big, np.int64), np.empty(big, np.int64), np.empty(big, np.int64))  # one group's sets
    rd = np.array([0, q_len])
    gs = 0
    for g in range(tab.shape[0]):
        e = _group(data, rd, q_len, tab, g, sizes[g], gs, rank, val, eref, nbits, sc)
        if e:
            return z16, z, z, z16, refusal(e, g)
        gs += tab[g, N]
    if rd[0] != q_len:
        return z16, z, z, z16, UNARY
    return _places(bounds, starts, hist, tab, rank), rank, val, eref, 0


# ------------------------------------------------------------------------------------------ places
@njit
def onepass_hist(bits, shift, emask):
    """Class histogram of ``bits`` (four counter tables break the store-to-load chains)."""
    t = np.zeros((4, emask + 1), np.int64)
    n4 = bits.size - bits.size % 4
    for i in range(0, n4, 4):
        for u in range(4):
            t[u, (np.int64(bits[i + u]) >> shift) & emask] += 1
    for i in range(n4, bits.size):
        t[0, (np.int64(bits[i]) >> shift) & emask] += 1
    return t[0] + t[1] + t[2] + t[3]


@njit
def onepass_select(bits, shift, emask, cls, kk):
    """Flat index of each (class, rank in class) by one pass over ``bits`` (``(cls, kk)`` sorted),
    written over ``kk`` (each rank is read before its index replaces it) and returned; the pass
    stops once the last one is found."""
    E = emask + 1
    cur, end, want = np.zeros(E, np.int64), np.zeros(E, np.int64), np.full(E, -1, np.int64)
    for i in range(cls.size - 1, -1, -1):
        cur[cls[i]] = i
    for i in range(cls.size):
        end[cls[i]] = i + 1
    for c in range(E):
        if end[c]:
            want[c] = kk[cur[c]]
    pos, cnt, left = kk, np.zeros(E, np.int64), cls.size
    for i in range(bits.size):
        if left == 0:
            break
        c = (np.int64(bits[i]) >> shift) & emask
        if cnt[c] == want[c]:
            pos[cur[c]] = i
            cur[c] += 1
            want[c] = kk[cur[c]] if cur[c] < end[c] else -1
            left -= 1
        cnt[c] += 1
    return pos


# ------------------------------------------------------------------------------------------ bits
@njit
def position_order(pos, n, perm):
    """``perm`` := the permutation sorting ``pos`` (distinct, in ``[0, n)``): two stable
    counting-sort passes (``perm`` int32 when there are fewer than 2**31 changes: 8 bytes per
    change for the two passes)."""
    m = pos.size
    tmp = np.empty_like(perm)
    lo = np.zeros(K.BLOCK + 1, np.int64)
    hi = np.zeros((n >> K.BSHIFT) + 2, np.int64)
    for i in range(m):
        lo[(pos[i] & (K.BLOCK - 1)) + 1] += 1
        hi[(pos[i] >> K.BSHIFT) + 1] += 1
    lo, hi = np.cumsum(lo), np.cumsum(hi)
    for i in range(m):
        d = pos[i] & (K.BLOCK - 1)
        tmp[lo[d]] = i
        lo[d] += 1
    for j in range(m):
        d = pos[tmp[j]] >> K.BSHIFT
        perm[hi[d]] = tmp[j]
        hi[d] += 1
    return perm


@njit
def finish(base, pos, val, eref, nbits, mb, exp_bits):
    """Old and new bits at each ``pos`` (steps applied, literals checked), in the order of
    ``pos``: ``(new, old, refused)``, ``refused`` a :func:`refusal` naming a change, or 0."""
    ones, sign, E = (1 << nbits) - 1, 1 << (nbits - 1), 1 << exp_bits
    m = pos.size
    new, old = np.empty(m, base.dtype), np.empty(m, base.dtype)
    for i in range(m):
        if i + AHEAD < m:  # positions come in class order: each old bit is a cache miss, overlapped
            prefetch(base, pos[i + AHEAD])
        o = np.int64(base[pos[i]]) & ones
        if eref[i] < 0:
            nv = apply_step(o, val[i], ones, sign)
        else:
            v = val[i]
            zz = v >> (mb + 1)
            e = np.int64(eref[i]) + ((zz >> 1) ^ -(zz & 1))
            if e < 0 or e >= E:
                return new, old, refusal(LIT_EXP, i)
            nv = (((v >> mb) & 1) << (nbits - 1)) | (e << mb) | (v & ((1 << mb) - 1))
            if nv == o:
                return new, old, refusal(LIT_SAME, i)
        new[i], old[i] = nv, o
    return new, old, 0


@njit
def places(base, cls, kk, val, eref, order, lfirst, sbefore, sup, kept, nbits, mb, exp_bits):
    """The changes parsed from a body as ``(positions, new, old, refused, at)`` in class order
    (one call per record; :func:`in_position_order` sorts them once the parsed fields are
    dropped): flat indices by the kept index's tables (``kept``) or one pass over ``base``, new
    bits rebuilt from the old ones.  ``refused`` a :func:`refusal` naming a change, whose
    position is ``at`` (else 0 and -1)."""
    pos = select(cls, kk, order, lfirst, sbefore, sup) if kept else \
        onepass_select(base, mb, (1 << exp_bits) - 1, cls, kk)
    new, old, refused = finish(base, pos, val, eref, nbits, mb, exp_bits)
    if refused:
        return pos, new, old, refused, pos[(refused >> WHERE) - 1]
    return pos, new, old, 0, -1


@njit
def in_position_order(pos, new, old, n):
    """``pos``, ``new`` and ``old`` sorted by position (``pos`` distinct in ``[0, n)``)."""
    if pos.size < 1 << 31:  # a 4-byte permutation (the peak memory stays a small constant per change)
        perm = position_order(pos, n, np.empty(pos.size, np.int32))
        return pos[perm], new[perm], old[perm]
    wide = position_order(pos, n, np.empty(pos.size, np.int64))
    return pos[wide], new[wide], old[wide]
