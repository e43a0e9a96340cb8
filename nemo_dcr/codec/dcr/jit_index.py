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
Class moves (elements whose exponent changed) rewrite their block's ``order`` once, between the
first and the last moved entry (segment copies; the events come in order from a counting sort
by class), and adjust at most 15 ``sbefore`` entries per class by its net change over the block.
``sup`` rows of the classes that moved are summed again per update (``nsb`` additions each).
"""

from __future__ import annotations

import numpy as np

from ...kernels.jit import AHEAD, njit, prefetch

BSHIFT = 12
BLOCK = 1 << BSHIFT
SSHIFT = 4  # blocks per superblock = 16
EV = BSHIFT + 1  # class shift in a block event (local index and departure flag below)
SEGMENT = 16  # entries of an unchanged segment above which a block rewrite copies it as one slice
SHIFTS = 2  # moves in one block up to which entries are shifted per move instead of rewritten once


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
    """Index in ``order[lo:hi]`` (sorted) of the first entry ``>= loc`` (branch-free halving)."""
    n = hi - lo
    while n > 1:
        half = n >> 1
        lo += half * (order[lo + half - 1] < loc)
        n -= half
    return lo + (n == 1 and order[lo] < loc)


@njit
def near(order, lo, hi, loc, g, at_g):
    """Index in ``order[lo:hi]`` (sorted, non-empty) of the first entry ``>= loc``, starting from
    a guess ``g`` whose entry ``at_g`` is already loaded: gallop to bracket it, then halve."""
    step = 1
    if at_g < loc:
        while g + step < hi and order[g + step] < loc:
            g += step
            step <<= 1
        return find(order, g + 1, min(g + step, hi), loc)
    while g - step >= lo and order[g - step] >= loc:
        g -= step
        step <<= 1
    return find(order, max(lo, g - step + 1), g, loc)


@njit
def _first(sup):
    """Class-order start of each class."""
    E, nsb = sup.shape[0], sup.shape[1] - 1
    first = np.zeros(E, np.int64)
    for c in range(1, E):
        first[c] = first[c - 1] + sup[c - 1, nsb]
    return first


CHUNK = 1024  # changes ranked per round of passes (their scratch stays in cache)
PF = 32  # changes between the prefetch of a change's table entries and their loads


@njit
def ranks(old, positions, n, shift, emask, order, lfirst, sbefore, sup, out, slots):
    """Class-order position of each changed element (``old``: its base bits, ``n``: elements);
    returns the first entry that is out of order or range, else the first the index does not
    hold (stale index), else -1.  ``slots`` (uint16): each element's entry in its block's
    ``order``, found on the way (an :func:`update` by the same changes starts from them).

    Chunks of :data:`CHUNK` changes go through separate passes (classes and run bounds, the entry
    where a uniform run would hold each element, searches from there): each pass's loads are
    independent and branch-free, so the cache misses of many changes overlap instead of waiting
    on each other, and the scratch is a few cache-sized arrays whatever the change count.
    """
    m, first = positions.size, _first(sup)
    prev = -1
    for j in range(m):
        p = positions[j]
        if p <= prev or p >= n:
            return j
        prev = p
    lo, hi = np.empty(CHUNK, np.int64), np.empty(CHUNK, np.int64)
    guess, at_guess = np.empty(CHUNK, np.int64), np.empty(CHUNK, np.int64)
    lf, sbf, rows, nb = lfirst.reshape(-1), sbefore.reshape(-1), lfirst.shape[1], lfirst.shape[0]
    for j0 in range(0, m, CHUNK):
        w = min(CHUNK, m - j0)
        for t in range(w):
            if t + PF < w:  # the table entries of a later change on their way
                bp, cp = positions[j0 + t + PF] >> BSHIFT, _cls(old[j0 + t + PF], shift, emask)
                prefetch(lf, bp * rows + cp)
                prefetch(sbf, cp * nb + bp)
            p = positions[j0 + t]
            b, c = p >> BSHIFT, _cls(old[j0 + t], shift, emask)
            lo[t], hi[t] = (b << BSHIFT) + lfirst[b, c], (b << BSHIFT) + lfirst[b, c + 1]
            out[j0 + t] = first[c] + sup[c, b >> SSHIFT] + sbefore[c, b] - lo[t]
            guess[t] = min(lo[t] + (((hi[t] - lo[t]) * (p & (BLOCK - 1))) >> BSHIFT), order.size - 1)
            prefetch(order, guess[t])
        for t in range(w):
            at_guess[t] = order[guess[t]]
        for t in range(w):
            loc = positions[j0 + t] & (BLOCK - 1)
            if lo[t] == hi[t]:
                return j0 + t
            i = near(order, lo[t], hi[t], loc, guess[t], at_guess[t])
            if i == hi[t] or order[i] != loc:
                return j0 + t
            out[j0 + t] += i
            slots[j0 + t] = i & (BLOCK - 1)
    return -1


@njit
def _superblock(sup, c, k, lo):
    """Last superblock ``>= lo`` whose start count in class ``c`` is ``<= k`` (``sup[c, lo] <= k``):
    a walk of up to 8 steps from ``lo``, then halving."""
    hi = sup.shape[1] - 2
    for _ in range(8):
        if lo >= hi or sup[c, lo + 1] > k:
            return lo
        lo += 1
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        if sup[c, mid] <= k:
            lo = mid
        else:
            hi = mid - 1
    return lo


@njit
def select(cls, kk, order, lfirst, sbefore, sup):
    """Flat index of the element of each rank ``kk[i]`` (``< hist[c]``) among those of class
    ``cls[i]``, in passes: superblock and block (from the per-class rows), then the block's run;
    the indexes are written over ``kk`` (each rank is read before it is replaced) and returned.

    Changes come sorted by (class, rank), so each search starts where the previous one of the
    same class ended (a walk over the tables, not a search per change); any order is correct."""
    m = cls.size
    blk, at = np.empty(m, np.int32), kk  # blocks < 2**31
    pc, pk, sb, b = -1, 0, 0, 0
    for i in range(m):
        c, k = cls[i], kk[i]
        if c != pc or k < pk:
            sb, b = 0, 0
        pc, pk = c, k
        start = sb
        sb = _superblock(sup, c, k, sb)
        k -= sup[c, sb]
        if sb != start or b < sb << SSHIFT:
            b = sb << SSHIFT
        end = min((sb + 1) << SSHIFT, lfirst.shape[0])
        while b + 1 < end and sbefore[c, b + 1] <= k:
            b += 1
        blk[i], at[i] = b, k - sbefore[c, b] + (b << BSHIFT)
    lf, rows = lfirst.reshape(-1), lfirst.shape[1]
    for i in range(m):
        if i + AHEAD < m:
            prefetch(lf, np.int64(blk[i + AHEAD]) * rows + cls[i + AHEAD])
        at[i] += lfirst[blk[i], cls[i]]
    for i in range(m):
        if i + AHEAD < m:
            prefetch(order, at[i + AHEAD])
        at[i] = (blk[i] << BSHIFT) + np.int64(order[at[i]])
    return at


@njit
def _block_events(b, locs, c1s, c2s, slots, order, lfirst, keys, cnt):
    """Sort keys of a block's move events into ``keys[:2k]``, generated in sorted order: an
    arrival (inserted before an old-order index, ordered by class and local index) sorts before a
    departure (that entry skipped).

    An event's place in the block's order is fixed by its (class, local index): a departure's old
    class, an arrival's new one.  The moves come in local-index order, so a stable counting sort of
    the events by class (``cnt``: one counter per class and one more) yields them in key order, no
    comparison sort; each class's events search its run from where the previous one was found,
    a departure none when its ``slots`` entry holds it there.  Returns False when a departing
    element is not in its old class's run."""
    base, k = b << BSHIFT, locs.size
    lo_c, hi_c = c1s[0], c1s[0]  # the counters of the classes between, not of every class
    for i in range(k):
        lo_c, hi_c = min(lo_c, c1s[i], c2s[i]), max(hi_c, c1s[i], c2s[i])
    cnt[lo_c : hi_c + 2] = 0
    for i in range(k):
        cnt[c1s[i] + 1] += 1
        cnt[c2s[i] + 1] += 1
    for c in range(lo_c, hi_c + 1):
        cnt[c + 1] += cnt[c]
    ev = keys[2 * k : 4 * k]  # class << EV | local index << 1 | departure, in key order
    at = keys[4 * k : 6 * k]  # a departure's hinted place, in key order
    for i in range(k):
        ev[cnt[c1s[i]]] = (c1s[i] << EV) | (locs[i] << 1) | 1
        at[cnt[c1s[i]]] = base + slots[i]
        cnt[c1s[i]] += 1
        ev[cnt[c2s[i]]] = (c2s[i] << EV) | (locs[i] << 1)
        cnt[c2s[i]] += 1
    prev, start = -1, 0
    for t in range(2 * k):
        c, loc = ev[t] >> EV, (ev[t] >> 1) & (BLOCK - 1)
        lo, hi = base + lfirst[b, c], base + lfirst[b, c + 1]
        if c != prev:
            prev, start = c, lo
        if ev[t] & 1:
            i = at[t]
            if i < start or i >= hi or order[i] != loc:
                i = find(order, start, hi, loc)
                if i == hi or order[i] != loc:
                    return False
            keys[t] = ((i - base) << 22) | (1 << 21)
            start = i + 1
        else:
            i = find(order, start, hi, loc)
            keys[t] = ((i - base) << 22) | (c << BSHIFT) | loc
            start = i
    return True


