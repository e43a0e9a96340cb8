"""Compiled kernels of the kept class index (:class:`nemo_dcr.codec.dcr.class_index.DcrIndex`).

Layout, for a tensor of ``n`` elements with ``E`` exponent classes, cut into blocks of
``B = 4096`` elements and superblocks of ``S = 16`` blocks:

* ``order`` (uint16, one per element): inside each block, the local indices sorted by
  (class, index), so the elements of class ``c`` in block ``b`` are the sorted run
  ``order[b*B + lfirst[b, c] : b*B + lfirst[b, c + 1]]``;
* ``lfirst`` (uint16, ``nb x (E + 1)``): start of each class's run inside its block;
* ``sbefore`` (uint16, ``E x nb``): elements of class ``c`` in the earlier blocks of the same
  superblock (at most ``15 * 4096``);
* ``sup`` (int64, ``E x (nsb + 1)``): elements of class ``c`` before each superblock; its last
  column is the class histogram.

The rank of element ``p`` (class ``c``, block ``b``) among the elements of its class is
``sup[c, b // S] + sbefore[c, b] + j`` with ``j`` its place in its run (binary search).
A class move (an element whose exponent changed) shifts entries inside one block's ``order``
and adjusts at most 15 ``sbefore`` entries per class; a block with many moves is re-sorted
from the classes the index itself holds.  ``sup`` rows of the classes that moved are summed
again per update (``nsb`` additions each).
"""

from __future__ import annotations

import numpy as np

from ...kernels.jit import njit

BSHIFT = 12
BLOCK = 1 << BSHIFT
SSHIFT = 4  # blocks per superblock = 16
RESORT = 16  # moves in one block above which the block is re-sorted instead of shifted


@njit
def _cls(x, shift, emask):
    return (np.int64(x) >> shift) & emask


@njit
def _sort_block(b, n, cls_of, order, lfirst):
    """Counting sort of block ``b`` by ``cls_of(local)`` (an int64 array of the block's classes)."""
    E = lfirst.shape[1] - 1
    size = min(BLOCK, n - (b << BSHIFT))
    cnt = np.zeros(E + 1, np.int64)
    for i in range(size):
        cnt[cls_of[i] + 1] += 1
    for c in range(E):
        cnt[c + 1] += cnt[c]
    for c in range(E + 1):
        lfirst[b, c] = cnt[c]
    base = b << BSHIFT
    for i in range(size):
        c = cls_of[i]
        order[base + cnt[c]] = i
        cnt[c] += 1


@njit
def refresh_sup(lfirst, sbefore, sup, classes):
    """Recompute ``sup`` rows of ``classes`` from the per-block tables."""
    nb = lfirst.shape[0]
    nsb = sup.shape[1] - 1
    for c in classes:
        for sb in range(nsb):
            last = min(((sb + 1) << SSHIFT), nb) - 1
            sup[c, sb + 1] = sup[c, sb] + sbefore[c, last] + lfirst[last, c + 1] - lfirst[last, c]


@njit
def _sbefore_block(b, lfirst, sbefore):
    """``sbefore[:, b]`` from block ``b - 1`` (or zero at a superblock start)."""
    E = sbefore.shape[0]
    for c in range(E):
        if b & ((1 << SSHIFT) - 1) == 0:
            sbefore[c, b] = 0
        else:
            sbefore[c, b] = sbefore[c, b - 1] + lfirst[b - 1, c + 1] - lfirst[b - 1, c]


@njit
def build(bits, shift, emask, order, lfirst, sbefore, sup):
    """Fill every table from the base bits (one pass, each block sorted in cache)."""
    n = bits.size
    nb = lfirst.shape[0]
    cls_of = np.empty(BLOCK, np.int64)
    for b in range(nb):
        base = b << BSHIFT
        for i in range(min(BLOCK, n - base)):
            cls_of[i] = _cls(bits[base + i], shift, emask)
        _sort_block(b, n, cls_of, order, lfirst)
        _sbefore_block(b, lfirst, sbefore)
    refresh_sup(lfirst, sbefore, sup, np.arange(sbefore.shape[0]))


@njit
def find(order, lo, hi, loc):
    """Index in ``order[lo:hi]`` (sorted) of the first entry ``>= loc``."""
    while lo < hi:
        mid = (lo + hi) >> 1
        if order[mid] < loc:
            lo = mid + 1
        else:
            hi = mid
    return lo


@njit
def select(c, k, order, lfirst, sbefore, sup):
    """Flat index of the element of rank ``k`` (``0 <= k < hist[c]``) among those of class ``c``."""
    lo, hi = 0, sup.shape[1] - 2  # last superblock whose start count is <= k
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        if sup[c, mid] <= k:
            lo = mid
        else:
            hi = mid - 1
    k -= sup[c, lo]
    b = lo << SSHIFT
    end = min(b + (1 << SSHIFT), lfirst.shape[0])
    while b + 1 < end and sbefore[c, b + 1] <= k:
        b += 1
    k -= sbefore[c, b]
    return (b << BSHIFT) + np.int64(order[(b << BSHIFT) + lfirst[b, c] + k])


@njit
def _search(order, lo, ln, loc, w):
    """Batched branchless search: for each of ``w`` sorted runs ``order[lo[k] : lo[k] + ln[k]]``
    (non-empty), ``lo[k]`` ends at the last entry ``<= loc[k]``.  The ``w`` searches advance
    together, so their loads overlap instead of waiting on each other."""
    while True:
        longest = 0
        for k in range(w):
            half = ln[k] >> 1
            lo[k] += half * (order[lo[k] + half] <= loc[k])
            ln[k] -= half
            longest = max(longest, ln[k])
        if longest <= 1:
            return


