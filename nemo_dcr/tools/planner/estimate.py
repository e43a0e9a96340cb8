"""``make_plan``: a model, a setup and the figures -> a :class:`Plan` (per-rank rows, the critical
path, the dense and export-then-diff comparisons, and what a time target takes)."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from nemo_dcr.layout import MegatronSpec, ModelDims

from .baselines import dense_refit, export_then_diff
from .cost import PathSegment, is_root, RankCost, TensorCosts, add_link_seconds, critical_path, engine_costs, trainer_costs
from .figures import Figures
from .inputs import PlanSetup
from .work import RankShare, ShareCache, TensorTable, engine_shares, tensor_table, trainer_shares

PLAN_SPEC = MegatronSpec(transformer_engine=True, moe_grouped_gemm=True)
"""The layer spec of a GPU training job (TE layers, TE grouped experts); shard shapes and flags
match the local spec except for MLA down-projections (replicated under TE)."""


@dataclass
class Plan:
    """Everything one plan computed."""

    model: str
    dims: ModelDims
    setup: PlanSetup
    fig: Figures
    trainers: list[RankCost]
    engines: list[RankCost]
    path: list[PathSegment]
    dense: dict
    export_diff: dict
    tensors: TensorCosts
    params: int
    build_seconds: float
    """Wall seconds of this plan (shares included when they were computed for it)."""
    build_cpu_seconds: float
    """CPU seconds of the same (the wall clock also counts other processes on a shared machine)."""
    notes: list[str]
    shares: "Shares"

    @property
    def refit_seconds(self) -> float:
        """Critical path of the delta refit."""
        return sum(p.seconds for p in self.path)

    @property
    def changed(self) -> float:
        """Expected changed canonical elements per refit."""
        return float(self.tensors.changes.sum())

    @property
    def payload_bytes(self) -> float:
        """Bytes the engine ranks receive (every engine rank's records, every replica)."""
        return sum(c.payload_bytes for c in self.engines)

    @property
    def cross_link_bytes(self) -> float:
        """Bytes the owners put on the trainer-to-engine link (``fanout: relay``: once per view)."""
        return sum(c.payload_bytes for c in self.trainers)

    @property
    def engine_fanout_bytes(self) -> float:
        """Bytes the relay roots pass on to the other replicas (``fanout: relay``; else 0): what the
        replicas that are no root receive."""
        if self.setup.fanout != "relay":
            return 0.0
        return sum(c.payload_bytes for c in self.engines if not is_root(c, self.setup))


@dataclass
class Shares:
    """What every rank holds and every tensor's owner: independent of figures and codec device."""

    table: TensorTable
    trainers: list[RankShare]
    engines: list[RankShare]
    seconds: float


def rank_shares(dims: ModelDims, setup: PlanSetup, spec: MegatronSpec = PLAN_SPEC) -> Shares:
    """Every rank's share of the model, from the layout tables (the slow part of a plan)."""
    t0 = time.perf_counter()
    setup.validate(dims)
    cache = ShareCache()
    table = tensor_table(dims, setup, spec)
    trainers, engines = trainer_shares(dims, setup, spec, cache), engine_shares(dims, setup, spec, cache)
    return Shares(table, trainers, engines, time.perf_counter() - t0)


def make_plan(model: str, dims: ModelDims, setup: PlanSetup, fig: Figures, spec: MegatronSpec = PLAN_SPEC,
              notes: list[str] | None = None, shares: Shares | None = None) -> Plan:
    """Plan one refit of ``dims`` on ``setup`` with the figures ``fig``.

    Args:
        shares: reuse the rank shares of another plan of the same layouts (e.g. other figures).

    Raises:
        LayoutError: a layout the model cannot take (names what and where).
        FiguresError: a figure missing for a layer type.
    """
    t0, c0 = time.perf_counter(), time.process_time()
    sh = shares or rank_shares(dims, setup, spec)
    tc = TensorCosts(sh.table, setup, fig)
    trainers = trainer_costs(sh.trainers, sh.table, tc, setup, fig)
    engines = engine_costs(sh.engines, tc, setup, fig)
    add_link_seconds(trainers, engines, setup)
    path = critical_path(trainers, engines, setup)
    dense = dense_refit(sh.table, tc, trainers, engines, setup, fig)
    tc_ref = TensorCosts(sh.table, setup, fig, encoding="reference")
    export_diff = export_then_diff(sh.table, tc_ref, trainers, engines, setup, fig)
    return Plan(model, dims, setup, fig, trainers, engines, path, dense, export_diff, tc, int(sh.table.numel.sum()),
                time.perf_counter() - t0, time.process_time() - c0, list(notes or []), sh)


def _phase(plan: Plan, name: str) -> PathSegment:
    return next(p for p in plan.path if p.name == name)


def _bottleneck_gbps(plan: Plan, bound: str) -> float | None:
    """The bandwidth (Gbit/s) of the link tier a send bound names."""
    links = plan.setup.links
    for word, value in (("cross_cluster", links.cross_cluster_gbps), ("object store", links.object_store_gbps),
                        (links.intra_node_name, links.nvlink_gbps), ("ib", links.ib_gbps)):
        if word in bound:
            return value
    return None


def what_it_takes(plan: Plan, target_s: float) -> dict:
    """What meeting ``target_s`` needs: the bottleneck link's bandwidth and the engine codec speed at
    which the path just fits (others unchanged), and the path with alternatives (main's host codec
    instead of device kernels; each engine view encoded once)."""
    total = plan.refit_seconds
    out: dict = {"target_seconds": target_s, "refit_seconds": total, "meets_target": total <= target_s}
    send = _phase(plan, "send")
    link = plan.setup.links
    lat = link.cross_cluster_latency_s if plan.setup.placement == "cross-cluster" else link.ib_latency_s
    wire = max(send.seconds - lat, 1e-12)
    room = target_s - (total - wire)
    gbps = _bottleneck_gbps(plan, send.bound)
    out["send_bound"] = send.bound
    out["min_bottleneck_gbps"] = gbps * wire / room if room > 0 and gbps else None
    eng = _phase(plan, "engine decode+apply")
    room_e = target_s - (total - eng.seconds)
    out["min_engine_codec_speed_x"] = eng.seconds / room_e if room_e > 0 else None
    if plan.setup.hardware.codec_device == "gpu":
        hw = replace(plan.setup.hardware, codec_device="cpu")
        cpu = make_plan(plan.model, plan.dims, replace(plan.setup, hardware=hw), plan.fig, shares=plan.shares)
        out["refit_seconds_with_host_codec"] = cpu.refit_seconds
        out["host_codec_critical_phase"] = max(cpu.path, key=lambda p: p.seconds).name
    if plan.setup.fanout == "direct" and plan.setup.engine.replicas > 1:
        relay = make_plan(plan.model, plan.dims, replace(plan.setup, fanout="relay"), plan.fig, shares=plan.shares)
        out["refit_seconds_with_relay"] = relay.refit_seconds
    if plan.setup.encode_per_view and plan.setup.engine.per_replica > 1:
        once = make_plan(plan.model, plan.dims, replace(plan.setup, encode_per_view=False), plan.fig,
                         shares=plan.shares)
        out["refit_seconds_encoding_each_view_once"] = once.refit_seconds
    return out
