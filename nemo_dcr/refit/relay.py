"""Who receives a version across the slow link: the fan-out of a refit (``dcr.fanout``).

``direct``: every engine rank gets its parts from every trainer owner, so the link between the
trainer and the rollout cluster carries a view's bytes once per replica.  ``relay``: the replicas of
an engine view form a *relay group*; the owners send the group's parts to its root only, which
relays the same bytes to the others over a broadcast in the engines' own process group
(:mod:`nemo_dcr.transport.relay`), so the slow link carries each view once per version.  Every
replica still applies, verifies and acknowledges each version on its own.

The groups come from the engine layout (:func:`relay_groups`: one root per view, or per view and
node); the engine processes build their relay endpoints from the same list.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable, Sequence

from nemo_dcr.config.schema import ConfigError, DcrConfig


def relay_groups(engine_ranks: Sequence[int], per_replica: int, nodes: Sequence[Hashable] | None = None,
                 roots: str = "view") -> list[list[int]]:
    """Relay groups of an engine layout, root first: the root of position ``i``'s views is its rank
    in replica ``i % replicas``, so the roots of a replica's views spread over the replicas (and
    their nodes' links to the trainers) instead of all landing on replica 0.

    Args:
        engine_ranks: engine ranks in replica-major order: replica ``r`` is
            ``engine_ranks[r * per_replica:(r + 1) * per_replica]``, and position ``i`` of every
            replica holds the same views (vLLM's data-parallel replicas of a TP engine).
        per_replica: engine ranks of one replica.
        nodes: the node of each engine rank (``roots="node"``).
        roots: ``view`` (one root per view: the slow link carries each view once) or ``node``
            (one root per view and node: no relay crosses between nodes).

    Raises:
        ConfigError: a layout the ranks cannot take (named).
    """
    ranks = [int(e) for e in engine_ranks]
    if per_replica < 1 or len(ranks) % per_replica:
        raise ConfigError("engine.replicas", f"{len(ranks)} engine ranks are not whole replicas of {per_replica}")
    if roots not in ("view", "node"):
        raise ConfigError("dcr.fanout_roots", f"must be one of ['view', 'node'], got {roots!r}")
    if roots == "node" and (nodes is None or len(nodes) != len(ranks)):
        raise ConfigError("dcr.fanout_roots", "node roots need the node of every engine rank")
    replicas = len(ranks) // per_replica
    groups: dict[tuple, list[int]] = {}
    for i in range(per_replica):
        for r in range(replicas):
            k = ((i + r) % replicas) * per_replica + i  # position i, replicas from i % replicas on
            key = (i,) + ((nodes[k],) if roots == "node" else ())
            groups.setdefault(key, []).append(ranks[k])
    return list(groups.values())


@dataclass(frozen=True)
class RelayPlan:
    """The relay groups the sender addresses (each engine rank in exactly one; root first).

    Attributes:
        groups: engine ranks of each group, its root first (a group of one: that rank direct).
    """

    groups: tuple[tuple[int, ...], ...]

    @classmethod
    def direct(cls, engine_ranks: Sequence[int]) -> RelayPlan:
        """Every engine rank on its own."""
        return cls(tuple((int(e),) for e in engine_ranks))

    @property
    def relaying(self) -> bool:
        """Some group has replicas to relay to."""
        return any(len(g) > 1 for g in self.groups)

    def destinations(self, ranks: Sequence[int]) -> list[tuple[int, int]]:
        """Where to send so that every rank of ``ranks`` gets its parts: ``(engine rank, ranks its
        parts reach)``.  A group whose root is among ``ranks`` gets one send to the root (its relay
        reaches every replica; those that already hold the version drop it); otherwise each of its
        ranks in ``ranks`` gets its own (a replica resynced alone)."""
        wanted = set(int(r) for r in ranks)
        out = []
        for g in self.groups:
            if g[0] in wanted:
                out.append((g[0], len(g)))
            else:
                out += [(e, 1) for e in g if e in wanted]
        return out

    def check_views(self, signature: Callable[[int], object]) -> None:
        """Every replica of a group holds what its root holds (``signature(rank)``: its views).

        Raises:
            ValueError: naming the group and the rank that differs.
        """
        for g in self.groups:
            for e in g[1:]:
                if signature(e) != signature(g[0]):
                    raise ValueError(f"relay group {list(g)}: engine rank {e} holds other views than its root "
                                     f"{g[0]} (a relay carries the root's parts; group replicas of one view)")


def relay_plan(cfg: DcrConfig, engine_ranks: Sequence[int], groups: Sequence[Sequence[int]] | None) -> RelayPlan:
    """The plan ``cfg.fanout`` asks for over the wiring's relay ``groups`` (None: the engines
    relay nothing).  Unset ``fanout``: relay where some view has several replicas, else direct.

    Raises:
        ConfigError: ``relay`` without relay groups for several engine ranks, or groups that do
            not cover the engine ranks once each.
    """
    ranks = [int(e) for e in engine_ranks]
    if cfg.fanout == "direct" or (groups is None and cfg.fanout is None):
        return RelayPlan.direct(ranks)
    if groups is None:
        if len(ranks) > 1:
            raise ConfigError("dcr.fanout", f"relay needs the engines' relay groups (engine_wiring(..., relay=...)); "
                                            f"this wiring has none for engine ranks {ranks}")
        return RelayPlan.direct(ranks)
    flat = [int(e) for g in groups for e in g]
    if sorted(flat) != sorted(ranks) or any(not g for g in groups):
        raise ConfigError("dcr.fanout", f"relay groups {[list(g) for g in groups]} must hold every engine rank "
                                        f"{ranks} exactly once")
    return RelayPlan(tuple(tuple(int(e) for e in g) for g in groups))