@njit
def ranks(bits, positions, shift, emask, order, lfirst, sbefore, sup, out):
    """Class-order position of each changed element; returns the first entry the index does not
    hold (stale index) or that is out of order or range, else -1."""
    E, nsb, W = sup.shape[0], sup.shape[1] - 1, 16
    first = np.zeros(E, np.int64)
    for c in range(1, E):
        first[c] = first[c - 1] + sup[c - 1, nsb]
    lo, ln, loc, start = np.empty(W, np.int64), np.empty(W, np.int64), np.empty(W, np.int64), np.empty(W, np.int64)
    prev = -1
    for j0 in range(0, positions.size, W):
        w = min(W, positions.size - j0)
        for k in range(w):
            p = positions[j0 + k]
            if p <= prev or p >= bits.size:
                return j0 + k
            prev = p
            c, b = _cls(bits[p], shift, emask), p >> BSHIFT
            lo[k] = start[k] = (b << BSHIFT) + lfirst[b, c]
            ln[k], loc[k] = lfirst[b, c + 1] - lfirst[b, c], p & (BLOCK - 1)
            if ln[k] == 0:
                return j0 + k
            out[j0 + k] = first[c] + sup[c, b >> SSHIFT] + sbefore[c, b]
        _search(order, lo, ln, loc, w)
        for k in range(w):
            if order[lo[k]] != loc[k]:
                return j0 + k
            out[j0 + k] += lo[k] - start[k]
    return -1


@njit
def _shift_move(b, loc, c1, c2, order, lfirst):
    """Move local element ``loc`` of block ``b`` from class ``c1``'s run to ``c2``'s (False when absent)."""
    base = b << BSHIFT
    lo, hi = base + lfirst[b, c1], base + lfirst[b, c1 + 1]
    a = find(order, lo, hi, loc)
    if a == hi or order[a] != loc:
        return False
    ins = find(order, base + lfirst[b, c2], base + lfirst[b, c2 + 1], loc)
    if c1 < c2:
        for t in range(a, ins - 1):
            order[t] = order[t + 1]
        order[ins - 1] = loc
        for c in range(c1 + 1, c2 + 1):
            lfirst[b, c] -= 1
    else:
        for t in range(a, ins, -1):
            order[t] = order[t - 1]
        order[ins] = loc
        for c in range(c2 + 1, c1 + 1):
            lfirst[b, c] += 1
    return True


@njit
def _resort(b, n, locs, c1s, c2s, order, lfirst, cls_of):
    """Re-sort block ``b`` after the moves ``locs`` (``c1s`` -> ``c2s``); False when one is absent."""
    E = lfirst.shape[1] - 1
    base = b << BSHIFT
    for c in range(E):
        for t in range(lfirst[b, c], lfirst[b, c + 1]):
            cls_of[order[base + t]] = c
    for i in range(locs.size):
        if cls_of[locs[i]] != c1s[i]:
            return False
        cls_of[locs[i]] = c2s[i]
    _sort_block(b, n, cls_of, order, lfirst)
    return True


@njit
def _sbefore_move(b, c1, c2, sbefore):
    end = min(((b >> SSHIFT) + 1) << SSHIFT, sbefore.shape[1])
    for t in range(b + 1, end):
        sbefore[c1, t] -= 1
        sbefore[c2, t] += 1


@njit
def _block_moves(j, e, positions, old, new, shift, emask, locs, c1s, c2s):
    k = 0
    for i in range(j, e):
        c1, c2 = _cls(old[i], shift, emask), _cls(new[i], shift, emask)
        if c1 != c2:
            locs[k], c1s[k], c2s[k] = positions[i] & (BLOCK - 1), c1, c2
            k += 1
    return k


@njit
def update(n, positions, old, new, shift, emask, order, lfirst, sbefore, sup):
    """Apply the class moves of a committed delta (positions increasing).

    Returns ``(status, moves)``: status -1 when done, else the entry that was out of order or
    range or whose old class the index does not hold there (the index is then inconsistent).
    """
    E = sup.shape[0]
    dirty = np.zeros(E, np.bool_)
    locs, c1s, c2s = np.empty(BLOCK, np.int64), np.empty(BLOCK, np.int64), np.empty(BLOCK, np.int64)
    cls_of = np.empty(BLOCK, np.int64)
    j, moves, prev = 0, 0, -1
    while j < positions.size:
        b = positions[j] >> BSHIFT
        e = j
        while e < positions.size and positions[e] >> BSHIFT == b:
            if positions[e] <= prev or positions[e] >= n:
                return e, moves
            prev = positions[e]
            e += 1
        k = _block_moves(j, e, positions, old, new, shift, emask, locs, c1s, c2s)
        if k > RESORT:
            if not _resort(b, n, locs[:k], c1s[:k], c2s[:k], order, lfirst, cls_of):
                return j, moves
        for i in range(k):
            if k <= RESORT and not _shift_move(b, locs[i], c1s[i], c2s[i], order, lfirst):
                return j, moves
            _sbefore_move(b, c1s[i], c2s[i], sbefore)
            dirty[c1s[i]] = dirty[c2s[i]] = True
        moves += k
        j = e
    refresh_sup(lfirst, sbefore, sup, np.flatnonzero(dirty))
    return -1, moves
