"""Compiled host kernels of the capture scan and of the in-place bit writes.

These are the CPU paths of :func:`nemo_dcr.kernels.changed_positions`,
:func:`nemo_dcr.kernels.write_bits`, :func:`nemo_dcr.kernels.read_bits` and
:func:`nemo_dcr.kernels.unequal_at`; the torch ops stay
the device paths and the test references.  Arrays are numpy integer views of one width.
"""

from __future__ import annotations

import numpy as np

from .jit import njit

_WORDS = 8  # 64-bit words compared per step of the scan (one cache line)


@njit
def _grow(a, k):
    out = np.empty(max(2 * a.size, k + 1024), a.dtype)
    out[: a.size] = a
    return out


@njit
def scan_words(cur, old, cur_w, old_w, per_word):
    """Positions (int64, increasing) and new bits where ``cur != old``.

    ``cur_w``/``old_w`` are uint64 views of the first ``cur_w.size * per_word`` elements: a
    cache line of words is compared at once and only lines that differ are looked at element
    by element.
    """
    n, nw = cur.size, cur_w.size
    pos = np.empty(1024 + (n >> 8), np.int64)
    new = np.empty(pos.size, cur.dtype)
    k = 0
    for w0 in range(0, nw - nw % _WORDS, _WORDS):
        acc = np.uint64(0)
        for t in range(_WORDS):
            acc |= cur_w[w0 + t] ^ old_w[w0 + t]
        if acc == 0:
            continue
        if k + _WORDS * per_word > pos.size:
            pos, new = _grow(pos, k + _WORDS * per_word), _grow(new, k + _WORDS * per_word)
        for i in range(w0 * per_word, (w0 + _WORDS) * per_word):
            if cur[i] != old[i]:
                pos[k], new[k] = i, cur[i]
                k += 1
    for i in range((nw - nw % _WORDS) * per_word, n):
        if cur[i] != old[i]:
            if k == pos.size:
                pos, new = _grow(pos, k), _grow(new, k)
            pos[k], new[k] = i, cur[i]
            k += 1
    return pos[:k].copy(), new[:k].copy()


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
    for i in range(positions.size):
        view[positions[i]] = bits[i]
    return -1


@njit
def unequal(view, positions, bits):
    """``(bad, first)``: the first position outside ``view`` (or -1), else the first entry whose
    element does not hold ``bits[i]`` (or -1).  Reads the elements once, writes nothing."""
    bad = _in_bounds(positions, view.size)
    if bad >= 0:
        return bad, -1
    for i in range(positions.size):
        if view[positions[i]] != bits[i]:
            return -1, i
    return -1, -1


@njit
def gather(view, positions, out):
    """``out[:] = view[positions]`` after checking every position (first bad index or -1)."""
    bad = _in_bounds(positions, view.size)
    if bad >= 0:
        return bad
    for i in range(positions.size):
        out[i] = view[positions[i]]
    return -1
