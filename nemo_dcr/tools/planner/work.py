"""Every rank's share of a refit, derived from the layout tables the remap uses.

Nothing here describes a model a second time: local shard shapes, canonical targets, the
expert / TP-replicated flags and which elements map to nothing (vocabulary padding) all come
from :func:`nemo_dcr.layout.build_chunk_plans` (``ParamPlan.local_shape``, ``.targets``,
``.transform``); canonical tensors from :func:`nemo_dcr.layout.canonical_shapes`; owners from
:func:`nemo_dcr.refit.routing.assign_owners`, exactly as :class:`~nemo_dcr.refit.DeltaRefit`
assigns them.  No megatron module is built: the plans already give every shard's shape, and
``integrations/megatron/source.check_chunks`` asserts on every real build that megatron holds
exactly the plans' parameters.

Symmetry: ranks that differ only in their data-parallel or expert-parallel coordinate hold
shards of the same shapes, so one plan is built per (pipeline stage, TP rank, expert-TP rank)
and per-row facts of a parameter are cached per (pattern, local shape, TP/ETP rank).  Each
rank's own capture slice (its index in the copy-group) is still computed, from prefix sums.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Iterable

import numpy as np
import torch

from nemo_dcr.capture.ranges import split_range
from nemo_dcr.codec.stats import layer_type
from nemo_dcr.layout import MegatronSpec, ModelDims, ParallelLayout, ParamPlan, build_chunk_plans, canonical_shapes
from nemo_dcr.refit.routing import assign_owners

from .inputs import EngineDeployment, PlanSetup


@dataclass(frozen=True)
class ParamShare:
    """One local parameter of a rank class: size, flags, and where its mapped elements are."""

    numel: int
    kind: str
    """Layer type of its canonical targets (:func:`nemo_dcr.codec.stats.layer_type`)."""
    expert: bool
    tp_replicated: bool
    duplicate: bool
    targets: int
    """Canonical tensors it writes into."""
    width: int
    """Row length; every row maps to one target or to nothing (vocabulary padding)."""
    prefix: np.ndarray = field(repr=False)
    """Mapped elements before row ``r`` (length rows + 1)."""

    def mapped(self, lo: int, hi: int) -> int:
        """Canonical elements among local flat ``[lo, hi)``."""
        def upto(x: int) -> int:
            r, c = divmod(x, self.width)
            full = int(self.prefix[r])
            if c and r + 1 < self.prefix.size and self.prefix[r + 1] > self.prefix[r]:
                full += c
            return full
        return upto(hi) - upto(lo) if hi > lo else 0


def _row_mapped(pp: ParamPlan) -> tuple[int, np.ndarray]:
    """(row width, mapped-before-row prefix) of a parameter, by remapping each row's two ends."""
    width = int(pp.local_shape[-1]) if len(pp.local_shape) > 1 else 1
    rows = pp.numel // width
    starts = torch.arange(rows, dtype=torch.int64) * width
    ends = [np.zeros(rows, bool), np.zeros(rows, bool)]
    for end, idx in zip(ends, (starts, starts + width - 1)):
        for piece in pp.transform.remap(idx):
            end[piece.selection.numpy()] = True
    if not np.array_equal(*ends):
        raise ValueError(f"{pp.name}: a row maps partly to nothing; the planner counts whole rows")
    prefix = np.zeros(rows + 1, np.int64)
    np.cumsum(ends[0].astype(np.int64) * width, out=prefix[1:])
    return width, prefix


