"""Compiled host kernels of the capture scan and of the in-place bit writes.

These are the CPU paths of :func:`nemo_dcr.kernels.changed_positions`,
:func:`nemo_dcr.kernels.write_bits`, :func:`nemo_dcr.kernels.read_bits` and
:func:`nemo_dcr.kernels.unequal_at`; the torch ops stay
the device paths and the test references.  Also the walks through sorted runs (the megatron
source's remap, :class:`~nemo_dcr.apply.placement.Runs`' maps) and the routing's merge of
increasing pieces.  Arrays are numpy integer views of one width.
"""

from __future__ import annotations

import numpy as np

from .jit import AHEAD, cttz, njit, prefetch

_WORDS = 8  # 64-bit words compared per step of the scan (one cache line)


@njit
def _grow(a, k):
    out = np.empty(max(2 * a.size, k + 1024), a.dtype)
    out[: a.size] = a
    return out


@njit
def _lanes(per_word):
    """Constants of a word holding ``per_word`` elements (lanes of ``width`` bits):
    ``(low, high, gather, top, lane_bits, down)``.

    ``low``/``high``: the low ``width - 1`` bits and the top bit of each lane, so
    ``(((x & low) + low) | x) & high`` is the top bit of each non-zero lane of ``x``.  Shifted
    down by ``down`` (to bit ``width * j`` for lane ``j``), ``((lanes * gather) >> top) &
    lane_bits`` holds lane ``j``'s bit at bit ``j``.  ``gather`` has bits ``(width - 1) *
    (per_word - 1 - j)``: lane ``j`` times the ``j``-th of them lands on ``top + j``, and no two
    products share a bit (``width * j - (width - 1) * i`` differs for every pair), so nothing
    carries."""
    width = 64 // per_word
    down = np.uint64(width - 1)
    high, gather = np.uint64(0), np.uint64(0)
    for j in range(per_word):
        high |= np.uint64(1) << np.uint64(width * j + width - 1)
        gather |= np.uint64(1) << np.uint64((width - 1) * (per_word - 1 - j))
    low = (high >> down) * ((np.uint64(1) << down) - np.uint64(1))
    return low, high, gather, np.uint64((width - 1) * (per_word - 1)), np.uint64((1 << per_word) - 1), down


@njit
def scan_words(cur, old, cur_w, old_w, per_word):
    """Positions (int64, increasing), new and old bits where ``cur != old``.

    ``cur_w``/``old_w`` are uint64 views of the first ``cur_w.size * per_word`` elements: a
    cache line of words is compared at once; in a line that differs, the changed lanes of its
    words are found with bit arithmetic (the top bit of each non-zero lane of ``cur ^ old``,
    gathered by one multiply into one bit per element of the line), then one trailing-zero count
    per change: one loop per line, not per word, so a line costs one mispredicted loop exit.
    """
    n, nw = cur.size, cur_w.size
    pos = np.empty(1024 + (n >> 8), np.int64)
    new, was = np.empty(pos.size, cur.dtype), np.empty(pos.size, cur.dtype)
    low, high, gather, top, lane_bits, down = _lanes(per_word)
    k = 0
    for w0 in range(0, nw - nw % _WORDS, _WORDS):
        acc = np.uint64(0)
        for t in range(_WORDS):
            acc |= cur_w[w0 + t] ^ old_w[w0 + t]
        if acc == 0:
            continue
        if k + _WORDS * per_word > pos.size:
            grow = k + _WORDS * per_word
            pos, new, was = _grow(pos, grow), _grow(new, grow), _grow(was, grow)
        line = np.uint64(0)  # bit t * per_word + lane: that element of word t differs
        for t in range(_WORDS):
            x = cur_w[w0 + t] ^ old_w[w0 + t]
            lanes = ((((x & low) + low) | x) & high) >> down
            line |= (((lanes * gather) >> top) & lane_bits) << np.uint64(t * per_word)
        at = w0 * per_word
        while line:
            i = at + np.int64(cttz(line))
            pos[k], new[k], was[k] = i, cur[i], old[i]
            k += 1
            line &= line - np.uint64(1)
    for i in range((nw - nw % _WORDS) * per_word, n):
        if cur[i] != old[i]:
            if k == pos.size:
                pos, new, was = _grow(pos, k), _grow(new, k), _grow(was, k)
            pos[k], new[k], was[k] = i, cur[i], old[i]
            k += 1
    return pos[:k].copy(), new[:k].copy(), was[:k].copy()