@njit
def _rewrite(b, keys, order, tmp):
    """Rewrite block ``b``'s ``order`` between the first and last event (sorted ``keys``)."""
    base = b << BSHIFT
    start = keys[0] >> 22
    cur, t = base + start, 0
    for key in keys:
        at = base + (key >> 22)
        if at - cur > SEGMENT:  # a long segment: one slice copy
            tmp[t : t + at - cur] = order[cur:at]
            t, cur = t + at - cur, at
        while cur < at:  # a short one: element by element
            tmp[t] = order[cur]
            t, cur = t + 1, cur + 1
        if key & (1 << 21):
            cur = at + 1
        else:
            tmp[t] = key & (BLOCK - 1)
            t += 1
    order[base + start : base + start + t] = tmp[:t]


@njit
def _shift_move(b, loc, c1, c2, order, lfirst, slot):
    """One move by shifting the entries between its old and new place (False when absent);
    ``slot``: where the entry was found before (a hint, checked)."""
    base = b << BSHIFT
    lo, hi = base + lfirst[b, c1], base + lfirst[b, c1 + 1]
    a = base + slot
    if a < lo or a >= hi or order[a] != loc:
        a = find(order, lo, hi, loc)
    if a == hi or order[a] != loc:
        return False
    ins = find(order, base + lfirst[b, c2], base + lfirst[b, c2 + 1], loc)
    if c1 < c2:
        for i in range(a, ins - 1):
            order[i] = order[i + 1]
        order[ins - 1] = loc
    else:
        for i in range(a, ins, -1):
            order[i] = order[i - 1]
        order[ins] = loc
    return True


