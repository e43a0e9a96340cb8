"""The trainer source of a Megatron-Core model: what :class:`nemo_dcr.refit.DeltaRefit` reads.

* ``params``: this rank's live params keyed by :attr:`LocalParam.key` (unique over virtual
  pipeline chunks: ``model{c}.name`` on chunk ``c > 0``).
* ``ranges``: the flat slice of each param this rank captures.  With Megatron's distributed
  optimizer (DDP-wrapped chunks with ``use_distributed_optimizer``) it is the slice of the param
  buffer this DP rank owns and updates (:func:`.ddp.ranges_from_ddp`), so capture reads values the
  rank wrote itself (immune to ``overlap_param_gather``); otherwise each copy-group of identical
  params splits them evenly (:func:`.params.capture_ranges`).  The tied output-layer copy is
  captured by nobody.
* ``remap``: one layout plan per model chunk (:func:`nemo_dcr.layout.build_chunk_plans`), so chunk
  ``c`` is remapped with its own layer offsets.
* ``checksums`` / ``pieces``: partial canonical checksums of the captured slices by a full scan
  of the live params, or of a sampled check's slice of them (the trainer's side of verification;
  independent of capture baseline and codec), and every captured element as canonical pieces
  (the first sync).  Both run at memory
  speed over :class:`Runs`: each captured slice cut into runs that are contiguous both locally and
  canonically (every transform of the tables keeps the last dim of a row contiguous), found once
  by remapping the two ends and the middle of every row; a row that does not pass that check is
  remapped element by element.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping

import numpy as np
import torch

from nemo_dcr.layout import LayoutError, MegatronSpec, ModelDims, ParallelLayout, build_chunk_plans, chunk_layers
from nemo_dcr.kernels.cpu import map_runs
from nemo_dcr.kernels.traffic import host_bits
from nemo_dcr.types import SparseDelta, spec_of
from nemo_dcr.verify.checksum import MASK64
from nemo_dcr.verify.sample import Sample, runs_checksum

from .params import LocalParam, capture_ranges, local_params, unwrap


@dataclass(frozen=True)
class Runs:
    """Local flat ``[local, local + length)`` holds canonical ``[canon, canon + length)`` of one tensor."""

    local: np.ndarray
    canon: np.ndarray
    length: np.ndarray

    def expand(self, lo: int = 0, hi: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(local, canonical) flat indices of runs ``lo:hi``."""
        loc, can, n = self.local[lo:hi], self.canon[lo:hi], self.length[lo:hi]
        rep = np.repeat(np.arange(n.size), n)
        k = np.arange(int(n.sum()), dtype=np.int64) - np.repeat(np.cumsum(n) - n, n)
        return loc[rep] + k, can[rep] + k


