"""The efficient dense refit the demo times next to the delta refit (what a user would run without nemo_dcr).

Every trainer rank sends the shards it holds the first replica of as raw bytes, one tensor message
per rank over a gloo group of its own (never pickled objects), to the engine's host: the engine
process (``engine.placement: separate``) or the trainer rank hosting a colocated engine.  There the
TP shards are merged, converted to the engine's canonical HF names, and loaded by the engine's own
loader (vLLM's ``load_weights``; the transformers engine copies into its parameters, quantizing for
FP8).  Timed from the trainers' first send to the end of the load; the checks around it are not.

Because it runs right after the delta refit of the same weights, the dense load is also the check:
the engine's digests (sha256 of every parameter's raw bits) before and after its own full load must
be equal, i.e. the delta refit left the engine bit-identical to what a full refit gives it.  (An FP8
engine is compared with an independent re-quantization of the dense tensors before its load.)
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from nemo_dcr.tools.megatron.dense import ShardRecord, first_replica_shards, to_hf

METHOD = ("tensor p2p of each trainer rank's raw bf16 shards over gloo to the engine's host, TP merge + "
          "megatron->HF conversion, the engine's own loader (vLLM load_weights / parameter copy)")
"""What ``summary.json`` names as ``dense_method``."""


@dataclass(frozen=True)
class DenseResult:
    """One dense refit at the engine's host.

    Attributes:
        recv_s: seconds from the first byte awaited to the last shard received.
        convert_s: TP merge and HF conversion.
        load_s: the engine's own load.
        check_s: the digests (or FP8 comparison) and bookkeeping around the load (not part of the refit).
        same: the engine before its own full load equals it after (bit for bit).
        bytes: shard bytes that crossed the link.
    """

    recv_s: float
    convert_s: float
    load_s: float
    check_s: float
    same: bool
    bytes: int


def _flat(shards) -> torch.Tensor:
    """The shards' raw bytes in one buffer (one message)."""
    parts = [t.contiguous().reshape(-1).view(torch.uint8) for _, t in shards]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8)


def _unflat(buf: torch.Tensor, layout: list[dict]) -> list[tuple[ShardRecord, torch.Tensor]]:
    out, at = [], 0
    for rec in layout:
        r = ShardRecord(rec["name"], rec["tp_rank"], rec["dim"], tuple(rec["shape"]))
        dtype = getattr(torch, rec["dtype"])
        n = int(torch.Size(r.shape).numel()) * dtype.itemsize
        out.append((r, buf[at:at + n].view(dtype).reshape(r.shape)))
        at += n
    return out


class DenseLink:
    """The trainers' side and the host's side of the dense refit over ``group`` (a gloo group whose
    ranks ``0..T-1`` are the trainer ranks and ``host`` the engine's host, maybe one of them).

    Construction is collective over the group: each trainer rank tells the host its shard layout
    once (JSON), so every later refit moves only raw bytes.
    """

    def __init__(self, group, rank: int, host: int, trainers: int, chunks=None, dims=None):
        self.group, self.rank, self.host, self.trainers = group, rank, host, trainers
        self.chunks, self.dims = chunks, dims
        self.layouts: dict[int, list[dict]] = {}
        if rank < trainers:
            layout = [dict(asdict(r), dtype=str(t.dtype).removeprefix("torch."))
                      for r, t in first_replica_shards(chunks, dims)]
            if rank == host:
                self.layouts[rank] = layout
            else:
                self._send_bytes(json.dumps(layout).encode())
        if rank == host:
            for r in range(trainers):
                if r != host:
                    self.layouts[r] = json.loads(self._recv_bytes(r))

    def _send_bytes(self, data: bytes) -> None:
        self.group.send([torch.tensor([len(data)], dtype=torch.int64)], self.host, 0).wait()
        self.group.send([torch.frombuffer(bytearray(data), dtype=torch.uint8)], self.host, 1).wait()

    def _recv_bytes(self, src: int) -> bytes:
        n = torch.zeros(1, dtype=torch.int64)
        self.group.recv([n], src, 0).wait()
        buf = torch.empty(int(n), dtype=torch.uint8)
        self.group.recv([buf], src, 1).wait()
        return buf.numpy().tobytes()

    def send(self) -> None:
        """A trainer rank other than the host: its shards' current bytes to the host."""
        self.group.send([_flat(first_replica_shards(self.chunks, self.dims))], self.host, 2).wait()

    def receive(self, own=None) -> tuple[dict[str, torch.Tensor], float, float, int]:
        """The host: every trainer rank's shards (``own``: the host's own, when it is a trainer),
        as HF tensors; returns ``(tensors, recv seconds, convert seconds, bytes received)``."""
        t0 = time.perf_counter()
        bufs, works = {}, []
        for r, layout in self.layouts.items():
            if r == self.rank:
                continue
            size = sum(int(torch.Size(x["shape"]).numel()) * getattr(torch, x["dtype"]).itemsize for x in layout)
            bufs[r] = torch.empty(size, dtype=torch.uint8)
            works.append(self.group.recv([bufs[r]], r, 2))
        for w in works:
            w.wait()
        t1 = time.perf_counter()
        shards = [s for r, b in bufs.items() for s in _unflat(b, self.layouts[r])] + list(own or [])
        tensors = to_hf(shards, self.dims)
        return tensors, t1 - t0, time.perf_counter() - t1, sum(b.numel() for b in bufs.values())


def engine_group(store_path: str, rank: int, trainers: int):
    """The dense refit's gloo group of the trainer ranks and a separate engine process (rank
    ``trainers``), over a file store of its own."""
    store = dist.FileStore(store_path, trainers + 1)
    return dist.ProcessGroupGloo(store, rank, trainers + 1)


def load_dense(engine, tensors: dict[str, torch.Tensor], version: int, fp8: bool) -> tuple[float, float, bool]:
    """Load ``tensors`` into ``engine`` by its own loader (``load_weights``: vLLM's, or the
    transformers engine's parameter copy); returns ``(load seconds, check seconds, same)`` where
    ``same`` says the engine held exactly what its own full load gives it (``fp8``: its FP8 bytes
    and scales equal an independent re-quantization of ``tensors``)."""
    t0 = time.perf_counter()
    if fp8:
        from nemo_dcr.tools.demo.hf_engine import fp8_same

        same = fp8_same(engine, tensors)
    else:
        before = engine.digests()
    t1 = time.perf_counter()
    engine.load_weights(tensors, version)
    load_s = max(x["load_seconds"] for x in engine.last_dense)
    t2 = time.perf_counter()
    if not fp8:
        same = before == engine.digests()
    return load_s, (t1 - t0) + (t2 - t1 - load_s) + (time.perf_counter() - t2), same
