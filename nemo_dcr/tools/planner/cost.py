"""Time and memory of the refit pipeline on main, per rank, and its critical path (docs/refit.md).

Phases, each ending at a barrier of the protocol (so the path is the sum of the slowest rank of
every phase):

1. ``capture`` + ``remap``: every trainer rank scans its own slice against its baseline, then
   maps the changes to canonical indices;
2. ``route``: pieces go to the owner of each canonical tensor (collective exchange), which
   merges them;
3. ``encode``: owners encode against their mirror; with a sharded engine, once per engine rank
   view (the sender's fan-out), otherwise once for all engine ranks;
4. ``send``: payloads to the engine ranks (each rank gets only the records for what it holds);
5. ``engine``: once all parts arrived, decode and apply as one transaction;
6. ``ack``: acknowledgement, the checksum all-reduce, and the baseline commit.

Host kernels of ranks sharing a node share its cores (``host_cores_per_node``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from nemo_dcr.telemetry.phases import Phase

from .figures import Figures, Kernels, density_of
from .inputs import PlanSetup
from .links import GBIT, Transfer, transfer
from .work import RankShare, TensorTable

ELEMENT_BYTES = 2
"""Bytes of one element in the serving dtype (bf16)."""
ROUTE_BYTES = 12
"""Bytes of one routed change: int64 position, new and old bf16 bits (``refit.routing.pack``)."""
UNDO_BYTES = 10
"""Bytes of one undo-log entry on the engine: int64 position and the old bits."""


@dataclass
class RankCost:
    """One rank's work, bytes, memory and phase seconds."""

    share: RankShare
    changes: float
    owned_elements: int = 0
    owned_changes: float = 0.0
    encoded_elements: float = 0.0
    payload_bytes: float = 0.0
    """Trainer: bytes it sends to engines; engine: bytes it receives."""
    memory: dict[str, float] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    def row(self) -> dict:
        """The JSON row of this rank."""
        s = self.share
        return {"side": s.side, "rank": s.rank, "node": s.node, **s.coords, "elements_scanned": s.scanned,
                "canonical_elements": sum(s.canonical.values()), "expected_changes": round(self.changes),
                "owned_elements": self.owned_elements, "owned_changes": round(self.owned_changes),
                "encoded_elements": round(self.encoded_elements), "payload_bytes": round(self.payload_bytes),
                "memory_bytes": {k: round(v) for k, v in self.memory.items()},
                "seconds": {k: v for k, v in self.seconds.items()}}


@dataclass
class PathSegment:
    """One segment of the predicted critical path.

    Its ``name`` is the planner's (``capture+remap``, ``engine decode+apply``,
    ``ack+verify+commit``...): a segment may span several recorded
    :class:`~nemo_dcr.telemetry.phases.Phase` members, and the engine's part lies inside the
    recorded ``await``.  The per-rank trainer seconds it sums (:func:`trainer_costs`) are keyed
    by the values of the phases they predict.
    """

    name: str
    seconds: float
    rank: str
    """The slowest rank (``trainer 17``, ``engine 3``) or ``link``."""
    bound: str

    def to_dict(self) -> dict:
        """Plain dict (JSON)."""
        return {"phase": self.name, "seconds": self.seconds, "slowest": self.rank, "bound": self.bound}


def _shares(setup: PlanSetup) -> tuple[float, float]:
    """Core share of one trainer rank and one engine rank for host kernels."""
    hw = setup.hardware
    per_node_t = min(hw.gpus_per_node, setup.trainer.world_size)
    per_node_e = min(hw.gpus_per_node, setup.engine.world_size)
    return min(1.0, hw.host_cores_per_node / per_node_t), min(1.0, hw.host_cores_per_node / per_node_e)


def codec_kernels(setup: PlanSetup, fig: Figures) -> Kernels:
    """The figures of the device that runs remap, route, codec and apply."""
    return fig.gpu if setup.hardware.codec_device == "gpu" else fig.cpu


class TensorCosts:
    """Per canonical tensor: density, expected changes, bytes per change, views encoded."""

    def __init__(self, table: TensorTable, setup: PlanSetup, fig: Figures, encoding: str = "dcr"):
        kinds = sorted(set(table.kind))
        dens = {k: density_of(fig.densities, k) for k in kinds}
        bpc = {k: fig.codec.bytes_per_changed(k, dens[k], encoding) for k in kinds}
        self.bpc_source = {k: v[1] for k, v in bpc.items()}
        self.bpc_by_kind = {k: v[0] for k, v in bpc.items()}
        self.density_by_kind = dens
        self.density = np.array([dens[k] for k in table.kind])
        self.changes = self.density * table.numel
        self.bpc = np.array([self.bpc_by_kind[k] for k in table.kind])
        e = setup.engine
        self.views = table.copies * e.replicas
        self.sent_views = table.copies * (1 if setup.fanout == "relay" else e.replicas)
        """Copies of each tensor's records the owners send (relay: once per view)."""
        self.routed = e.per_replica > 1
        self.header = fig.codec.header_bytes_per_record