@njit
def _in_bounds(positions, n):
    for i in range(positions.size):
        if positions[i] < 0 or positions[i] >= n:
            return i
    return -1


@njit
def scatter(view, positions, bits):
    """``view[positions] = bits`` after checking every position (returns the first bad index or -1)."""
    bad = _in_bounds(positions, view.size)
    if bad >= 0:
        return bad
    m = positions.size
    for i in range(m):
        if i + AHEAD < m:
            prefetch(view, positions[i + AHEAD])
        view[positions[i]] = bits[i]
    return -1


@njit
def changed_at(view, positions, bits):
    """``(bad, positions, new, old)`` of the entries where ``view[positions[i]] != bits[i]``, in
    their order; ``bad`` the first position outside ``view`` (then nothing else), else -1."""
    bad = _in_bounds(positions, view.size)
    m = positions.size if bad < 0 else 0
    pos, new, old = np.empty(m, np.int64), np.empty(m, bits.dtype), np.empty(m, view.dtype)
    k = 0
    for i in range(m):
        if i + AHEAD < m:
            prefetch(view, positions[i + AHEAD])
        p = positions[i]
        pos[k], new[k], old[k] = p, bits[i], view[p]
        k += view[p] != bits[i]
    return bad, pos[:k], new[:k], old[:k]


@njit
def unequal(view, positions, bits):
    """``(bad, first)``: the first position outside ``view`` (or -1), else the first entry whose
    element does not hold ``bits[i]`` (or -1).  Reads the elements once, writes nothing."""
    bad = _in_bounds(positions, view.size)
    if bad >= 0:
        return bad, -1
    m = positions.size
    for i in range(m):
        if i + AHEAD < m:
            prefetch(view, positions[i + AHEAD])
        if view[positions[i]] != bits[i]:
            return -1, i
    return -1, -1


@njit
def gather(view, positions, out):
    """``out[:] = view[positions]`` after checking every position (first bad index or -1)."""
    bad = _in_bounds(positions, view.size)
    if bad >= 0:
        return bad
    m = positions.size
    for i in range(m):
        if i + AHEAD < m:
            prefetch(view, positions[i + AHEAD])
        out[i] = view[positions[i]]
    return -1


@njit
def map_runs(positions, start, length, canon, target, n_targets):
    """Increasing ``positions`` through runs sorted by ``start`` (disjoint): run ``r`` maps
    ``[start[r], start[r] + length[r])`` to ``canon[r] + k`` of target ``target[r]`` (``0 ..
    n_targets - 1``).

    Returns ``(bad, sel, index, counts)``: ``bad`` the first entry that is not above the one
    before it or lies in no run (then nothing else), else -1; ``sel`` (entries into
    ``positions``) and ``index`` (their mapped indices) grouped by target in target order, each
    group in entry order; ``counts`` the entries per target.  One merge walk over both, then one
    counting pass."""
    m, nr = positions.size, start.size
    run = np.empty(m, np.int64)
    counts = np.zeros(n_targets, np.int64)
    r, prev = 0, np.int64(-1)
    for i in range(m):
        p = positions[i]
        if p <= prev:
            return i, run[:0], run[:0], counts
        prev = p
        while r < nr and start[r] + length[r] <= p:
            r += 1
        if r == nr or p < start[r]:
            return i, run[:0], run[:0], counts
        run[i] = r
        counts[target[r]] += 1
    at = np.empty(n_targets, np.int64)
    acc = 0
    for t in range(n_targets):
        at[t] = acc
        acc += counts[t]
    sel, index = np.empty(m, np.int64), np.empty(m, np.int64)
    for i in range(m):
        r = run[i]
        k = at[target[r]]
        sel[k], index[k] = i, canon[r] + positions[i] - start[r]
        at[target[r]] = k + 1
    return -1, sel, index, counts