@dataclass(frozen=True)
class RunTable:
    """Every run of one param's captured slice, over all its canonical tensors, sorted by local
    start: what :meth:`MegatronSource.remap` maps increasing positions through
    (:func:`nemo_dcr.kernels.cpu.map_runs`), in place of the transforms' index arithmetic.

    ``names`` are the canonical tensors in the order the plan's transform gives its pieces, so
    the pieces come out as the transform's would (same order, same entries in each)."""

    names: tuple[str, ...]
    start: np.ndarray
    length: np.ndarray
    canon: np.ndarray
    target: np.ndarray

    @classmethod
    def of(cls, runs: Mapping[str, Runs], transform) -> "RunTable | None":
        """The table of ``runs`` (canonical name -> runs); ``transform(idx)`` the plan's remap of
        local positions, which orders the names.  None when there are no runs, or when the
        transform's pieces do not name exactly the runs' tensors."""
        if not runs:
            return None
        starts = np.concatenate([r.local for r in runs.values()])
        names = tuple(p.name for p in transform(torch.from_numpy(np.sort(starts))))
        if sorted(names) != sorted(runs):
            return None
        target = np.concatenate([np.full(r.local.size, names.index(n), np.int64) for n, r in runs.items()])
        length = np.concatenate([r.length for r in runs.values()])
        canon = np.concatenate([r.canon for r in runs.values()])
        order = np.argsort(starts, kind="stable")
        start, length, canon, target = (np.ascontiguousarray(a[order], np.int64) for a in (starts, length, canon, target))
        if np.any(start[1:] < start[:-1] + length[:-1]):
            return None  # overlapping runs: never built by _row_runs, but the walk needs them disjoint
        return cls(names, start, length, canon, target)

    def pieces(self, delta: SparseDelta, canonical: Mapping[str, tuple[str, tuple[int, ...]]]) -> list[SparseDelta] | None:
        """Canonical pieces of ``delta`` (local positions of this param), in the transform's
        order; None when a position lies in no run or the positions do not increase."""
        pos = np.ascontiguousarray(delta.positions, np.int64)
        bad, sel, index, counts = map_runs(pos, self.start, self.length, self.canon, self.target, len(self.names))
        if bad >= 0:
            return None
        out, a = [], 0
        for name, c in zip(self.names, counts.tolist()):
            if not c:
                continue
            if c == pos.size:  # every entry, in order: the bits as they are
                new, old = delta.new_bits, delta.old_bits
            else:
                s = sel[a:a + c]
                new, old = delta.new_bits[s], None if delta.old_bits is None else delta.old_bits[s]
            out.append(SparseDelta(name, delta.dtype, canonical[name][1], index[a:a + c], new, old))
            a += c
        return out