def trainer_costs(shares: list[RankShare], table: TensorTable, tc: TensorCosts, setup: PlanSetup,
                  fig: Figures) -> list[RankCost]:
    """Per trainer rank: capture, remap, route, encode seconds; payload sent; memory."""
    world = setup.trainer.world_size
    views = tc.sent_views if setup.fanout == "relay" else tc.views  # a relay carries one encoding per view
    enc_factor = views if tc.routed and setup.encode_per_view else np.ones_like(tc.views)
    owned_el = table.by_owner(table.numel.astype(float), world)
    owned_ch = table.by_owner(tc.changes, world)
    enc_el = table.by_owner(table.numel * enc_factor, world)
    enc_ch = table.by_owner(tc.changes * enc_factor, world)
    sent = table.by_owner(tc.changes * tc.bpc * tc.sent_views + tc.sent_views * tc.header, world)
    k = codec_kernels(setup, fig)
    scan = fig.gpu if setup.hardware.gpus else fig.cpu
    share, _ = _shares(setup)
    host = share if setup.hardware.codec_device == "cpu" else 1.0
    scan_share = share if not setup.hardware.gpus else 1.0
    out = []
    for s in shares:
        r = s.rank
        ch = sum(v * tc.density_by_kind[kind] for kind, v in s.canonical.items())
        c = RankCost(s, ch, int(owned_el[r]), float(owned_ch[r]), float(enc_el[r]), float(sent[r]))
        c.seconds = {
            Phase.CAPTURE.value: s.scanned * ELEMENT_BYTES / (scan.scan_gbps * 1e9) / scan_share,
            Phase.REMAP.value: ch / k.remap_per_s / host,
            Phase.ROUTE.value: (ch + c.owned_changes) / k.route_per_s / host,
            Phase.ENCODE.value: (c.encoded_elements * ELEMENT_BYTES / (k.encode_pass_gbps * 1e9)
                       + float(enc_ch[r]) / k.encode_per_s) / host,
            Phase.COMMIT.value: ch / k.apply_per_s / host,
        }
        c.memory = {"baseline": s.scanned * ELEMENT_BYTES, "mirror": c.owned_elements * ELEMENT_BYTES,
                    "route_buffers": (ch + c.owned_changes) * ROUTE_BYTES, "payload": c.payload_bytes}
        out.append(c)
    return out


def engine_costs(shares: list[RankShare], tc: TensorCosts, setup: PlanSetup, fig: Figures) -> list[RankCost]:
    """Per engine rank: payload received, decode and apply seconds, memory."""
    k = codec_kernels(setup, fig)
    _, share = _shares(setup)
    host = share if setup.hardware.codec_device == "cpu" else 1.0
    out = []
    for s in shares:
        ch = sum(v * tc.density_by_kind[kind] for kind, v in s.canonical.items())
        held = sum(s.canonical.values())
        payload = sum(v * tc.density_by_kind[kind] * tc.bpc_by_kind[kind] for kind, v in s.canonical.items())
        c = RankCost(s, ch, payload_bytes=payload + s.records * tc.header)
        c.seconds = {"decode": (held * ELEMENT_BYTES / (k.decode_pass_gbps * 1e9) + ch / k.decode_per_s) / host,
                     "apply": ch / k.apply_per_s / host}
        c.memory = {"payload": c.payload_bytes, "undo_log": ch * UNDO_BYTES}
        out.append(c)
    return out


def _nodes(costs: list[RankCost]) -> np.ndarray:
    return np.array([c.share.node for c in costs], np.int64)


def network_tier(setup: PlanSetup) -> str:
    """The tier between trainer and engine nodes."""
    return "cross_cluster" if setup.placement == "cross-cluster" else "ib"


def local_share(setup: PlanSetup, ranks: int) -> float:
    """Share of a rank's bytes to peers spread over ``ranks`` ranks that stays in its node."""
    return min(1.0, setup.hardware.gpus_per_node / max(ranks, 1))


def send_transfer(trainers: list[RankCost], engines: list[RankCost], setup: PlanSetup,
                  out_bytes: np.ndarray | None = None, in_bytes: np.ndarray | None = None) -> Transfer:
    """Owners -> engine ranks (``out_bytes``/``in_bytes`` override the delta payloads: dense refit)."""
    out_b = np.array([c.payload_bytes for c in trainers]) if out_bytes is None else out_bytes
    in_b = np.array([c.payload_bytes for c in engines]) if in_bytes is None else in_bytes
    if setup.fanout == "relay":  # across to the relay roots only
        in_b = in_b * np.array([is_root(c, setup) for c in engines])
    local = local_share(setup, setup.trainer.world_size) if setup.placement == "colocated" else 0.0
    return transfer(out_b, _nodes(trainers), in_b, _nodes(engines), setup.links, network_tier(setup), local,
                    ("trainer", "engine"))