class ShareCache:
    """Per-row facts of parameters, shared by every plan whose parameter has the same structure."""

    def __init__(self):
        self._rows: dict[tuple, tuple[int, np.ndarray]] = {}

    def share(self, pp: ParamPlan, lay: ParallelLayout) -> ParamShare:
        """The :class:`ParamShare` of one parameter of a plan built for ``lay``."""
        kinds = {layer_type(t) for t in pp.targets}
        if len(kinds) != 1:
            raise ValueError(f"{pp.name}: targets of several layer types {sorted(kinds)}")
        key = (pp.pattern, pp.local_shape, lay.tp, lay.tp_rank, lay.etp, lay.etp_rank, pp.is_expert)
        if key not in self._rows:
            self._rows[key] = _row_mapped(pp)
        width, prefix = self._rows[key]
        return ParamShare(pp.numel, kinds.pop(), pp.is_expert, pp.tp_replicated, pp.duplicate_of is not None,
                          len(pp.targets), width, prefix)


@dataclass
class RankShare:
    """What one rank scans (trainer) or holds (engine), by layer type of the canonical elements."""

    side: str
    """``trainer`` or ``engine``."""
    rank: int
    node: int
    coords: dict[str, int]
    scanned: int
    """Local elements compared by capture (trainer) or held (engine, padding included)."""
    canonical: dict[str, int]
    """Layer type -> canonical elements among them."""
    records: int = 0
    """Canonical tensor pieces held (engine: the records a full delta to this rank carries)."""