class MegatronSource:
    """One rank's chunks as a :class:`~nemo_dcr.refit.source.TrainerSource`.

    Args:
        chunks: this rank's model chunks (Megatron's model list; DDP-wrapped or not).
        dims: the model description (see :func:`.describe.dims_from_model`).
        layout: this rank's parallel layout.
        spec: the layer spec that built the model.
        ranges: capture ranges by key (None: from the DDP buffers when the chunks use the
            distributed optimizer, else an even split per copy-group).

    Raises:
        LayoutError: the chunks' params or layers differ from the layout plans (names both sides).
    """

    def __init__(self, chunks: list[torch.nn.Module], dims: ModelDims, layout: ParallelLayout,
                 spec: MegatronSpec = MegatronSpec(), ranges: Mapping[str, tuple[int, int]] | None = None):
        self.dims, self.layout = dims, layout
        self.plans = build_chunk_plans(dims.family, dims, layout, spec=spec)
        if len(self.plans) != len(chunks):
            raise LayoutError(f"{len(chunks)} model chunks on this rank, the layout expects {len(self.plans)} (vpp)")
        check_chunks(chunks, self.plans, dims)
        self.local: dict[str, LocalParam] = {lp.key: lp for lp in local_params(chunks, dims)}
        dtypes = {lp.param.dtype for lp in self.local.values()}
        if len(dtypes) != 1:
            raise LayoutError(f"params of several dtypes {sorted(map(str, dtypes))}: one serving dtype expected")
        wire = spec_of(dtypes.pop()).name
        self.params = {k: lp.param for k, lp in self.local.items()}
        skip = {k for k, lp in self.local.items() if self.plans[lp.chunk].lookup(lp.name).duplicate_of}
        self.ranges = dict(ranges if ranges is not None else _ddp_ranges(chunks, self.local) or
                           capture_ranges(list(self.local.values()), skip))
        for k in skip:
            self.ranges[k] = (0, 0)
        self.canonical = {n: (wire, tuple(s)) for n, s in self.plans[0].canonical_shapes().items()}
        self._runs: dict[str, dict[str, Runs]] = {}
        self._tables: dict[str, RunTable | None] = {}

    def remap(self, delta: SparseDelta) -> list[SparseDelta]:
        """Canonical pieces of one local delta (cost ∝ changes).

        Positions inside the captured slice go through its runs (:class:`RunTable`: one compiled
        merge walk); any other delta (a position outside every run, e.g. vocabulary padding or
        outside the slice, or positions not increasing) through the layout plan's transforms,
        which give the same pieces (and name an out-of-range position)."""
        lp = self.local[delta.name]
        table = self._table(delta.name)
        if table is not None and delta.nnz:
            pieces = table.pieces(delta, self.canonical)
            if pieces is not None:
                return pieces
        res = self.plans[lp.chunk].remap(lp.name, torch.from_numpy(delta.positions))
        out = []
        for piece in res:
            sel = piece.selection.numpy()
            old = None if delta.old_bits is None else delta.old_bits[sel]
            out.append(SparseDelta(piece.name, delta.dtype, self.canonical[piece.name][1],
                                   piece.index.numpy().astype(np.int64), delta.new_bits[sel], old))
        return out

    def _table(self, key: str) -> "RunTable | None":
        """The :class:`RunTable` of ``key``'s captured slice (built once; None: no runs)."""
        if key not in self._tables:
            lp = self.local[key]
            self._tables[key] = RunTable.of(self.runs(key), lambda idx: self.plans[lp.chunk].remap(lp.name, idx))
        return self._tables[key]

    def runs(self, key: str) -> dict[str, Runs]:
        """Canonical tensor -> runs of the captured slice of ``key`` (built once, then cached)."""
        if key not in self._runs:
            lp, (lo, hi) = self.local[key], self.ranges[key]
            width = int(lp.param.shape[-1]) if lp.param.dim() else 1
            self._runs[key] = _row_runs(self.plans[lp.chunk], lp.name, lo, hi, width)
        return self._runs[key]

    def captured(self) -> dict[str, int]:
        """Canonical name -> elements of it in the captured slices (from the runs)."""
        out: dict[str, int] = {}
        for key in self.ranges:
            for name, runs in self.runs(key).items():
                out[name] = out.get(name, 0) + int(runs.length.sum())
        return out

    def checksums(self, sample: Sample | None = None) -> dict[str, int]:
        """Partial canonical checksums of the captured slices: a full scan of the live params, or
        ``sample``'s slice of them (:func:`nemo_dcr.verify.sample.runs_checksum` over the runs)."""
        sums: dict[str, int] = {}
        for key in self.ranges:
            bits = host_bits(self.local[key].param)
            for name, runs in self.runs(key).items():
                part = runs_checksum(bits, runs.local, runs.canon, runs.length, sample, name)
                sums[name] = (sums.get(name, 0) + part) & MASK64
        return sums

    def pieces(self) -> list[SparseDelta]:
        """Every captured element as canonical pieces with zero old bits (the first sync)."""
        out = []
        for key in self.ranges:
            param = self.local[key].param
            bits, wire = host_bits(param), spec_of(param.dtype)
            for name, runs in self.runs(key).items():
                local, canon = runs.expand()
                order = np.argsort(canon, kind="stable")
                out.append(SparseDelta(name, wire.name, self.canonical[name][1], canon[order],
                                       bits[local[order]], np.zeros(canon.size, wire.uint)))
        return out


