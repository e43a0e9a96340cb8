"""The trainer ranks as a group: exchange sparse buckets, sum checksums, agree on outcomes.

:class:`LocalGroup` is a single trainer process; :class:`DistGroup` runs over a
``torch.distributed`` process group of trainer ranks (gloo or NCCL-with-CPU-tensors via gloo).
"""

from __future__ import annotations

from typing import Mapping, Protocol, Sequence

import torch
import torch.distributed as dist

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
