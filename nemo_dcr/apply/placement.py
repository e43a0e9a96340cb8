"""Where each canonical element lives in an engine rank: runs, placements, primaries, coverage.

An engine with fused, TP-sharded params (vLLM: ``qkv_proj``, ``gate_up_proj``, MoE ``w13_weight``
/ ``w2_weight``, a padded vocab-parallel embedding) holds each canonical HF tensor's elements,
or this rank's share of them, somewhere inside one param.  A :class:`TensorPlacement` says where:
:class:`Runs` map canonical flat index -> engine-local flat index for the elements this rank
holds, stored as runs (a TP row shard is one run, a transposed expert tensor one run per row), so
a placement costs a few integers per tensor.  Placements are *probed* from the engine's own
``load_weights`` (:mod:`nemo_dcr.apply.probe`), never re-derived by hand.

Worked example (TP=2, rank 1, ``q_proj`` [8, 4], ``k_proj``/``v_proj`` [4, 4], ``qkv_proj`` local
[8, 4] = q rows 4..7, k rows 2..3, v rows 2..3): ``k_proj`` lands at local flat 16..23, so its
runs are ``canon=[8] local=[16] length=[8] step=[1]``.

Everything here is framework-free (torch and numpy).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Mapping, Sequence

import numpy as np

from nemo_dcr.kernels.cpu import from_view_runs, select_runs
from nemo_dcr.types import SparseDelta


class PlacementError(ValueError):
    """A probe result is not a placement (a value that is not a canonical index, a duplicate)."""


@dataclass(frozen=True)
class Runs:
    """A map from held canonical flat indices to engine-local flat indices, as runs.

    Run ``r`` maps canonical ``canon[r] + k`` to local ``local[r] + k * step[r]`` for
    ``0 <= k < length[r]``; runs are sorted by ``canon`` and disjoint.  ``step`` is 1 for a plain
    copy (a TP row shard is one run) and the row length of a transpose (a loader that stores a
    ``[E, H, N]`` tensor as ``[E, N, H]`` maps each canonical row of ``N`` to local stride ``H``),
    so a transposed tensor costs one run per row, not per element.  The held elements, in
    canonical order, also form the *view* index space ``j = 0 .. numel-1`` that payload records
    for this rank use.
    """

    canon: np.ndarray
    local: np.ndarray
    length: np.ndarray
    step: np.ndarray | None = None

    def __post_init__(self):
        if self.step is None:
            object.__setattr__(self, "step", np.ones(len(self.canon), np.int64))

    @classmethod
    def from_pairs(cls, canon: np.ndarray, local: np.ndarray) -> "Runs":
        """Compress ``canon[i] -> local[i]`` pairs (any order, canonical indices unique)."""
        order = np.argsort(canon, kind="stable")
        c, l = np.asarray(canon, np.int64)[order], np.asarray(local, np.int64)[order]
        if c.size and np.any(np.diff(c) == 0):
            raise PlacementError("a canonical index landed at two engine positions")
        return cls.from_sorted(c, l)

    @classmethod
    def from_sorted(cls, c: np.ndarray, l: np.ndarray) -> "Runs":
        """Runs of pairs sorted by unique canonical index: a run continues while the canonical
        index grows by one and the local index by the same positive step."""
        if not c.size:
            return cls(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64))
        dc, dl = np.diff(c), np.diff(l)
        hard = (dc != 1) | (dl < 1)
        brk = hard.copy()
        brk[1:] |= ~hard[:-1] & (dl[1:] != dl[:-1])  # the step changes inside a run
        starts = np.concatenate([[0], np.flatnonzero(brk) + 1]).astype(np.int64)
        lengths = np.diff(np.concatenate([starts, [c.size]])).astype(np.int64)
        step = np.where(lengths > 1, np.concatenate([dl, [1]])[starts], 1).astype(np.int64)
        return cls(c[starts], l[starts], lengths, step)

    @classmethod
    def merged(cls, parts: Sequence["Runs"]) -> "Runs":
        """One map from disjoint maps (e.g. runs found chunk by chunk), sorted by canonical start;
        a run that the next one continues (canonical and local index, same step) is joined with it,
        so a contiguous view found in chunks is one run (a gather of it is a view, not a copy)."""
        parts = [r for r in parts if r.canon.size]
        if not parts:
            return cls(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64))
        fields = [np.concatenate([getattr(r, f) for r in parts]) for f in ("canon", "local", "length", "step")]
        order = np.argsort(fields[0], kind="stable")
        canon, local, length, step = (f[order] for f in fields)
        joined = (canon[:-1] + length[:-1] == canon[1:]) & (local[:-1] + length[:-1] * step[:-1] == local[1:]) \
            & (step[:-1] == step[1:])
        if not joined.any():
            return cls(canon, local, length, step)
        starts = np.concatenate([[0], np.flatnonzero(~joined) + 1]).astype(np.int64)
        return cls(canon[starts], local[starts], np.add.reduceat(length, starts).astype(np.int64), step[starts])

    @property
    def numel(self) -> int:
        """Held elements."""
        return int(self.length.sum())

    @property
    def view_start(self) -> np.ndarray:
        """View index ``j`` of each run's first element."""
        return (np.cumsum(self.length) - self.length).astype(np.int64)

    def expand(self) -> tuple[np.ndarray, np.ndarray]:
        """All (canonical, local) pairs in view order (O(held elements); for tests and gathers)."""
        rep = np.repeat(np.arange(self.length.size), self.length)
        k = np.arange(self.numel, dtype=np.int64) - np.repeat(self.view_start, self.length)
        return self.canon[rep] + k, self.local[rep] + k * self.step[rep]

    def pieces(self, chunk: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """:meth:`expand` in view-order pieces of at most about ``chunk`` elements (long runs are
        split): a pass over the held elements with temporaries bounded by ``chunk``."""
        canon, local, length, step = [], [], [], []
        for c, l, n, k in zip(self.canon.tolist(), self.local.tolist(), self.length.tolist(), self.step.tolist()):
            for s in range(0, n, chunk):
                canon.append(c + s), local.append(l + s * k), length.append(min(chunk, n - s)), step.append(k)
        ends = np.cumsum(np.array(length, np.int64))
        lo = 0
        while lo < len(length):
            hi = int(np.searchsorted(ends, (ends[lo - 1] if lo else 0) + chunk, side="right"))
            hi = max(hi, lo + 1)
            yield Runs(*(np.array(v[lo:hi], np.int64) for v in (canon, local, length, step))).expand()
            lo = hi

    def select(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For canonical ``positions`` (increasing ones cost one merge walk over them and the
        runs): (held mask, view index, local index) of the held ones."""
        pos = np.ascontiguousarray(positions, np.int64)
        return select_runs(pos, self.canon, self.length, self.view_start, self.local, self.step)

    def of_view(self, intervals: Sequence[tuple[int, int]]) -> "Runs":
        """The runs of the held elements at view indices ``[start, start + length)`` of each
        interval (sorted, disjoint): each run cut at the intervals' ends.  Cost ∝ runs and
        intervals, never a pass over the elements (the same map as :meth:`from_pairs` of the
        expanded pairs, with runs split where an interval ends)."""
        iv = np.asarray(intervals, np.int64).reshape(-1, 2)
        iv = iv[iv[:, 1] > 0]
        if not iv.size or not self.canon.size:
            return Runs(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64))
        lo, hi = iv[:, 0], iv[:, 0] + iv[:, 1]
        vs = self.view_start
        if int(lo.min()) < 0 or int(hi.max()) > self.numel:
            raise PlacementError(f"view intervals reach outside the {self.numel} held elements")
        first = np.searchsorted(vs, lo, side="right") - 1  # the run holding each interval's start
        last = np.searchsorted(vs, hi, side="left") - 1  # the run holding its last element
        count = last - first + 1
        which = np.repeat(np.arange(iv.shape[0]), count)
        r = first[which] + np.arange(int(count.sum()), dtype=np.int64) - np.repeat(np.cumsum(count) - count, count)
        a = np.maximum(lo[which], vs[r])
        b = np.minimum(hi[which], vs[r] + self.length[r])
        keep = b > a
        r, a, b = r[keep], a[keep], b[keep]
        off = a - vs[r]
        return Runs(self.canon[r] + off, self.local[r] + off * self.step[r], b - a, self.step[r].copy())

    def view_to_local(self, view: np.ndarray) -> np.ndarray:
        """Engine-local flat index of view indices ``view``."""
        return self._from_view(view, self.local, self.step)

    def view_to_canon(self, view: np.ndarray) -> np.ndarray:
        """Canonical flat index of view indices ``view``."""
        return self._from_view(view, self.canon, None)

    def _from_view(self, view: np.ndarray, starts: np.ndarray, step: np.ndarray | None) -> np.ndarray:
        v = np.ascontiguousarray(view, np.int64)
        if v.size and not self.canon.size:
            raise IndexError(f"view indices {int(v[0])}.. of a view that holds no element")
        return from_view_runs(v, self.view_start, starts, self.step if step is None else step, step is not None)


@dataclass(frozen=True)
class TensorPlacement:
    """One canonical tensor's elements on one engine rank.

    Attributes:
        name: canonical HF tensor name.
        shape: canonical shape.
        param: engine param that holds them.
        param_shape: that param's local shape.
        runs: canonical -> local flat index of the held elements.
        primary: view-index runs ``(start, length)`` of the held elements this rank is the first
            (lowest) holder of; engine checksums sum only these, so replicated elements count once.
    """

    name: str
    shape: tuple[int, ...]
    param: str
    param_shape: tuple[int, ...]
    runs: Runs
    primary: tuple[tuple[int, int], ...] = ()

    @property
    def numel(self) -> int:
        """Held elements (the view's length)."""
        return self.runs.numel


RankPlacement = Mapping[str, TensorPlacement]
"""Canonical name -> placement, for one engine rank."""

Fills = dict
"""Engine param name -> list of ``(local flat positions, values)`` a loader wrote as constants
(vLLM zero-fills vocab padding rows): what a fresh load leaves at positions no canonical element has."""


def fills_outside_views(fills: Fills, placement: RankPlacement) -> Fills:
    """The constants of ``fills`` at positions no canonical element of ``placement`` lands on (a
    loader that clears a whole fused param before writing its slot must not clear the other slots
    after a resync); cost ∝ constants and runs, never a pass over the params (a param with
    strided runs, a transpose, costs a pass over its held elements)."""
    out: Fills = {}
    for param, entries in fills.items():
        runs = [tp.runs for tp in placement.values() if tp.param == param]
        kept = [(pos[~m], values[~m]) for pos, values in entries for m in [_held(runs, pos)] if (~m).any()]
        if kept:
            out[param] = kept
    return out


def _held(runs: Sequence[Runs], pos: np.ndarray) -> np.ndarray:
    """Which local positions ``pos`` some run of ``runs`` lands on."""
    if any(np.any(r.step != 1) for r in runs):
        return np.isin(pos, np.concatenate([r.expand()[1] for r in runs]))
    starts = np.concatenate([r.local for r in runs]) if runs else np.zeros(0, np.int64)
    ends = starts + (np.concatenate([r.length for r in runs]) if runs else 0)
    order = np.argsort(starts, kind="stable")
    starts, ends = starts[order], ends[order]
    at = np.searchsorted(starts, pos, side="right") - 1
    return (at >= 0) & (pos < ends[np.maximum(at, 0)]) if starts.size else np.zeros(pos.size, bool)


def view_delta(delta: SparseDelta, runs: Runs) -> SparseDelta:
    """The elements of the canonical ``delta`` that ``runs`` holds, in its view index space (what a
    record routed to that engine rank carries); cost ∝ changes."""
    held, view, _ = runs.select(delta.positions)
    old = None if delta.old_bits is None else delta.old_bits[held]
    return SparseDelta(delta.name, delta.dtype, (runs.numel,), view, delta.new_bits[held], old)


def assign_primary(ranks: Sequence[RankPlacement]) -> list[dict[str, TensorPlacement]]:
    """Mark, per tensor, the elements each rank is the lowest holder of (for checksum sums).

    Cost ∝ runs per tensor and rank (canonical intervals, never a per-element mask)."""
    out: list[dict[str, TensorPlacement]] = [dict() for _ in ranks]
    names = sorted({n for r in ranks for n in r})
    for name in names:
        taken = (np.zeros(0, np.int64), np.zeros(0, np.int64))  # canonical intervals held by lower ranks
        for e, rank in enumerate(ranks):
            tp = rank.get(name)
            if tp is None:
                continue
            r = tp.runs
            cuts = np.unique(np.concatenate([r.canon, r.canon + r.length, *taken]))
            a, b = cuts[:-1], cuts[1:]
            held, i = _within(a, r.canon, r.canon + r.length)
            mine = held & ~_within(a, *taken)[0]
            view = r.view_start[i[mine]] + a[mine] - r.canon[i[mine]]
            out[e][name] = TensorPlacement(tp.name, tp.shape, tp.param, tp.param_shape, tp.runs,
                                           _joined(view, view + (b - a)[mine]))
            taken = _union(taken, (r.canon, r.canon + r.length))
    return out


def _within(x: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Whether each ``x`` lies in one of the disjoint intervals ``[starts, ends)`` (sorted by
    start), and the index of that interval."""
    if not starts.size:
        return np.zeros(x.size, bool), np.zeros(x.size, np.int64)
    order = np.argsort(starts, kind="stable")
    i = np.searchsorted(starts[order], x, side="right") - 1
    j = order[np.maximum(i, 0)]
    return (i >= 0) & (x < ends[j]), j


def _joined(starts: np.ndarray, ends: np.ndarray) -> tuple[tuple[int, int], ...]:
    """``(start, length)`` of sorted disjoint intervals, touching ones joined."""
    if not starts.size:
        return ()
    brk = np.flatnonzero(starts[1:] != ends[:-1]) + 1
    lo, hi = starts[np.concatenate([[0], brk])], ends[np.concatenate([brk - 1, [ends.size - 1]])]
    return tuple((int(a), int(b - a)) for a, b in zip(lo, hi))


def _union(x: tuple[np.ndarray, np.ndarray], y: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """The union of two sets of disjoint intervals ``(starts, ends)``, as sorted disjoint intervals."""
    s, e = np.concatenate([x[0], y[0]]), np.concatenate([x[1], y[1]])
    keep = e > s
    s, e = s[keep], e[keep]
    if not s.size:
        return s, e
    order = np.argsort(s, kind="stable")
    s, e = s[order], np.maximum.accumulate(e[order])
    brk = np.flatnonzero(s[1:] > e[:-1]) + 1
    return s[np.concatenate([[0], brk])], e[np.concatenate([brk - 1, [e.size - 1]])]


def check_coverage(ranks: Sequence[RankPlacement], shapes: Mapping[str, Sequence[int]],
                   skipped: Mapping[str, str] | None = None) -> None:
    """Every canonical element is held by some rank (or its tensor is named in ``skipped``, the
    tensors the engine's loader deliberately does not load), and every placement names a known tensor.

    Raises:
        PlacementError: naming the tensors with unknown names or uncovered elements.
    """
    unknown = sorted({n for r in ranks for n in r} - set(shapes))
    if unknown:
        raise PlacementError(f"placements for unknown tensors {unknown[:5]}; known: {sorted(shapes)[:5]}...")
    for name, shape in shapes.items():
        if skipped and name in skipped:
            continue
        held = sum(sum(n for _, n in r[name].primary) for r in ranks if name in r)
        if held != int(np.prod(shape)):
            raise PlacementError(f"{name}: engine ranks hold {held} of {int(np.prod(shape))} elements")


def placement_to_json(placement: RankPlacement) -> dict:
    """A JSON-able form of one rank's placement (lists of ints; sent between driver and workers)."""
    return {n: dict(shape=list(tp.shape), param=tp.param, param_shape=list(tp.param_shape),
                    canon=tp.runs.canon.tolist(), local=tp.runs.local.tolist(), length=tp.runs.length.tolist(),
                    step=tp.runs.step.tolist(), primary=[list(p) for p in tp.primary]) for n, tp in placement.items()}


_JSON_KEYS = ("shape", "param", "param_shape", "canon", "local", "length", "step", "primary")


def placement_from_json(obj: Mapping) -> dict[str, TensorPlacement]:
    """Inverse of :func:`placement_to_json`.

    Raises:
        PlacementError: an entry without exactly its keys, or runs of unequal lengths (names the tensor).
    """
    if not isinstance(obj, Mapping):
        raise PlacementError(f"a placement is an object of canonical name -> entry, got {type(obj).__name__}")
    out = {}
    for n, o in obj.items():
        if not isinstance(o, Mapping) or sorted(o) != sorted(_JSON_KEYS):
            raise PlacementError(f"placement of {n}: keys {sorted(o) if isinstance(o, Mapping) else o!r}, "
                                 f"expected {sorted(_JSON_KEYS)}")
        if not len(o["canon"]) == len(o["local"]) == len(o["length"]) == len(o["step"]):
            raise PlacementError(f"placement of {n}: canon, local, length and step differ in length")
        runs = Runs(*(np.array(o[k], np.int64) for k in ("canon", "local", "length", "step")))
        out[n] = TensorPlacement(n, tuple(o["shape"]), o["param"], tuple(o["param_shape"]), runs,
                                 tuple(tuple(p) for p in o["primary"]))
    return out
