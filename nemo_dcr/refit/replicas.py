"""Replicas lost and restarted: which engine ranks a sender addresses, and through which relay.

The relay groups of the wiring (:mod:`.relay`) are the replica sets of the engine views: every
member holds what its root holds.  When an engine rank's process dies (its connection is lost:
the transport says so, unlike a reply that is only late) and another member of its group is still
attached, the rank is **detached** and its group **degraded**:

* the version in flight commits on the others: the members of the group that have not answered it
  get its parts again, directly (the relay broke with the rank: :mod:`nemo_dcr.transport.relay`
  closes the whole group), and drop what they got already as duplicates;
* from then on every attached member of a degraded group gets its parts directly (no relay: the
  engines' process group cannot take a new process), the other groups relay as before;
* the sender neither sends to, awaits nor queries a detached rank.

:meth:`Replicas.reattach` makes a restarted replica (its connection replaced, e.g.
:meth:`nemo_dcr.transport.peers.Peers.replace`) attached again; the sender then brings it to the
others' version through its one recovery path, which resyncs it alone
(:meth:`~.sender.RefitSender.reattach`).  A rank alone in its group (no other replica of its
views) is never detached: its loss is a lost exchange, recovered as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from .messages import EngineReply
from .relay import RelayPlan


@dataclass
class Replicas:
    """The replica sets of the engine views, the detached ranks and the degraded groups.

    Attributes:
        groups: the wiring's relay groups, root first (the replica sets).
        detached: engine ranks lost and not yet reattached.
        degraded: indexes of the groups that lost a member: their members get parts directly.
    """

    groups: tuple[tuple[int, ...], ...]
    detached: set[int] = field(default_factory=set)
    degraded: set[int] = field(default_factory=set)

    @classmethod
    def of(cls, plan: RelayPlan) -> Replicas:
        return cls(plan.groups)

    def live(self, ranks: Sequence[int]) -> list[int]:
        """``ranks`` without the detached ones (in their order)."""
        return [e for e in ranks if e not in self.detached]

    def plan(self) -> RelayPlan:
        """The relay the sender uses now: the degraded groups' attached members one by one, the
        other groups whole."""
        out: list[tuple[int, ...]] = []
        for i, g in enumerate(self.groups):
            out += [(e,) for e in g if e not in self.detached] if i in self.degraded else [g]
        return RelayPlan(tuple(out))

    def _group(self, rank: int) -> int:
        return next(i for i, g in enumerate(self.groups) if rank in g)

    def lose(self, rank: int) -> list[int] | None:
        """``rank``'s process died: detach it and degrade its group when another member is still
        attached.  Returns those members (they need the version in flight directly), or None
        when ``rank`` cannot be detached (no other replica of its views is attached)."""
        if rank in self.detached:
            return []
        i = self._group(rank)
        others = [e for e in self.groups[i] if e != rank and e not in self.detached]
        if not others:
            return None
        self.detached.add(rank)
        self.degraded.add(i)
        return others

    def agree(self, group, engine_ranks: Sequence[int], extra: Sequence[int] = ()) -> tuple[list[int], list[int] | None]:
        """Detach the engine ranks any trainer rank of ``group`` detached (collective); returns
        those this rank detached now and the sums of ``extra`` over the trainer ranks, summed in
        the same collective (None when some trainer rank had detached a rank the others had not:
        counts taken before this agreement then describe different sets of ranks)."""
        seen = group.sum_ints([int(e in self.detached) for e in engine_ranks] + [int(v) for v in extra])
        seen, summed = seen[:len(engine_ranks)], seen[len(engine_ranks):]
        same = all(n in (0, group.size) for n in seen)
        now = [e for e, n in zip(engine_ranks, seen) if n and e not in self.detached and self.lose(e) is not None]
        return now, summed if same else None

    def relayed(self, via, intact: set[tuple[int, ...]], got: Mapping[int, EngineReply], direct: set[int]) -> int:
        """Payload bytes the relays carried in one exchange: of each send to a root (``via``:
        ``(root, bytes, its other replicas)``), its bytes times the other replicas when its group
        is still whole (``intact``: the groups before the exchange that still relay), else times
        those that answered the version without being sent it directly (the relay broke on the
        way; what the root broadcast before, the root alone counts: ``RelayStats``)."""
        whole = intact & set(self.plan().groups)
        out = 0
        for root, n, others in via:
            group = (root, *others)
            if group in whole:
                out += n * len(others)
            else:
                out += n * sum(1 for m in others if m in got and got[m].version >= 0 and m not in direct)
        return out

    def reattach(self, ranks: Sequence[int]) -> None:
        """Address ``ranks`` again (restarted processes; their groups stay degraded).

        Raises:
            ValueError: a rank that is not detached.
        """
        bad = [e for e in ranks if e not in self.detached]
        if bad:
            raise ValueError(f"engine ranks {bad} are not detached (detached: {sorted(self.detached)})")
        self.detached -= set(ranks)
