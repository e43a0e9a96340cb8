"""The trainer ranks as a group: exchange sparse buckets, sum checksums, agree on outcomes.

:class:`LocalGroup` is a single trainer process; :class:`DistGroup` runs over a
``torch.distributed`` process group of trainer ranks (gloo: host tensors);
:class:`TransportGroup` runs over any :class:`~nemo_dcr.transport.Transport` (``ROUTE``
messages), for trainer processes that share no process group (NeMo-RL's policy workers).
"""

from __future__ import annotations

import json
import time
from typing import Any, Mapping, Protocol, Sequence

import torch
import torch.distributed as dist

from nemo_dcr.transport import Envelope, MessageKind, Transport, TransportError
from nemo_dcr.transport.base import TransportTimeout
from nemo_dcr.verify.checksum import MASK64


class TrainerGroup(Protocol):
    """Collectives the coordinator needs among trainer ranks."""

    rank: int
    size: int

    def exchange(self, outgoing: Sequence[bytes]) -> list[bytes]:
        """Send ``outgoing[r]`` to rank ``r``; return what each rank sent to this one."""

    def sum_u64(self, values: Mapping[str, int], names: Sequence[str]) -> dict[str, int]:
        """Per-name sums modulo 2**64 over ranks (missing names count 0)."""

    def all_true(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every rank."""

    def sum_ints(self, values: Sequence[int]) -> list[int]:
        """Element-wise sums over ranks (same length on every rank)."""

    def max_floats(self, values: Sequence[float]) -> list[float]:
        """Element-wise maxima over ranks (same length on every rank)."""


class LocalGroup:
    """A group of one."""

    rank, size = 0, 1

    def exchange(self, outgoing: Sequence[bytes]) -> list[bytes]:
        return list(outgoing)

    def sum_u64(self, values: Mapping[str, int], names: Sequence[str]) -> dict[str, int]:
        return {n: values.get(n, 0) & MASK64 for n in names}

    def all_true(self, flag: bool) -> bool:
        return flag

    def sum_ints(self, values: Sequence[int]) -> list[int]:
        return [int(v) for v in values]

    def max_floats(self, values: Sequence[float]) -> list[float]:
        return [float(v) for v in values]


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


class DistGroup:
    """Trainer ranks of a ``torch.distributed`` group (CPU tensors)."""

    def __init__(self, group=None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)

    def exchange(self, outgoing: Sequence[bytes]) -> list[bytes]:
        sizes = torch.tensor([len(b) for b in outgoing], dtype=torch.int64)
        table = [torch.zeros_like(sizes) for _ in range(self.size)]
        dist.all_gather(table, sizes, group=self.group)
        works, incoming = [], [b""] * self.size
        bufs = {}
        for r in range(self.size):
            if r == self.rank:
                incoming[r] = bytes(outgoing[r])
                continue
            n = int(table[r][self.rank])
            if n:
                bufs[r] = torch.empty(n, dtype=torch.uint8)
                works.append(dist.irecv(bufs[r], dist.get_global_rank(self.group, r) if self.group else r, self.group))
            if outgoing[r]:
                t = torch.frombuffer(bytearray(outgoing[r]), dtype=torch.uint8)
                dst = dist.get_global_rank(self.group, r) if self.group else r
                works.append(dist.isend(t, dst, self.group))
        for w in works:
            w.wait()
        for r, buf in bufs.items():
            incoming[r] = buf.numpy().tobytes()
        return incoming

    def sum_u64(self, values: Mapping[str, int], names: Sequence[str]) -> dict[str, int]:
        t = torch.tensor([_signed(values.get(n, 0) & MASK64) for n in names], dtype=torch.int64)
        dist.all_reduce(t, group=self.group)  # int64 addition wraps: the sum modulo 2**64
        return {n: int(v) & MASK64 for n, v in zip(names, t.tolist())}

    def all_true(self, flag: bool) -> bool:
        t = torch.tensor([int(flag)], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return bool(t.item())

    def sum_ints(self, values: Sequence[int]) -> list[int]:
        t = torch.tensor(list(values), dtype=torch.int64)
        dist.all_reduce(t, group=self.group)
        return t.tolist()

    def max_floats(self, values: Sequence[float]) -> list[float]:
        t = torch.tensor(list(values), dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t.tolist()


class TransportGroup:
    """Trainer ranks that reach each other through a transport (``ROUTE`` envelopes).

    Every collective is one envelope from each member to each other member, numbered in the
    envelope's ``version`` field; members must call the collectives in the same order (as with
    any process group).  An envelope of an earlier collective (a leftover) is dropped and
    counted in :attr:`stale_dropped`; anything else out of order is an error.

    Args:
        transport: this member's endpoint.
        ranks: transport ranks of the members, in group order (``transport.rank`` among them).
        timeout: seconds to wait for one member's contribution to a collective.
    """

    def __init__(self, transport: Transport, ranks: Sequence[int], timeout: float = 300.0):
        self.transport = transport
        self.ranks = [int(r) for r in ranks]
        if len(set(self.ranks)) != len(self.ranks) or transport.rank not in self.ranks:
            raise ValueError(f"group ranks {self.ranks} must be distinct and include this endpoint's rank "
                             f"{transport.rank}")
        self.rank = self.ranks.index(transport.rank)
        self.size = len(self.ranks)
        self.timeout = timeout
        self.stale_dropped = 0
        self._seq = 0

    def restart(self, epoch: int) -> None:
        """Number the next collectives from ``epoch`` on (every member at the same point, e.g. at
        the start of each sync; ``epoch`` grows): envelopes of earlier epochs count as stale, so
        members that fell out of step in a failed sync meet again."""
        self._seq = int(epoch) << 32

    def _take(self, src: int, seq: int) -> bytes:
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                env = self.transport.recv(src=src, timeout=max(0.0, deadline - time.monotonic()))
            except TransportTimeout as exc:
                raise TransportTimeout(f"trainer group rank {self.rank}: no contribution to collective {seq} "
                                       f"from transport rank {src} within {self.timeout}s") from exc
            if env.kind == MessageKind.ROUTE and env.version == seq:
                return env.body
            if env.kind == MessageKind.ROUTE and env.version < seq:
                self.stale_dropped += 1
                continue
            raise TransportError(f"trainer group rank {self.rank}: expected collective {seq} from transport "
                                 f"rank {src}, got {env.kind.name} {env.version}")

    def exchange(self, outgoing: Sequence[bytes]) -> list[bytes]:
        if len(outgoing) != self.size:
            raise ValueError(f"exchange needs one buffer per member ({self.size}), got {len(outgoing)}")
        self._seq += 1
        me = self.transport.rank
        for r, dst in enumerate(self.ranks):
            if r != self.rank:
                self.transport.send(dst, Envelope(MessageKind.ROUTE, self._seq, me, body=bytes(outgoing[r])))
        self.transport.flush()
        return [bytes(outgoing[r]) if r == self.rank else self._take(src, self._seq)
                for r, src in enumerate(self.ranks)]

    def _gather(self, value: Any) -> list[Any]:
        """Every member's JSON-able ``value``, in group order."""
        blob = json.dumps(value).encode()
        return [json.loads(b) for b in self.exchange([blob] * self.size)]

    def _columns(self, values: Sequence) -> list[list]:
        rows = self._gather(list(values))
        if any(len(r) != len(values) for r in rows):
            raise ValueError(f"trainer group members passed {sorted({len(r) for r in rows})} values; "
                             "every member must pass the same number")
        return [list(c) for c in zip(*rows)] if values else []

    def sum_u64(self, values: Mapping[str, int], names: Sequence[str]) -> dict[str, int]:
        cols = self._columns([values.get(n, 0) & MASK64 for n in names])
        return {n: sum(c) & MASK64 for n, c in zip(names, cols)}

    def all_true(self, flag: bool) -> bool:
        return all(self._gather(bool(flag)))

    def sum_ints(self, values: Sequence[int]) -> list[int]:
        return [sum(int(v) for v in c) for c in self._columns([int(v) for v in values])]

    def max_floats(self, values: Sequence[float]) -> list[float]:
        return [max(float(v) for v in c) for c in self._columns([float(v) for v in values])]
