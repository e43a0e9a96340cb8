"""Transfer time of a set of flows over the link tiers.

A phase moves bytes from sending ranks to receiving ranks.  Ranks of one node share that node's
network link (InfiniBand in-cluster, the cross-cluster link across clusters); ranks talking
inside a node use NVLink (or the host loopback of a CPU machine), per GPU.  A phase takes the
slowest of its bottlenecks, plus the tier's latency once (parts are pipelined):

* NVLink: the busiest GPU's bytes in or out over ``nvlink_gbps``;
* node links: the busiest node's bytes out (senders) or in (receivers) over its link;
* object store: every byte through the store's aggregate throughput (on top of the node links).

When senders and receivers spread evenly over the same nodes (the route exchange, a colocated
engine), a share ``gpus_per_node / ranks`` of each rank's bytes stays inside its node.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .inputs import Links

GBIT = 1e9 / 8
"""Bytes per second of one Gbit/s."""


@dataclass(frozen=True)
class Transfer:
    """Time of one phase's transfer and what bounds it."""

    seconds: float
    bound: str
    """The bottleneck, e.g. ``engine node ingress, cross-cluster 5 Gbit/s``."""
    tiers: dict[str, float]
    """Seconds each tier would need alone (``nvlink``, ``ib``, ``cross_cluster``, ``store``)."""

    def to_dict(self) -> dict:
        """Plain dict (JSON)."""
        return {"seconds": self.seconds, "bound": self.bound, "tiers": self.tiers}


def _node_sums(per_rank: np.ndarray, nodes: np.ndarray) -> np.ndarray:
    return np.bincount(nodes, weights=per_rank) if per_rank.size else np.zeros(1)


def transfer(out_bytes: np.ndarray, out_nodes: np.ndarray, in_bytes: np.ndarray, in_nodes: np.ndarray,
             links: Links, tier: str, local_share: float, names: tuple[str, str], store: bool = True) -> Transfer:
    """Time to move the bytes of a phase.

    Args:
        out_bytes / out_nodes: bytes each sending rank sends, and its node.
        in_bytes / in_nodes: bytes each receiving rank receives, and its node.
        links: the link figures.
        tier: the network tier between nodes (``ib`` or ``cross_cluster``).
        local_share: part of every rank's bytes that stays inside its node (over NVLink).
        names: how to call the sending and the receiving side (``trainer``, ``engine``).
        store: the bytes go through the object store when one is configured (payloads; not the
            trainer ranks' own exchange).
    """
    bw = {"ib": links.ib_gbps, "cross_cluster": links.cross_cluster_gbps or 0.0}[tier] * GBIT
    lat = {"ib": links.ib_latency_s, "cross_cluster": links.cross_cluster_latency_s}[tier]
    remote = 1.0 - local_share
    cands = {
        f"{names[0]} node egress, {tier} {bw / GBIT:g} Gbit/s": _node_sums(out_bytes, out_nodes).max() * remote / bw,
        f"{names[1]} node ingress, {tier} {bw / GBIT:g} Gbit/s": _node_sums(in_bytes, in_nodes).max() * remote / bw,
    }
    nv = links.nvlink_gbps * GBIT
    if local_share > 0:
        busiest = max(out_bytes.max(initial=0.0), in_bytes.max(initial=0.0)) * local_share
        name = f"intra-node {names[0]}->{names[1]}, {links.intra_node_name} {nv / GBIT:g} Gbit/s per rank"
        cands[name] = busiest / nv
        lat = lat if remote > 0 else links.nvlink_latency_s
    intra = [k for k in cands if k.startswith("intra-node")]
    tiers = {"nvlink": max([cands[k] for k in intra], default=0.0),
             tier: max(v for k, v in cands.items() if k not in intra)}
    if store and links.object_store_gbps:
        store = float(in_bytes.sum()) / (links.object_store_gbps * GBIT)
        cands[f"object store {links.object_store_gbps:g} Gbit/s aggregate"] = store
        tiers["store"] = store
        lat = 2 * links.object_store_latency_s  # put then get
    bound = max(cands, key=cands.get)
    return Transfer(float(cands[bound]) + lat, bound, {k: float(v) for k, v in tiers.items()})