@njit
def _run_at(starts, r, p):
    """The last run ``q`` with ``starts[q] <= p`` (-1: none), searched from run ``r`` (the last
    answer): a few steps forward for the next position of an increasing stream, else bisection."""
    nr = starts.size
    if 0 <= r < nr and starts[r] <= p:
        for _ in range(8):
            if r + 1 == nr or starts[r + 1] > p:
                return r
            r += 1
        lo, hi = r, nr  # starts[lo] <= p
    else:
        lo, hi = -1, nr if r < 0 or r >= nr else r
    while hi - lo > 1:
        mid = (lo + hi) >> 1
        if starts[mid] <= p:
            lo = mid
        else:
            hi = mid
    return lo


@njit
def select_runs(positions, canon, length, vstart, local, step):
    """Runs (sorted, disjoint ``[canon[r], canon[r] + length[r])``; view index of their first
    element ``vstart[r]``, local ``local[r]`` moving by ``step[r]``) at canonical ``positions``
    (any order; increasing ones in one merge walk): ``(held mask, view index, local index)`` of
    the held entries, in entry order."""
    m = positions.size
    held = np.zeros(m, np.bool_)
    view, loc = np.empty(m, np.int64), np.empty(m, np.int64)
    k, r = 0, -1
    for i in range(m):
        p = positions[i]
        r = _run_at(canon, r, p)
        if r >= 0 and p < canon[r] + length[r]:
            off = p - canon[r]
            held[i] = True
            view[k], loc[k] = vstart[r] + off, local[r] + off * step[r]
            k += 1
    return held, view[:k], loc[:k]


@njit
def from_view_runs(view, vstart, starts, step, stepped):
    """``starts[r] + k`` (``stepped``: ``+ k * step[r]``) of each view index ``view[i] = vstart[r]
    + k`` (``r``: the last run with ``vstart[r] <= view[i]``; any order, increasing ones in one
    walk)."""
    out = np.empty(view.size, np.int64)
    r = -1
    for i in range(view.size):
        v = view[i]
        r = _run_at(vstart, r, v)
        k = v - vstart[r]
        out[i] = starts[r] + (k * step[r] if stepped else k)
    return out


@njit
def merge_sorted(pos, new, old, offsets, with_old):
    """Merge pieces ``pos[offsets[q]:offsets[q + 1]]`` (each strictly increasing) with their
    ``new`` (and, ``with_old``, ``old``) bits into one increasing stream, in one pass: the piece
    whose next position is smallest gives every entry below the other pieces' next positions at
    once (a piece of disjoint range is one copy).  Returns ``(dup, pos, new, old)``: ``dup`` an
    entry of ``pos`` whose position another piece also holds (then the rest is unspecified),
    else -1."""
    k, n = offsets.size - 1, pos.size
    head, end = offsets[:-1].copy(), offsets[1:]
    out_p, out_n = np.empty(n, np.int64), np.empty(n, new.dtype)
    out_o = np.empty(n if with_old else 0, old.dtype)
    big = np.iinfo(np.int64).max
    t = 0
    while t < n:
        best, bp, second = -1, big, big
        for q in range(k):
            if head[q] < end[q]:
                p = pos[head[q]]
                if p < bp:
                    best, bp, second = q, p, bp
                elif p < second:
                    second = p
        if bp == second:
            return head[best], out_p, out_n, out_o
        i, e = head[best], end[best]
        while i < e and pos[i] < second:
            out_p[t], out_n[t] = pos[i], new[i]
            if with_old:
                out_o[t] = old[i]
            i += 1
            t += 1
        if i < e and pos[i] == second:
            return i, out_p, out_n, out_o
        head[best] = i
    return -1, out_p, out_n, out_o
