"""Where each canonical element lives in an engine rank, derived by probing the engine's own loaders.

An engine with fused, TP-sharded params (vLLM: ``qkv_proj``, ``gate_up_proj``, MoE ``w13_weight``
/ ``w2_weight``, a padded vocab-parallel embedding) loads a canonical HF tensor by calling the
param's ``weight_loader`` (with a shard id, and an expert id for MoE).  Instead of re-deriving
that placement by hand, :func:`probe_tensor` calls the loader once with an *iota* tensor (every
element holds its own canonical flat index plus one) into a probe buffer of the param's shape
filled with -1, and reads off which canonical index landed at each engine-local position.  The
offset of one keeps constants a loader writes itself (vLLM zero-fills vocab padding rows) apart
from canonical index 0: only values >= 1 are placements.  The result is a
:class:`Runs` map canonical flat index -> engine-local flat index for the elements this rank
holds, stored as runs of consecutive indices (a TP row shard is one run), so it costs a few
integers per tensor; startup cost is one loader call per canonical tensor.

Worked example (TP=2, rank 1, ``q_proj`` [8, 4], ``k_proj``/``v_proj`` [4, 4], ``qkv_proj`` local
[8, 4] = q rows 4..7, k rows 2..3, v rows 2..3): probing ``k_proj`` writes canonical indices
8..15 (as 9..16) at local flat 16..23, so its runs are ``canon=[8] local=[16] length=[8]``.

:func:`record_loader_calls` finds *which* loader call the engine would make for a canonical name
by running the engine's own ``load_weights`` with every param's loader replaced by a recorder,
so shard ids come from the engine's ``stacked_params_mapping`` / expert mapping, not from a copy.
Everything here is framework-free (torch and numpy); the vLLM specifics are in
``nemo_dcr.integrations.vllm.worker`` and a CPU stand-in with the same loader contract is
``tests.standins.vllm_standin``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np
import torch

from nemo_dcr.types import SparseDelta


class PlacementError(ValueError):
    """A probe result is not a placement (a value that is not a canonical index, a duplicate)."""


@dataclass(frozen=True)
class Runs:
    """A monotone map from held canonical flat indices to engine-local flat indices.

    Run ``r`` maps canonical ``canon[r] + k`` to local ``local[r] + k`` for ``0 <= k < length[r]``;
    runs are sorted by ``canon`` and disjoint.  The held elements, in canonical order, also form
    the *view* index space ``j = 0 .. numel-1`` that payload records for this rank use.
    """

    canon: np.ndarray
    local: np.ndarray
    length: np.ndarray

    @classmethod
    def from_pairs(cls, canon: np.ndarray, local: np.ndarray) -> "Runs":
        """Compress ``canon[i] -> local[i]`` pairs (any order, canonical indices unique)."""
        order = np.argsort(canon, kind="stable")
        c, l = np.asarray(canon, np.int64)[order], np.asarray(local, np.int64)[order]
        if c.size and np.any(np.diff(c) == 0):
            raise PlacementError("a canonical index landed at two engine positions")
        brk = np.flatnonzero((np.diff(c) != 1) | (np.diff(l) != 1)) + 1
        starts = np.concatenate([[0], brk]).astype(np.int64) if c.size else np.zeros(0, np.int64)
        lengths = np.diff(np.concatenate([starts, [c.size]])).astype(np.int64)
        return cls(c[starts], l[starts], lengths)

    @property
    def numel(self) -> int:
        """Held elements."""
        return int(self.length.sum())

    @property
    def view_start(self) -> np.ndarray:
        """View index ``j`` of each run's first element."""
        return np.concatenate([[0], np.cumsum(self.length)[:-1]]).astype(np.int64)

    def expand(self) -> tuple[np.ndarray, np.ndarray]:
        """All (canonical, local) pairs in view order (O(held elements); for tests and gathers)."""
        rep = np.repeat(np.arange(self.length.size), self.length)
        k = np.arange(self.numel, dtype=np.int64) - np.repeat(self.view_start, self.length)
        return self.canon[rep] + k, self.local[rep] + k

    def select(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For sorted canonical ``positions``: (held mask, view index, local index) of the held ones."""
        pos = np.asarray(positions, np.int64)
        r = np.searchsorted(self.canon, pos, side="right") - 1
        rr = np.maximum(r, 0)
        held = (r >= 0) & (pos < self.canon[rr] + self.length[rr]) if self.canon.size else np.zeros(pos.size, bool)
        k = pos[held] - self.canon[rr[held]]
        return held, self.view_start[rr[held]] + k, self.local[rr[held]] + k

    def view_to_local(self, view: np.ndarray) -> np.ndarray:
        """Engine-local flat index of view indices ``view``."""
        return self._from_view(view, self.local)

    def view_to_canon(self, view: np.ndarray) -> np.ndarray:
        """Canonical flat index of view indices ``view``."""
        return self._from_view(view, self.canon)

    def _from_view(self, view: np.ndarray, starts: np.ndarray) -> np.ndarray:
        v = np.asarray(view, np.int64)
        r = np.searchsorted(self.view_start, v, side="right") - 1
        return starts[r] + (v - self.view_start[r])


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

Loader = Callable[[torch.Tensor, torch.Tensor], None]
"""``load(probe_buffer, iota)``: the engine's loader writing ``iota`` into ``probe_buffer``."""


Fills = dict
"""Engine param name -> list of ``(local flat positions, values)`` a loader wrote as constants
(vLLM zero-fills vocab padding rows): what a fresh load leaves at positions no canonical element has."""


def fills_outside_views(fills: Fills, placement: RankPlacement) -> Fills:
    """The constants of ``fills`` at positions no canonical element of ``placement`` lands on (a
    loader that clears a whole fused param before writing its slot must not clear the other slots
    after a resync); cost ∝ constants and runs, never a pass over the params."""
    out: Fills = {}
    for param, entries in fills.items():
        runs = [tp.runs for tp in placement.values() if tp.param == param]
        starts = np.concatenate([r.local for r in runs]) if runs else np.zeros(0, np.int64)
        ends = starts + (np.concatenate([r.length for r in runs]) if runs else 0)
        order = np.argsort(starts, kind="stable")
        starts, ends = starts[order], ends[order]
        kept = []
        for pos, values in entries:
            at = np.searchsorted(starts, pos, side="right") - 1
            inside = (at >= 0) & (pos < ends[np.maximum(at, 0)]) if starts.size else np.zeros(pos.size, bool)
            if (~inside).any():
                kept.append((pos[~inside], values[~inside]))
        if kept:
            out[param] = kept
    return out


def view_delta(delta: SparseDelta, runs: Runs) -> SparseDelta:
    """The elements of the canonical ``delta`` that ``runs`` holds, in its view index space (what a
    record routed to that engine rank carries); cost ∝ changes."""
    held, view, _ = runs.select(delta.positions)
    old = None if delta.old_bits is None else delta.old_bits[held]
    return SparseDelta(delta.name, delta.dtype, (runs.numel,), view, delta.new_bits[held], old)


def probe_tensor(name: str, shape: Sequence[int], param: str, param_shape: Sequence[int], load: Loader,
                 dtype: torch.dtype = torch.int64, device: str | torch.device = "cpu",
                 fills: Fills | None = None) -> TensorPlacement | None:
    """Probe one loader call with an iota tensor; None if the rank holds no element of ``name``.

    Args:
        name: canonical tensor name; ``shape`` its canonical shape.
        param: engine param name; ``param_shape`` its local shape.
        load: the engine's loader call (see :data:`Loader`).
        dtype: probe dtype: ``int64`` (exact for any size) or ``float64`` (exact below 2**53).
        device: where the probe buffer lives (the param's device).
        fills: if given, constants the loader wrote (values < 1 other than the -1 filler) are
            added to it under ``param``.

    Raises:
        PlacementError: a written value is not a canonical index or lands twice.
    """
    numel = int(np.prod(shape)) if len(shape) else 1
    buf = torch.full(tuple(param_shape), -1, dtype=dtype, device=device)
    load(buf, torch.arange(1, numel + 1, dtype=dtype, device=device).reshape(tuple(shape)))
    flat = buf.reshape(-1)
    if fills is not None:
        const = torch.nonzero((flat < 1) & (flat != -1)).reshape(-1)
        if const.numel():
            fills.setdefault(param, []).append((const.cpu().numpy(), flat[const].cpu().numpy()))
    local = torch.nonzero(flat >= 1).reshape(-1)
    values = flat[local]
    if values.dtype.is_floating_point and not torch.equal(values, values.round()):
        raise PlacementError(f"{name} -> {param}: the loader changed values (not a plain copy)")
    canon = values.to(torch.int64).cpu().numpy() - 1
    if canon.size and canon.max() >= numel:
        raise PlacementError(f"{name} -> {param}: values outside [0, {numel}) in the probe")
    if not canon.size:
        return None
    return TensorPlacement(name, tuple(shape), param, tuple(param_shape),
                           Runs.from_pairs(canon, local.cpu().numpy()))


def assign_primary(ranks: Sequence[RankPlacement]) -> list[dict[str, TensorPlacement]]:
    """Mark, per tensor, the elements each rank is the lowest holder of (for checksum sums)."""
    out: list[dict[str, TensorPlacement]] = [dict() for _ in ranks]
    names = sorted({n for r in ranks for n in r})
    for name in names:
        taken = None
        for e, rank in enumerate(ranks):
            tp = rank.get(name)
            if tp is None:
                continue
            if taken is None:
                taken = np.zeros(int(np.prod(tp.shape)) if tp.shape else 1, bool)
            canon, _ = tp.runs.expand()
            mine = ~taken[canon]
            taken[canon] = True
            out[e][name] = TensorPlacement(tp.name, tp.shape, tp.param, tp.param_shape, tp.runs, _intervals(mine))
    return out


def _intervals(mask: np.ndarray) -> tuple[tuple[int, int], ...]:
    """``(start, length)`` of every run of True in ``mask``."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return tuple((int(a), int(b - a)) for a, b in zip(edges[::2], edges[1::2]))


def check_coverage(ranks: Sequence[RankPlacement], shapes: Mapping[str, Sequence[int]]) -> None:
    """Every canonical element is held by some rank, and every placement names a known tensor.

    Raises:
        PlacementError: naming the tensors with unknown names or uncovered elements.
    """
    unknown = sorted({n for r in ranks for n in r} - set(shapes))
    if unknown:
        raise PlacementError(f"placements for unknown tensors {unknown[:5]}; known: {sorted(shapes)[:5]}...")
    for name, shape in shapes.items():
        held = sum(sum(n for _, n in r[name].primary) for r in ranks if name in r)
        if held != int(np.prod(shape)):
            raise PlacementError(f"{name}: engine ranks hold {held} of {int(np.prod(shape))} elements")


@dataclass(frozen=True)
class LoaderCall:
    """One call the engine's ``load_weights`` made for a canonical tensor.

    Attributes:
        param: engine param name.
        args: positional arguments after ``(param, loaded_weight)``.
        kwargs: keyword arguments (``shard_id``, ``expert_id``, ...).
    """

    param: str
    args: tuple = ()
    kwargs: tuple[tuple[str, object], ...] = ()


def record_loader_calls(model: torch.nn.Module, names: Iterable[tuple[str, Sequence[int]]],
                        set_loader: Callable[[torch.nn.Parameter, Callable], Callable]) -> dict[str, list[LoaderCall]]:
    """Run ``model.load_weights`` on zero tensors (in the model's dtype, so the engine has nothing
    to convert or warn about) with every param's loader replaced by a recorder.

    Args:
        model: module with ``load_weights(iterable of (name, tensor))`` (the vLLM contract).
        names: canonical (name, shape) pairs to route.
        set_loader: installs a loader on a param and returns the previous one.

    Returns:
        Canonical name -> the loader calls ``load_weights`` made for it (empty: not on this rank).
    """
    params = dict(model.named_parameters())
    dtype = next(iter(params.values())).dtype if params else torch.float32
    calls: dict[str, list[LoaderCall]] = {}
    current = [""]

    def recorder_for(pname: str):
        def record(*args, **kwargs):
            # ``(param, loaded_weight, *rest)``, positional or by keyword (vLLM's MoE loader)
            for i, key in enumerate(("param", "loaded_weight")):
                if len(args) <= i:
                    kwargs.pop(key, None)
            calls.setdefault(current[0], []).append(LoaderCall(pname, args[2:], tuple(sorted(kwargs.items()))))
            return True  # MoE loaders are asked ``return_success=True``
        return record

    saved = {p: set_loader(param, recorder_for(p)) for p, param in params.items()}
    try:
        for name, shape in names:
            current[0] = name
            calls.setdefault(name, [])
            model.load_weights([(name, torch.zeros(tuple(shape), dtype=dtype))])
    finally:
        for p, param in params.items():
            set_loader(param, saved[p])
    return calls


def probe_model(model: torch.nn.Module, shapes: Mapping[str, Sequence[int]],
                calls: Mapping[str, Sequence[LoaderCall]], get_loader: Callable[[torch.nn.Parameter], Callable],
                dtype: torch.dtype = torch.int64, fills: Fills | None = None,
                device: str | torch.device | None = None) -> dict[str, TensorPlacement]:
    """Probe every recorded loader call; the param's data is swapped for the probe buffer meanwhile.

    Args:
        model: the engine's module (its params keep their bits: only ``.data`` is swapped).
        shapes: canonical name -> canonical shape.
        calls: from :func:`record_loader_calls`.
        get_loader: the param's real loader (``param.weight_loader`` or a default).
        dtype: probe dtype (see :func:`probe_tensor`).
        fills: collects the constants loaders write (see :func:`probe_tensor`).
        device: where the probe buffers live (default: each param's device).  ``"cpu"`` keeps the
            transient buffers (8 bytes per element of the probed param, one at a time) off a GPU
            whose memory the engine has already reserved; the loaders then copy on the host.

    Returns:
        Canonical name -> placement, for the tensors this rank holds.
    """
    params = dict(model.named_parameters())
    out: dict[str, TensorPlacement] = {}
    for name, cs in calls.items():
        for c in cs:
            param = params[c.param]
            tp = probe_tensor(name, shapes[name], c.param, tuple(param.shape),
                              _swapped(param, get_loader(param), c), dtype, device or param.device, fills)
            if tp is None:
                continue
            if name in out:
                raise PlacementError(f"{name} lands in two params: {out[name].param} and {c.param}")
            out[name] = tp
    return out


def _swapped(param: torch.nn.Parameter, loader: Callable, call: LoaderCall) -> Loader:
    def load(buf: torch.Tensor, iota: torch.Tensor) -> None:
        saved, grad = param.data, param.requires_grad
        param.requires_grad_(False)  # an integer probe buffer cannot back a param that requires grad
        param.data = buf
        try:
            loader(param, iota, *call.args, **dict(call.kwargs))
        finally:
            param.data = saved
            param.requires_grad_(grad)
    return load


def placement_to_json(placement: RankPlacement) -> dict:
    """A JSON-able form of one rank's placement (lists of ints; sent between driver and workers)."""
    return {n: dict(shape=list(tp.shape), param=tp.param, param_shape=list(tp.param_shape),
                    canon=tp.runs.canon.tolist(), local=tp.runs.local.tolist(), length=tp.runs.length.tolist(),
                    primary=[list(p) for p in tp.primary]) for n, tp in placement.items()}


_JSON_KEYS = ("shape", "param", "param_shape", "canon", "local", "length", "primary")


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
        if not len(o["canon"]) == len(o["local"]) == len(o["length"]):
            raise PlacementError(f"placement of {n}: canon, local and length differ in length")
        runs = Runs(np.array(o["canon"], np.int64), np.array(o["local"], np.int64), np.array(o["length"], np.int64))
        out[n] = TensorPlacement(n, tuple(o["shape"]), o["param"], tuple(o["param_shape"]), runs,
                                 tuple(tuple(p) for p in o["primary"]))
    return out