@njit
def _move_block(b, locs, c1s, c2s, slots, order, lfirst, keys, tmp, cnt):
    """Apply the class moves of one block; False when one of them is not held as given
    (``slots``: each departing entry's place in the block's order as found before, checked).

    One or two moves shift the entries between old and new place; more rewrite the block once."""
    k = locs.size
    if k <= SHIFTS:
        for i in range(k):
            if not _shift_move(b, locs[i], c1s[i], c2s[i], order, lfirst, slots[i]):
                return False
            _lfirst_move(b, c1s[i], c2s[i], lfirst)
        return True
    if not _block_events(b, locs, c1s, c2s, slots, order, lfirst, keys, cnt):
        return False
    _rewrite(b, keys[: 2 * k], order, tmp)
    for i in range(k):
        _lfirst_move(b, c1s[i], c2s[i], lfirst)
    return True


@njit
def _lfirst_move(b, c1, c2, lfirst):
    if c1 < c2:
        for c in range(c1 + 1, c2 + 1):
            lfirst[b, c] -= 1
    else:
        for c in range(c2 + 1, c1 + 1):
            lfirst[b, c] += 1


@njit
def _sbefore_moves(b, c1s, c2s, sbefore, net, touched):
    """The later ``sbefore`` entries of block ``b``'s superblock move by each class's net change
    over the block's moves (``net``: zero per class on entry and exit; ``touched``: scratch)."""
    end = min(((b >> SSHIFT) + 1) << SSHIFT, sbefore.shape[1])
    if b + 1 >= end:
        return
    nt = 0
    for i in range(c1s.size):
        for c, step in ((c1s[i], -1), (c2s[i], 1)):
            if net[c] == 0:
                touched[nt] = c
                nt += 1
            net[c] += step
    for j in range(nt):
        c = touched[j]
        if net[c]:
            for t in range(b + 1, end):
                sbefore[c, t] += net[c]
            net[c] = 0


