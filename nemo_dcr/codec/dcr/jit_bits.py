"""Compiled bit-level pieces of the ``dcr`` coder (docs/wire_format.md section 4.4): varints, Rice
parameters, the two bit streams, monotone keys.  Every integer is int64 (values < 2**62)."""

from __future__ import annotations

import numpy as np

from ...kernels.jit import ctlz, njit

MAX_K = 63
PAD = 8  # zero bytes after a stream buffer: a reader loads 8 bytes at any byte of the stream
SAT = 1 << 60  # varints at or above this are saturated: no field accepts such a value
LIMIT = 1 << 62  # every valid Rice value is below this


@njit
def bitlen(x):
    """Bits of a non-negative int64 (0 for 0)."""
    n = 0
    while x >> n:
        n += 1
    return n


@njit
def set_rice_k(m, size):
    """Rice parameter of a coded set of ``m`` ranks among ``size`` (0 when ``m`` is 0)."""
    if m <= 0:
        return 0
    return max(0, bitlen((((size - m) // m) * 45426) >> 16) - 1)


@njit
def ceil_mean(vals, lo, hi, count):
    """``⌈Σ vals[lo:hi] / count⌉``, exact for any sum of values below :data:`LIMIT` (``count`` of
    them non-zero at most): the sum is kept in two words, ``hi_w · LIMIT + lo_w``."""
    hi_w, lo_w = 0, 0
    for i in range(lo, hi):
        lo_w += vals[i]
        if lo_w >= LIMIT:
            lo_w -= LIMIT
            hi_w += 1
    if hi_w == 0:
        return (lo_w + count - 1) // count
    q, r = 0, hi_w  # long division, one bit of lo_w at a time (hi_w < count: no quotient above 2**62)
    for b in range(61, -1, -1):
        r, q = 2 * r + ((lo_w >> b) & 1), 2 * q
        if r >= count:
            r, q = r - count, q + 1
    return q + 1 if r else q


@njit
def best_k(vals, lo, hi, count):
    """Rice ``k`` of ``count`` values (``vals[lo:hi]`` holds them and zeros for the rest of its
    entries): the lowest ``k`` in ``[g - 8, g + 1]`` with the fewest bits, ``g = ⌈log2(mean + 1)⌉``
    (computed exactly, as ``bitlen(⌈mean⌉)``).

    The bits are convex in ``k``, rise after ``g`` and exceed those at ``g`` below ``g - 3``, so the
    result is the lowest ``k`` with the fewest bits of all, whatever rounding a float mean would
    give ``g`` (tests/unit/test_dcr_compiled.py checks sums far beyond 2**53 against an oracle).
    """
    if count == 0:
        return 0
    guess = min(bitlen(ceil_mean(vals, lo, hi, count)), MAX_K)
    kmin, kmax = max(0, guess - 8), min(MAX_K, guess + 1)
    sums = np.zeros(10, np.int64)  # each below count * 2**8: every k here is at least g - 8
    for i in range(lo, hi):
        for j in range(kmax - kmin + 1):
            sums[j] += vals[i] >> (kmin + j)
    best, best_cost = kmin, -1
    for j in range(kmax - kmin + 1):
        cost = count * (kmin + j + 1) + sums[j]
        if best_cost < 0 or cost < best_cost:
            best, best_cost = kmin + j, cost
    return best


@njit
def varint_len(x):
    return max(1, (bitlen(x) + 6) // 7)


@njit
def put_varint(buf, at, v):
    """Write unsigned LEB128 ``v`` at ``buf[at]``; returns the next offset."""
    while v >= 0x80:
        buf[at] = (v & 0x7F) | 0x80
        v >>= 7
        at += 1
    buf[at] = v
    return at + 1


@njit
def get_varint(buf, at, end):
    """``(value, next offset)``; offset -1 for a truncated varint, -2 for one over 10 bytes.
    Values at or above :data:`SAT` come back as :data:`SAT`."""
    v, shift, sat = 0, 0, False
    for _ in range(10):
        if at >= end:
            return 0, -1
        byte = np.int64(buf[at])
        at += 1
        if shift < 63:
            v |= (byte & 0x7F) << shift
        elif byte & 0x7F:
            sat = True
        if not byte & 0x80:
            return (SAT if sat or v >= SAT else v), at
        shift += 7
    return 0, -2


# ------------------------------------------------------------------------------------------ writing
# A writer of the two streams is a tuple of registers ``(qp, qacc, nq, racc, nr, rb)``: the Q
# stream's next byte ``out[qp]`` and its ``nq < 8`` pending bits in ``qacc``; the R stream's
# ``nr < 8`` pending bits in ``racc`` and its next byte ``rbuf[rb]``.  The helpers take it and
# return it (inlined: the registers never go through memory), whole bytes are stored as they fill.

@njit(inline=True)
def writer(qoff):
    """A writer whose Q stream starts at byte ``qoff`` of ``out``."""
    return (np.int64(qoff), np.int64(0), np.int64(0), np.int64(0), np.int64(0), np.int64(0))


@njit(inline=True)
def _put_q(bits, n, qp, qacc, nq, out):
    """Append the ``n <= 56`` low bits of ``bits`` (MSB first) to the Q stream."""
    qacc = (qacc << n) | bits
    nq += n
    while nq >= 8:
        nq -= 8
        out[qp] = (qacc >> nq) & 0xFF
        qp += 1
    return qp, qacc & ((1 << nq) - 1), nq


@njit(inline=True)
def put_code(v, k, w, out, rbuf):
    """Rice code of ``v`` with ``k``: a unary quotient (``v >> k`` zeros, then a one) in the Q
    stream, the low ``k`` bits (MSB first) in the R stream; returns the writer."""
    qp, qacc, nq, racc, nr, rb = w
    u = v >> k
    while u > 48:  # a long quotient: its zeros 48 at a time
        qp, qacc, nq = _put_q(0, 48, qp, qacc, nq, out)
        u -= 48
    qp, qacc, nq = _put_q(1, u + 1, qp, qacc, nq, out)
    while k > 0:
        t = min(k, 32)
        racc = (racc << t) | ((v >> (k - t)) & ((1 << t) - 1))
        nr += t
        k -= t
        while nr >= 8:
            nr -= 8
            rbuf[rb] = (racc >> nr) & 0xFF
            rb += 1
        racc &= (1 << nr) - 1
    return (qp, qacc, nq, racc, nr, rb)


@njit(inline=True)
def put_bitmap(flags, gs, n, side, w, out):
    """The Rice codes (``k = 0``) of the set ``{x < n : flags[gs + x] == side}`` whose last member
    is ``n - 1``: exactly its membership bits, 32 at a time."""
    qp, qacc, nq, racc, nr, rb = w
    for x0 in range(0, n, 32):
        t = min(32, n - x0)
        bits = 0
        for x in range(x0, x0 + t):
            bits = (bits << 1) | (flags[gs + x] == side)
        qp, qacc, nq = _put_q(bits, t, qp, qacc, nq, out)
    return (qp, qacc, nq, racc, nr, rb)


@njit
def close_streams(w, out, qoff, q_len, rbuf):
    """Flush both streams and OR the R stream into ``out`` after the ``q_len`` Q bits that start at
    byte ``qoff`` (``out`` zero there and after)."""
    qp, qacc, nq, racc, nr, rb = w
    if nq:
        out[qp] = (qacc << (8 - nq)) & 0xFF
    if nr:
        rbuf[rb] = (racc << (8 - nr)) & 0xFF
        rb += 1
    sh, ob = q_len & 7, qoff + (q_len >> 3)
    for j in range(rb):
        out[ob + j] |= np.uint8(rbuf[j] >> sh)
        if sh and ob + j + 1 < out.size:
            out[ob + j + 1] |= np.uint8((rbuf[j] << (8 - sh)) & 0xFF)


# ------------------------------------------------------------------------------------------ reading
@njit
def padded(data):
    """The stream bytes followed by :data:`PAD` zero bytes (what :func:`get_unary` and
    :func:`get_bits` read)."""
    out = np.zeros(data.size + PAD, np.uint8)
    out[: data.size] = data
    return out


@njit
def peek(data, byte):
    """64 bits, most significant first, from ``data[byte:]`` (padded: ``byte + 8 <= data.size``)."""
    v = np.uint64(0)
    for t in range(8):
        v = (v << np.uint64(8)) | np.uint64(data[byte + t])
    return v


@njit
def get_unary(data, qpos, q_len):
    """``(quotient, next bit)`` of the unary code at bit ``qpos`` of a :func:`padded` stream;
    next -1 when no one bit is left before ``q_len``.  One 64-bit window and a leading-zero count
    per code; a run of more than 56 zeros walks on byte by byte."""
    i = qpos >> 3
    window = peek(data, i) << np.uint64(qpos & 7)
    if window != 0:
        end = qpos + np.int64(ctlz(window))
    else:
        i += 8  # bytes i .. i + 7 held no one bit from qpos on
        while True:
            if (i << 3) >= q_len or i >= data.size - PAD:
                return 0, -1
            if data[i]:
                break
            i += 1
        end = (i << 3) + np.int64(ctlz(np.uint64(data[i]))) - 56
    if end >= q_len:
        return 0, -1
    return end - qpos, end + 1


@njit
def get_bits(data, bp, k):
    """``k`` bits MSB first from bit ``bp`` of a :func:`padded` stream (one 64-bit window up to 56
    bits)."""
    if k == 0:
        return 0
    if k <= 56:
        return np.int64((peek(data, bp >> 3) << np.uint64(bp & 7)) >> np.uint64(64 - k))
    hi = np.int64((peek(data, bp >> 3) << np.uint64(bp & 7)) >> np.uint64(96 - k))  # the first k - 32 bits
    bp += k - 32
    return (hi << 32) | np.int64((peek(data, bp >> 3) << np.uint64(bp & 7)) >> np.uint64(32))


# ------------------------------------------------------------------------------------------ keys
@njit
def key_of(b, ones, sign):
    """Monotone key of bits ``b`` (int64, ``0 <= b <= ones``)."""
    return b ^ ones if b & sign else b | sign


@njit
def signed_step(old, new, ones, sign):
    """Magnitude-direction ULP step from ``old`` to ``new`` bits."""
    s = key_of(new, ones, sign) - key_of(old, ones, sign)
    return -s if old & sign else s


@njit
def fold_steps(old, new, nbits):
    """Step of each change folded to ``u = 2(|d| - 1) + (d < 0)`` (uint64): one symbol per change."""
    ones, sign = (1 << nbits) - 1, 1 << (nbits - 1)
    out = np.empty(old.size, np.uint64)
    for i in range(old.size):
        d = signed_step(np.int64(old[i]) & ones, np.int64(new[i]) & ones, ones, sign)
        out[i] = 2 * (abs(d) - 1) + (1 if d < 0 else 0)
    return out


@njit
def apply_step(old, d, ones, sign):
    """Inverse of :func:`signed_step`."""
    k = (key_of(old, ones, sign) + (-d if old & sign else d)) & ones
    return k ^ sign if k & sign else k ^ ones