def trainer_coords(t: ParallelLayout, rank: int) -> dict[str, int]:
    """Megatron's default rank order (tp-cp-ep-dp-pp, cp = 1) for the dense and the expert grid."""
    stage, i = divmod(rank, t.tp * t.dp)
    return dict(pp_rank=stage, tp_rank=i % t.tp, dp_rank=i // t.tp, etp_rank=i % t.etp,
                ep_rank=(i // t.etp) % t.ep, edp_rank=i // (t.etp * t.ep))


def engine_coords(e: EngineDeployment, rank: int, experts: bool = True) -> dict[str, int]:
    """Coordinates of an engine rank: replica, TP rank, DP rank, expert ranks (vLLM order)."""
    replica, i = divmod(rank, e.per_replica)
    etp = e.etp if experts else 1
    return dict(replica=replica, tp_rank=i % e.tp, dp_rank=i // e.tp, etp_rank=i % etp,
                ep_rank=(i // etp) % e.ep, edp_rank=i // (etp * e.ep))


def _capture_slice(p: ParamShare, c: dict[str, int], t: ParallelLayout) -> tuple[int, int]:
    """This rank's slice of a parameter: the copy-group rule of the megatron source
    (``integrations/megatron/params.replica_group``) with the even split of
    :func:`nemo_dcr.capture.ranges.split_range`."""
    if p.duplicate:
        return 0, 0
    if p.expert:
        idx, count, size, rank = c["edp_rank"], t.expert_dp, t.etp, c["etp_rank"]
    else:
        idx, count, size, rank = c["dp_rank"], t.dp, t.tp, c["tp_rank"]
    if p.tp_replicated and size > 1:
        idx, count = idx * size + rank, count * size
    return split_range(p.numel, idx, count)


def _class_params(dims: ModelDims, lay: ParallelLayout, spec: MegatronSpec, cache: ShareCache) -> list[ParamShare]:
    return [cache.share(pp, lay) for plan in build_chunk_plans(dims.family, dims, lay, spec=spec)
            for pp in plan.params.values()]


def trainer_shares(dims: ModelDims, setup: PlanSetup, spec: MegatronSpec, cache: ShareCache) -> list[RankShare]:
    """One :class:`RankShare` per trainer rank (one plan per stage / TP rank / ETP rank)."""
    t, gpn = setup.trainer, setup.hardware.gpus_per_node
    classes: dict[tuple, list[ParamShare]] = {}
    out = []
    for rank in range(t.world_size):
        c = trainer_coords(t, rank)
        key = (c["pp_rank"], c["tp_rank"], c["etp_rank"])
        if key not in classes:
            lay = replace(t, pp_rank=key[0], tp_rank=key[1], etp_rank=key[2])
            classes[key] = _class_params(dims, lay, spec, cache)
        scanned, canon = 0, {}
        for p in classes[key]:
            lo, hi = _capture_slice(p, c, t)
            scanned += hi - lo
            canon[p.kind] = canon.get(p.kind, 0) + p.mapped(lo, hi)
        out.append(RankShare("trainer", rank, rank // gpn, c, scanned, canon))
    return out


def engine_shares(dims: ModelDims, setup: PlanSetup, spec: MegatronSpec, cache: ShareCache) -> list[RankShare]:
    """One :class:`RankShare` per engine rank (every replica; each rank holds its whole shards)."""
    e, gpn = setup.engine, setup.hardware.gpus_per_node
    classes: dict[tuple, list[ParamShare]] = {}
    out = []
    for rank in range(e.world_size):
        c = engine_coords(e, rank, bool(dims.num_experts))
        key = (c["tp_rank"], c["etp_rank"])
        if key not in classes:
            lay = e.layout(bool(dims.num_experts), tp_rank=key[0], etp_rank=key[1])
            classes[key] = _class_params(dims, lay, spec, cache)
        params = [p for p in classes[key] if not p.duplicate]
        canon: dict[str, int] = {}
        for p in params:
            canon[p.kind] = canon.get(p.kind, 0) + p.mapped(0, p.numel)
        records = sum(p.targets for p in params)
        out.append(RankShare("engine", rank, rank // gpn, c, sum(p.numel for p in params), canon, records))
    return out


@dataclass
class TensorTable:
    """Every canonical tensor: size, layer type, owner trainer rank, engine copies per replica."""

    names: list[str]
    numel: np.ndarray
    kind: list[str]
    owner: np.ndarray
    copies: np.ndarray
    """Engine ranks of one replica holding each element (TP-replicated tensors: all of them)."""

    def by_owner(self, values: np.ndarray, world: int) -> np.ndarray:
        """Sum ``values`` (one per tensor) per owner rank."""
        return np.bincount(self.owner, weights=values, minlength=world)


def tensor_table(dims: ModelDims, setup: PlanSetup, spec: MegatronSpec) -> TensorTable:
    """Canonical tensors with their owners (:func:`assign_owners` over all trainer ranks) and their
    engine copies (from the engine's plans: expert tensors ``edp``, others ``dp``, times the
    TP size for TP-replicated ones)."""
    shapes = canonical_shapes(dims.family, dims)
    names = list(shapes)
    numel = np.array([int(np.prod(shapes[n])) for n in names], np.int64)
    owners = assign_owners(dict(zip(names, numel.tolist())), setup.trainer.world_size)
    copies_of = _engine_copies(dims, setup.engine, spec)
    copies = np.array([copies_of(n) for n in names], np.int64)
    return TensorTable(names, numel, [layer_type(n) for n in names],
                       np.array([owners[n] for n in names], np.int64), copies)


def _engine_copies(dims: ModelDims, e: EngineDeployment, spec: MegatronSpec) -> Callable[[str], int]:
    """Canonical name -> engine ranks of one replica holding each of its elements."""
    etp = e.etp if dims.num_experts else 1
    edp = e.per_replica // (e.ep * etp)
    flags: dict[str, tuple[bool, bool]] = {}
    for plan in build_chunk_plans(dims.family, dims, e.layout(bool(dims.num_experts)), spec=spec):
        for pp in plan.params.values():
            for t in pp.targets:
                flags[t] = (pp.is_expert, pp.tp_replicated)

    def copies(name: str) -> int:
        expert, replicated = flags.get(name, (True, False))  # experts of other EP ranks: sharded experts
        if expert:
            return edp * (etp if replicated else 1)
        return e.dp * (e.tp if replicated else 1)

    return copies


def totals(shares: Iterable[RankShare]) -> dict[str, int]:
    """Canonical elements by layer type summed over ranks."""
    out: dict[str, int] = {}
    for s in shares:
        for k, v in s.canonical.items():
            out[k] = out.get(k, 0) + v
    return out