def _row_runs(plan, name: str, lo: int, hi: int, width: int) -> dict[str, Runs]:
    """Runs of local ``[lo, hi)``: one per row segment whose ends and middle remap contiguously."""
    if hi <= lo:
        return {}
    first = lo // width * width
    starts = np.maximum(np.arange(first, hi, width, dtype=np.int64), lo)
    ends = np.minimum(starts - starts % width + width, hi)
    probes = [starts, ends - 1, (starts + ends - 1) // 2]
    where = [_where(plan, name, p) for p in probes]
    (t0, c0), (t1, c1), (tm, cm) = where
    ok = (t0 == t1) & (t0 == tm) & (c1 - c0 == ends - 1 - starts) & (cm - c0 == (starts + ends - 1) // 2 - starts)
    out: dict[str, list] = {}
    names = plan.lookup(name).targets
    for t, tname in enumerate(names):
        sel = ok & (t0 == t)
        out.setdefault(tname, []).append((starts[sel], c0[sel], (ends - starts)[sel]))
    for s_, e_ in zip(starts[~ok], ends[~ok]):  # rows the check did not vouch for: element by element
        idx = torch.arange(int(s_), int(e_), dtype=torch.int64)
        for piece in plan.remap(name, idx):
            loc = idx[piece.selection].numpy()
            out.setdefault(piece.name, []).append((loc, piece.index.numpy(), np.ones(loc.size, np.int64)))
    runs = {}
    for tname, parts in out.items():
        loc, can, n = (np.concatenate([p[i] for p in parts]).astype(np.int64) for i in range(3))
        keep = n > 0
        runs[tname] = Runs(loc[keep], can[keep], n[keep])
    return {k: v for k, v in runs.items() if v.length.size}


def _where(plan, name: str, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(target tensor number, canonical index) of each local index; -1 where it maps to nothing."""
    targets = plan.lookup(name).targets
    tid = np.full(idx.size, -1, np.int64)
    can = np.full(idx.size, -1, np.int64)
    for piece in plan.remap(name, torch.from_numpy(idx)):
        sel = piece.selection.numpy()
        tid[sel] = targets.index(piece.name)
        can[sel] = piece.index.numpy()
    return tid, can


def check_chunks(chunks: list[torch.nn.Module], plans, dims: ModelDims) -> list[list[int]]:
    """Global layers of each chunk; raise unless megatron built what the plans expect.

    Compares, chunk by chunk, the parameter names megatron built with the plan's names, and the
    global layer numbers (``layer_number - 1``) with ``chunk_layers``' offsets.
    """
    out = []
    for c, (model, plan) in enumerate(zip((unwrap(m) for m in chunks), plans)):
        built = {n for n, _ in model.named_parameters()}
        if built != set(plan.params):
            raise LayoutError(
                f"chunk {c}: megatron params not in the layout tables {sorted(built - set(plan.params))[:6]}, "
                f"table params not built {sorted(set(plan.params) - built)[:6]}")
        layers = [layer.layer_number - 1 for layer in model.decoder.layers]
        offset, count = chunk_layers(dims.num_layers, plan.layout, c)
        if layers != list(range(offset, offset + count)):
            raise LayoutError(f"chunk {c}: megatron built layers {layers}, the layout expects "
                              f"{list(range(offset, offset + count))}")
        out.append(layers)
    return out


def _ddp_ranges(chunks, local: Mapping[str, LocalParam]) -> dict[str, tuple[int, int]] | None:
    """Capture ranges from DDP buffers when every chunk uses the distributed optimizer."""
    ddps = [c for c in chunks if getattr(getattr(c, "ddp_config", None), "use_distributed_optimizer", False)]
    if not ddps:
        return None
    if len(ddps) != len(chunks):
        raise LayoutError("some chunks use the distributed optimizer and some do not")
    from .ddp import ranges_from_ddp

    keys = {id(lp.param): k for k, lp in local.items()}
    out: dict[str, tuple[int, int]] = {}
    for ddp in ddps:
        out.update(ranges_from_ddp(ddp, {p: keys[id(p)] for p in ddp.parameters() if id(p) in keys}))
    return out


def source_from_model(model, *, vocab_size: int | None = None, num_layers_in_first_pipeline_stage: int | None = None,
                      num_layers_in_last_pipeline_stage: int | None = None) -> MegatronSource | None:
    """The source of megatron-core chunks (a list of GPTModel, possibly wrapped), or None for
    anything else (so other registered frameworks get their turn).  The uneven-pipeline knobs are
    megatron's (and :class:`~nemo_dcr.layout.ParallelLayout`'s) fields of the same names."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    if not chunks or not all(type(unwrap(c)).__module__.startswith("megatron.") for c in chunks):
        return None
    from .topology import parallel_layout_from_state
    from .describe import dims_from_model, layer_spec

    dims = dims_from_model(list(chunks), vocab_size)
    layout = parallel_layout_from_state(num_layers_in_first_pipeline_stage, num_layers_in_last_pipeline_stage)
    if not dims.num_experts and layout.ep == 1 and layout.etp > 1:
        # megatron defaults expert_tensor_parallel_size to tp; a dense model has no expert params
        layout = replace(layout, etp=1, etp_rank=0)
    return MegatronSource(list(chunks), dims, layout, layer_spec(list(chunks)))
