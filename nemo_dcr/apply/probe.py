"""Probing an engine's own ``load_weights``: where every canonical element lands, and how.

For each canonical HF tensor the engine loads, the probe learns which engine param(s) it reaches
(:func:`~.write_guard.record_writes`: loaders replaced by recorders, direct writes blocked and
recorded) and then loads, *through the engine's own* ``load_weights``, probe tensors into probe
buffers swapped in for those params (live weights keep their bits; a
:class:`~.write_guard.WriteGuard` stops any write into them):

1. an **index probe**: each element holds its global index + 1 (unique over every tensor that
   lands in the same params, so one ``load_weights`` call probes them all, experts included),
   into an integer buffer filled with -1.  Values in range are placements; other written values
   are constants the loader writes itself (vocab padding zeros) or a sign of a transform.
2. a **value probe**: finite floats of varied sign and exponent in the canonical dtype, into a
   buffer of the param's own dtype filled with a NaN pattern.  A plain copy puts each element's
   bits at its placed position and repeats the constants; anything else (``A = -exp(A_log)``, a
   dtype change, values that depend on the input where the index probe saw constants) marks the
   tensor **transformed**.

Each tensor gets a kind (:class:`Kind`): **in place** (every element one canonical element's bits:
sparse writes are exact), **transformed** (refit by reloading the touched tensor through the
engine's loader from a canonical *shadow* copy the engine keeps, param name :data:`SHADOW` +
name), or **skipped** (``load_weights`` loads nothing of it).  Params no canonical tensor writes
are **unwritten**; an engine integration refines them (derived by post-load processing,
rearranged by a kernel backend, see ``nemo_dcr.integrations.vllm.kinds``).

Cost: one ``load_weights`` call per canonical tensor to record, two per group of params that
share tensors to probe (all experts of a fused param in one), one pass over each param per probe,
scanned in chunks; memory: the probe buffers of one group (about 10 bytes per element of a bf16
param) at a time, plus one probe tensor and temporaries bounded by :data:`CHUNK` elements (value
probes are computed a chunk at a time, :func:`probe_tensor`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, Iterator, Mapping, Sequence

import numpy as np
import torch

from nemo_dcr.types import int_view

from .placement import Fills, Runs, TensorPlacement
from .write_guard import Protected, WriteGuard, Writes, live_tensors, record_writes

SHADOW = "dcr.shadow:"
"""Param-name prefix of the canonical copy an engine keeps of each transformed tensor."""

CHUNK = 1 << 22
"""Elements of a probe buffer scanned at a time (bounds the scan's temporaries)."""

_FILLER = {2: 0x7FC3, 4: 0x7FC00003}
"""A NaN bit pattern per width: what a value-probe buffer holds where nothing was written."""


class Kind(str, Enum):
    """How a refit keeps one engine param (or buffer) equal to the engine's own dense load."""

    IN_PLACE = "in_place"
    """Every element is one canonical element's bits: sparse writes in place are exact."""
    TRANSFORMED = "transformed"
    """Loaded through a value transform (or a dtype change, or by a ``load_weights`` that bypasses
    the param's loader with more than a copy): touched tensors are reloaded through the loader."""
    DERIVED = "derived"
    """Computed by post-load processing from other params: re-run for the touched layers."""
    REARRANGED = "rearranged"
    """Rearranged after load by the kernel backend: mapped through its known shuffle, or refused."""
    UNWRITTEN = "unwritten"
    """Written by no canonical tensor (constants, caches): a refit leaves it as a fresh load does."""


@dataclass(frozen=True)
class ParamTruth:
    """One engine param's or buffer's kind.

    Attributes:
        name: engine param name (``buffer:<name>`` for a buffer).
        kind: its :class:`Kind`.
        sources: canonical tensors that land in it (or that it is derived from).
        how: how a refit keeps it exact.
        refused: why it cannot be refit (non-empty: the engine is refused before the first sync).
    """

    name: str
    kind: Kind
    sources: tuple[str, ...] = ()
    how: str = ""
    refused: str = ""


@dataclass(frozen=True)
class ProbeStats:
    """What probing cost: seconds (recording included), ``load_weights`` calls, params probed and
    the largest probe memory held at once (probe buffers plus one probe tensor, bytes)."""

    seconds: float
    record_seconds: float
    load_calls: int
    params: int
    peak_bytes: int


@dataclass
class Probe:
    """Result of :func:`probe_engine` for one engine rank.

    Attributes:
        placement: canonical name -> where this rank holds it (in-place tensors in their engine
            param, transformed ones whole in their shadow ``SHADOW + name``); no primary yet.
        reload: transformed canonical name -> the engine params its load writes.
        fills: constants the loaders write (``{param: [(positions, values)]}``).
        params: engine param -> its kind.
        skipped: canonical name -> why the engine does not load it.
        refusals: what (param or canonical name) -> why it cannot be refit.
        stats: the probe's cost.
    """

    placement: dict[str, TensorPlacement]
    reload: dict[str, tuple[str, ...]]
    fills: Fills
    params: dict[str, ParamTruth]
    skipped: dict[str, str]
    refusals: dict[str, str]
    stats: ProbeStats


def shadow_placement(name: str, shape: Sequence[int]) -> TensorPlacement:
    """The placement of a transformed tensor: every element, in order, in its shadow."""
    n = int(np.prod(shape)) if len(shape) else 1
    runs = Runs(np.zeros(1, np.int64), np.zeros(1, np.int64), np.array([n], np.int64))
    return TensorPlacement(name, tuple(shape), SHADOW + name, (n,), runs)


def probe_values(g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Value-probe elements for global indices ``g``: ``±2^e (1 + m/128)``, ``e`` in [-6, 6]
    (finite and normal in bf16, fp16, fp32 and fp8 e4m3), drawn from a hash of the index."""
    h = (g * 0x9E3779B97F4A7C15) & 0x7FFFFFFFFFFFFFFF
    sign = 1.0 - 2.0 * ((h >> 11) & 1).double()
    e = ((h >> 12) % 13).double() - 6
    m = ((h >> 20) & 0x7F).double() / 128
    return (sign * torch.pow(2.0, e) * (1 + m)).to(dtype)


def probe_tensor(offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """:func:`probe_values` of global indices ``offset .. offset + numel - 1`` (flat), computed
    :data:`CHUNK` elements at a time: its float64 temporaries stay bounded by a chunk, not by the tensor."""
    out = torch.empty(numel, dtype=dtype)
    for lo in range(0, numel, CHUNK):
        hi = min(numel, lo + CHUNK)
        out[lo:hi] = probe_values(torch.arange(offset + lo, offset + hi, dtype=torch.int64), dtype)
    return out


def _components(writes: Mapping[str, Writes]) -> list[tuple[list[str], list[str]]]:
    """Groups of (canonical names, params) connected by writes, in name order."""
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for name, w in writes.items():
        for p in w.params:
            parent[find("t:" + name)] = find("p:" + p)
    groups: dict[str, tuple[list[str], list[str]]] = {}
    for name, w in sorted(writes.items()):
        if w.params:
            groups.setdefault(find("t:" + name), ([], []))[0].append(name)
    for p in sorted({p for w in writes.values() for p in w.params}):
        groups[find("p:" + p)][1].append(p)
    return list(groups.values())


@dataclass
class _Found:
    """What the index probe found in one param."""

    runs: dict[str, list[Runs]] = field(default_factory=dict)
    const_pos: list[np.ndarray] = field(default_factory=list)
    const_val: list[np.ndarray] = field(default_factory=list)
    duplicated: set[str] = field(default_factory=set)


class _Group:
    """One group of canonical tensors and the params they land in, probed together."""

    def __init__(self, model, names, pnames, shapes, dtypes, device, protected: Protected):
        self.model, self.names, self.pnames = model, names, pnames
        self.params = dict(model.named_parameters())
        self.shapes, self.dtypes = shapes, dtypes
        self.numel = {n: int(np.prod(shapes[n])) if len(shapes[n]) else 1 for n in names}
        self.offset = dict(zip(names, np.cumsum([0] + [self.numel[n] for n in names[:-1]]).tolist()))
        self.starts = np.array([self.offset[n] for n in names], np.int64)
        self.total = sum(self.numel.values())
        self.index_dtype = torch.int32 if self.total < 2**31 - 2 else torch.int64
        self.device, self.protected = device, protected
        self.calls, self.peak = 0, 0
        self.blocked: list[tuple[str, str, str]] = []

    def _device(self, p: str):
        return self.device or self.params[p].device

    def _load(self, bufs: dict[str, torch.Tensor], make: Callable[[str], torch.Tensor]) -> list[str]:
        """``load_weights`` of every name of the group (``make(name)``) into ``bufs``; returns the
        params whose loader replaced the buffer instead of writing into it."""
        guard = WriteGuard(self.protected)
        saved = {}
        for p, buf in bufs.items():
            param = self.params[p]
            saved[p] = (param.data, param.requires_grad)
            param.requires_grad_(False)  # an integer probe buffer cannot back a param that requires grad
            param.data = buf

        def items() -> Iterator[tuple[str, torch.Tensor]]:
            for n in self.names:
                guard.label = n
                yield n, make(n)
        try:
            with torch.no_grad(), guard:
                self.model.load_weights(items())
            return [p for p, buf in bufs.items() if self.params[p].data.data_ptr() != buf.data_ptr()]
        finally:
            self.calls += 1
            self.blocked += guard.blocked
            for p, (data, grad) in saved.items():
                self.params[p].data = data
                self.params[p].requires_grad_(grad)

    def index_probe(self) -> tuple[dict[str, _Found], list[str]]:
        bufs = {p: torch.full(tuple(self.params[p].shape), -1, dtype=self.index_dtype, device=self._device(p))
                for p in self.pnames}
        biggest = max(self.numel.values()) * self.index_dtype.itemsize
        self.peak = max(self.peak, sum(b.numel() * b.element_size() for b in bufs.values()) + biggest)

        def iota(n: str) -> torch.Tensor:
            o = self.offset[n]
            return torch.arange(o + 1, o + self.numel[n] + 1, dtype=self.index_dtype).reshape(tuple(self.shapes[n]))
        replaced = self._load(bufs, iota)
        return {p: self._scan(bufs[p]) for p in self.pnames}, replaced

    def _scan(self, buf: torch.Tensor) -> _Found:
        found = _Found()
        flat = buf.reshape(-1)
        for lo in range(0, flat.numel(), CHUNK):
            x = flat[lo:lo + CHUNK]
            placed = (x >= 1) & (x <= self.total)
            const = (x != -1) & ~placed
            if const.any():
                found.const_pos.append((torch.nonzero(const).reshape(-1) + lo).cpu().numpy())
                found.const_val.append(x[const].to(torch.float64).cpu().numpy())
            local = (torch.nonzero(placed).reshape(-1) + lo).cpu().numpy()
            g = x[placed].to(torch.int64).cpu().numpy() - 1
            order = np.argsort(g, kind="stable")
            g, local = g[order], local[order]
            nid = np.searchsorted(self.starts, g, side="right") - 1
            for i in np.unique(nid):
                sel = nid == i
                name, c = self.names[i], g[sel] - self.starts[i]
                if np.any(np.diff(c) == 0):
                    found.duplicated.add(name)
                    continue
                found.runs.setdefault(name, []).append(Runs.from_sorted(c, local[sel]))
        return found

    def value_probe(self, found: dict[str, _Found]) -> tuple[set[str], Fills, dict[str, str]]:
        """Names whose load is not a plain copy into some param, the constants (fills), and the
        params that cannot hold canonical values at all (not 16- or 32-bit floats)."""
        transformed, fills, refused = set(), {}, {}
        bufs = {}
        for p in self.pnames:
            param = self.params[p]
            width = param.element_size()
            if not param.dtype.is_floating_point or width not in _FILLER:
                refused[p] = f"dtype {param.dtype}: canonical tensors land in it, but it holds no bf16/fp16/fp32 values"
                continue
            buf = torch.empty(tuple(param.shape), dtype=param.dtype, device=self._device(p))
            int_view(buf).fill_(_FILLER[width])
            bufs[p] = buf
        # the largest probe tensor (its float64 temporaries are bounded by a chunk: probe_tensor)
        biggest = max(self.numel[n] * self.dtypes.get(n, torch.bfloat16).itemsize for n in self.names)
        self.peak = max(self.peak, sum(b.numel() * (b.element_size() + 1) for b in bufs.values()) + biggest)

        def values(n: str) -> torch.Tensor:
            return probe_tensor(self.offset[n], self.numel[n], self.dtypes.get(n, torch.bfloat16)
                                ).reshape(tuple(self.shapes[n]))
        replaced = self._load(bufs, values)
        for p in replaced:
            transformed.update(found[p].runs)
        for p, buf in bufs.items():
            bad, consts = self._check(p, buf, found[p])
            transformed |= bad
            if consts is not None:
                fills[p] = [consts]
        return transformed, fills, refused

    def _check(self, p: str, buf: torch.Tensor, found: _Found) -> tuple[set[str], tuple | None]:
        """Compare one value-probe buffer with the index probe's placements and constants."""
        flat, bits = buf.reshape(-1), int_view(buf)
        seen = torch.zeros(flat.numel(), dtype=torch.bool, device=flat.device)
        bad = set()
        for name, parts in found.runs.items():
            exact = self.dtypes.get(name, torch.bfloat16) == buf.dtype
            for canon, local in Runs.merged(parts).pieces(CHUNK):
                where = torch.from_numpy(local).to(flat.device)
                seen[where] = True
                if exact:
                    want = probe_values(torch.from_numpy(canon + self.offset[name]), buf.dtype).to(flat.device)
                    exact = torch.equal(bits[where], int_view(want))
            if not exact:
                bad.add(name)
        consts = None
        if found.const_pos:
            pos = np.concatenate(found.const_pos)
            where = torch.from_numpy(pos).to(flat.device)
            seen[where] = True
            consts = (pos, flat[where].double().cpu().numpy())
            if not np.array_equal(consts[1], np.concatenate(found.const_val)):
                consts = None  # values that follow the input: not constants (a transform)
                bad |= set(found.runs) or set(self.names)
        filler = torch.tensor(_FILLER[buf.element_size()], dtype=bits.dtype, device=flat.device)
        stray = any(bool(((bits[lo:lo + CHUNK] != filler) & ~seen[lo:lo + CHUNK]).any())
                    for lo in range(0, flat.numel(), CHUNK))
        if stray:
            bad |= set(found.runs) or set(self.names)  # writes the index probe cannot explain: not a copy
            consts = None
        return bad, consts


def probe_engine(model: torch.nn.Module, shapes: Mapping[str, Sequence[int]],
                 set_loader: Callable[[torch.nn.Parameter, Callable], Callable],
                 dtypes: Mapping[str, torch.dtype] | None = None,
                 device: str | torch.device | None = None) -> Probe:
    """Probe where and how every canonical tensor lands in ``model`` (one engine rank).

    Args:
        model: module with ``load_weights(iterable of (name, tensor))`` (the vLLM contract).
        shapes: canonical name -> canonical shape.
        set_loader: installs a loader on a param and returns the previous one.
        dtypes: canonical name -> canonical dtype (default bf16).
        device: where probe buffers live (default: each param's device; ``"cpu"`` keeps them off
            a GPU whose memory the engine has reserved).

    A canonical tensor ``load_weights`` fails on (a param replaced after load) is refused, named
    in :attr:`Probe.refusals` with the error.
    """
    t0 = time.perf_counter()
    dtypes = dict(dtypes or {})
    refusals: dict[str, str] = {}
    writes = record_writes(model, shapes, set_loader, dtypes, refusals)
    t_record = time.perf_counter() - t0
    skipped = {n: "the engine's load_weights loads nothing of it" for n, w in writes.items()
               if not w.params and n not in refusals}
    refusals.update({n: f"load_weights writes buffers directly: {[p for p in w.direct if p.startswith('buffer:')]}"
                     for n, w in writes.items() if any(p.startswith("buffer:") for p in w.direct)})
    protected = Protected(live_tensors(model))
    result = _Assembly(model, shapes)
    calls, peak, nparams = 0, 0, 0
    for names, pnames in _components({n: w for n, w in writes.items() if n not in refusals}):
        group = _Group(model, names, pnames, shapes, dtypes, device, protected)
        try:
            found, replaced = group.index_probe()
        except Exception as exc:  # e.g. a param reshaped after load: its loader rejects the load-time shape
            why = f"the engine's load_weights fails on a probe tensor of the checkpoint's shape " \
                  f"({type(exc).__name__}: {str(exc)[:200]}): rearranged after load?"
            refusals.update({p: why for p in pnames})
            calls += group.calls
            continue
        transformed, fills, bad_params = group.value_probe(found)
        result.refusals.update(bad_params)
        result.add(group, found, transformed | {n for p in replaced for n in found[p].runs}, fills, writes)
        calls, peak, nparams = calls + group.calls, max(peak, group.peak), nparams + len(pnames)
    refusals.update(result.refusals)
    stats = ProbeStats(time.perf_counter() - t0, t_record, calls + len(shapes), nparams, peak)
    return Probe(result.placement, result.reload, result.fills, result.kinds(), skipped, refusals, stats)


class _Assembly:
    """Placements, reloads, fills and refusals collected over the groups."""

    def __init__(self, model: torch.nn.Module, shapes: Mapping[str, Sequence[int]]):
        self.model, self.shapes = model, shapes
        self.params = dict(model.named_parameters())
        self.placement: dict[str, TensorPlacement] = {}
        self.reload: dict[str, tuple[str, ...]] = {}
        self.fills: Fills = {}
        self.refusals: dict[str, str] = {}
        self.sources: dict[str, set[str]] = {}

    def add(self, group: _Group, found: dict[str, _Found], transformed: set[str], fills: Fills,
            writes: Mapping[str, Writes]) -> None:
        for label, owner, op in group.blocked:
            self.refusals.setdefault(label, f"probing it wrote {owner} ({op}), which recording did not see")
        for name in group.names:
            where = [p for p in group.pnames if name in found[p].runs]
            if name in transformed:
                self.placement[name] = shadow_placement(name, self.shapes[name])
                self.reload[name] = writes[name].params
                for p in writes[name].params:
                    self.sources.setdefault(p, set()).add(name)
                continue
            if len(where) > 1:
                self.refusals[name] = f"lands in {len(where)} params: {where}"
                continue
            for p in where:
                if not self.params[p].data.is_contiguous():
                    self.refusals[p] = "not contiguous: an in-place write would go to a copy"
                runs = Runs.merged(found[p].runs[name])
                self.placement[name] = TensorPlacement(name, tuple(self.shapes[name]), p,
                                                       tuple(self.params[p].shape), runs)
                self.sources.setdefault(p, set()).add(name)
        for p, entries in fills.items():
            self.fills.setdefault(p, []).extend(entries)

    def kinds(self) -> dict[str, ParamTruth]:
        out = {}
        for p in self.params:
            src = tuple(sorted(self.sources.get(p, ())))
            if any(s in self.reload for s in src):
                out[p] = ParamTruth(p, Kind.TRANSFORMED, src, "touched tensors reloaded through the engine's loader",
                                    self.refusals.get(p, ""))
            elif src:
                out[p] = ParamTruth(p, Kind.IN_PLACE, src, "sparse writes in place", self.refusals.get(p, ""))
            else:
                out[p] = ParamTruth(p, Kind.UNWRITTEN, (), "not written by a refit")
        return out