@njit
def _block_moves(j, e, positions, old, new, shift, emask, slots, locs, c1s, c2s, at):
    """The class moves among changes ``j:e`` of one block, into ``locs``, ``c1s``, ``c2s`` and
    ``at`` (hinted places: ``slots``, or -1 without); their count.  Branch-free: every change is
    written and the count steps over the ones that keep their class."""
    k = 0
    hinted = slots.size == positions.size
    for i in range(j, e):
        c1, c2 = _cls(old[i], shift, emask), _cls(new[i], shift, emask)
        locs[k], c1s[k], c2s[k] = positions[i] & (BLOCK - 1), c1, c2
        at[k] = slots[i] if hinted else -1
        k += c1 != c2
    return k


@njit
def update(n, positions, old, new, shift, emask, order, lfirst, sbefore, sup, slots):
    """Apply the class moves of a committed delta (positions increasing).

    Each block with moves is rewritten once between its first and last event (segment copies),
    so a block costs its moves' searches plus at most one copy of its order.  ``slots``: the
    entries :func:`ranks` found for these positions (uint16, one per change; a departing entry
    held there is not searched again), or an empty array.  A slot is a hint: each is checked,
    and a wrong one costs a search, never a wrong index.  Returns
    ``(status, moves)``: status -1 when done, else an entry that was out of order or range or
    whose old class the index does not hold there (the index is then inconsistent).
    """
    dirty = np.zeros(sup.shape[0], np.bool_)
    locs, c1s, c2s = np.empty(BLOCK, np.int64), np.empty(BLOCK, np.int64), np.empty(BLOCK, np.int64)
    at, keys, tmp = np.empty(BLOCK, np.int64), np.empty(6 * BLOCK, np.int64), np.empty(2 * BLOCK, order.dtype)
    cnt, net = np.zeros(sup.shape[0] + 1, np.int64), np.zeros(sup.shape[0], np.int64)
    j, moves, prev = 0, 0, -1
    while j < positions.size:
        b = positions[j] >> BSHIFT
        e = j
        while e < positions.size and positions[e] >> BSHIFT == b:
            if positions[e] <= prev or positions[e] >= n:
                return e, moves
            prev = positions[e]
            e += 1
        k = _block_moves(j, e, positions, old, new, shift, emask, slots, locs, c1s, c2s, at)
        if k and not _move_block(b, locs[:k], c1s[:k], c2s[:k], at[:k], order, lfirst, keys, tmp, cnt):
            return j, moves
        _sbefore_moves(b, c1s[:k], c2s[:k], sbefore, net, keys)
        for i in range(k):
            dirty[c1s[i]] = dirty[c2s[i]] = True
        moves += k
        j = e
    refresh_sup(lfirst, sbefore, sup, np.flatnonzero(dirty))
    return -1, moves