def is_root(c: RankCost, setup: PlanSetup) -> bool:
    """The engine rank is its view's relay root (refit/relay.py ``relay_groups``: position ``i``'s
    root is in replica ``i % replicas``)."""
    e = setup.engine
    return c.share.coords.get("replica", 0) == (c.share.rank % e.per_replica) % e.replicas


def relay_transfer(engines: list[RankCost], setup: PlanSetup) -> Transfer | None:
    """The relay roots' broadcasts to the other replicas (``fanout: relay``), modelled as gloo's
    one-to-all: each root sends its payload once per other replica over the in-cluster link."""
    if setup.fanout != "relay" or setup.engine.replicas < 2:
        return None
    roots = [c for c in engines if is_root(c, setup)]
    others = [c for c in engines if not is_root(c, setup)]
    out_b = np.array([c.payload_bytes * (setup.engine.replicas - 1) for c in roots])
    in_b = np.array([c.payload_bytes for c in others])
    return transfer(out_b, _nodes(roots), in_b, _nodes(others), setup.links, "ib", 0.0, ("relay root", "replica"),
                    store=False)


def route_transfer(trainers: list[RankCost], setup: PlanSetup) -> Transfer:
    """The all-to-all of canonical pieces among trainer ranks (in-cluster)."""
    out_b = np.array([c.changes * ROUTE_BYTES for c in trainers])
    in_b = np.array([c.owned_changes * ROUTE_BYTES for c in trainers])
    nodes = _nodes(trainers)
    return transfer(out_b, nodes, in_b, nodes, setup.links, "ib", local_share(setup, setup.trainer.world_size),
                    ("trainer", "owner"), store=False)


def add_link_seconds(trainers: list[RankCost], engines: list[RankCost], setup: PlanSetup) -> None:
    """Each rank's own transfer time per tier: its bytes over its node's link (the ranks of a node
    add up to the node's time) and over NVLink for what stays in the node: ``route_<tier>`` and
    ``send_<tier>`` / ``receive_<tier>``."""
    links = setup.links
    tier = network_tier(setup)
    bw = {"ib": links.ib_gbps, "cross_cluster": links.cross_cluster_gbps or 0.0}
    route_local = local_share(setup, setup.trainer.world_size)
    send_local = route_local if setup.placement == "colocated" else 0.0
    for side, costs in (("trainer", trainers), ("engine", engines)):
        for c in costs:
            flows = [("send" if side == "trainer" else "receive", c.payload_bytes, tier, send_local)]
            if side == "trainer":
                flows.append(("route", (c.changes + c.owned_changes) * ROUTE_BYTES, "ib", route_local))
            for name, nbytes, t, local in flows:
                c.seconds[f"{name}_{t}"] = nbytes * (1 - local) / (bw[t] * GBIT) if bw[t] else 0.0
                if local:
                    c.seconds[f"{name}_nvlink"] = nbytes * local / (links.nvlink_gbps * GBIT)


def _slowest(costs: list[RankCost], phases: tuple[str, ...]) -> tuple[float, str]:
    best = max(costs, key=lambda c: sum(c.seconds[p] for p in phases))
    return sum(best.seconds[p] for p in phases), f"{best.share.side} {best.share.rank}"


def ack_seconds(setup: PlanSetup) -> float:
    """Acknowledgement plus the checksum all-reduce over the trainer ranks (latency bound)."""
    nodes = math.ceil(setup.trainer.world_size / setup.hardware.gpus_per_node)
    lat = setup.links.ib_latency_s if nodes > 1 else setup.links.nvlink_latency_s
    reply = setup.links.cross_cluster_latency_s if setup.placement == "cross-cluster" else lat
    return reply + 2 * math.ceil(math.log2(max(setup.trainer.world_size, 2))) * lat


def critical_path(trainers: list[RankCost], engines: list[RankCost], setup: PlanSetup) -> list[PathSegment]:
    """The phases of the delta refit, each with its slowest rank or link."""
    path = []
    sec, who = _slowest(trainers, (Phase.CAPTURE, Phase.REMAP))
    path.append(PathSegment("capture+remap", sec, who, "scan of the rank's slice, then index arithmetic"))
    route = route_transfer(trainers, setup)
    sec, who = _slowest(trainers, (Phase.ROUTE,))
    path.append(PathSegment("route", sec + route.seconds, who, f"pack/merge; exchange bound by {route.bound}"))
    sec, who = _slowest(trainers, (Phase.ENCODE,))
    path.append(PathSegment("encode", sec, who, "owner encodes against its mirror"))
    send = send_transfer(trainers, engines, setup)
    path.append(PathSegment("send", send.seconds, "link", send.bound))
    relay = relay_transfer(engines, setup)
    if relay is not None:
        path.append(PathSegment("relay", relay.seconds, "link", relay.bound))
    sec, who = _slowest(engines, ("decode", "apply"))
    path.append(PathSegment("engine decode+apply", sec, who, "transaction after every part arrived"))
    sec, who = _slowest(trainers, (Phase.COMMIT,))
    path.append(PathSegment("ack+verify+commit", ack_seconds(setup) + sec, who, "reply, checksum all-reduce, baseline"))
    return path
