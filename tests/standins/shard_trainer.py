"""A **stand-in** trainer for unit tests of the refit path without Megatron: row shards of
canonical tensors with fp32-master AdamW steps (the same bits contract as Megatron's
mixed-precision optimizer), exposed as a :class:`nemo_dcr.refit.TrainerSource`.

Trainer rank ``r`` of ``world`` holds rows ``[r*R/world, (r+1)*R/world)`` of every canonical
tensor (a TP-style row split), so its flat local index ``i`` is canonical index
``row0 * cols + i``: the remap is pure integer arithmetic, as in :mod:`nemo_dcr.layout`.
The real trainer source is :class:`nemo_dcr.integrations.megatron.MegatronSource`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np
import torch

from nemo_dcr.kernels.traffic import host_bits
from nemo_dcr.types import SparseDelta
from nemo_dcr.verify.compare import ShardChecksums
from nemo_dcr.verify.sample import Sample, runs_checksum


def row_range(rows: int, rank: int, world: int) -> tuple[int, int]:
    """Rows of a tensor held by ``rank``."""
    return rows * rank // world, rows * (rank + 1) // world


@dataclass
class ShardTrainer:
    """fp32 masters of this rank's row shards and bf16 live params (a TrainerSource)."""

    shapes: Mapping[str, tuple[int, ...]]
    rank: int
    world: int
    lr: float = 1e-5
    seed: int = 0

    def __post_init__(self):
        g = torch.Generator().manual_seed(self.seed)
        self.masters, self.params, self.offsets = {}, {}, {}
        for name, shape in self.shapes.items():
            full = torch.randn(shape, generator=g) * 0.05
            lo, hi = row_range(shape[0], self.rank, self.world)
            cols = int(np.prod(shape[1:])) if len(shape) > 1 else 1
            self.masters[name] = full[lo:hi].clone().requires_grad_(True)
            self.params[name] = full[lo:hi].to(torch.bfloat16).contiguous()
            self.offsets[name] = lo * cols
        self.opt = torch.optim.AdamW(list(self.masters.values()), lr=self.lr)
        self.step_no = 0
        self.ranges = {n: (0, p.numel()) for n, p in self.params.items()}
        self.canonical = {n: ("bf16", tuple(s)) for n, s in self.shapes.items()}

    @torch.no_grad()
    def step(self) -> None:
        """One AdamW step of the masters with pseudo-random gradients; round into bf16."""
        self.step_no += 1
        g = torch.Generator().manual_seed(1000 * self.seed + 17 * self.step_no + self.rank)
        for m in self.masters.values():
            m.grad = torch.randn(m.shape, generator=g)
        self.opt.step()
        for n, m in self.masters.items():
            self.params[n].copy_(m.to(torch.bfloat16))

    def remap(self, delta: SparseDelta) -> list[SparseDelta]:
        """The local delta as one canonical piece (row offset)."""
        return [SparseDelta(delta.name, delta.dtype, tuple(self.shapes[delta.name]),
                            delta.positions + self.offsets[delta.name], delta.new_bits, delta.old_bits)]

    def captured(self) -> dict[str, int]:
        """Elements of each canonical tensor this rank captures (its rows)."""
        return {n: p.numel() for n, p in self.params.items()}

    def pieces(self) -> list[SparseDelta]:
        """Every element as canonical pieces with zero old bits."""
        out = []
        for n, p in self.params.items():
            bits = host_bits(p).copy()
            pos = np.arange(self.offsets[n], self.offsets[n] + bits.size, dtype=np.int64)
            out.append(SparseDelta(n, "bf16", tuple(self.shapes[n]), pos, bits, np.zeros_like(bits)))
        return out

    def checksums(self, sample: Sample | None = None) -> dict[str, int]:
        """This rank's partial checksums of its current bf16 shards (full scan, or ``sample``'s slice)."""
        if sample is not None:
            zero = np.zeros(1, np.int64)
            return {n: runs_checksum(host_bits(p), zero, zero + self.offsets[n], np.array([p.numel()]), sample, n)
                    for n, p in self.params.items()}
        sc = ShardChecksums()
        for n, p in self.params.items():
            bits = host_bits(p)
            sc.add(n, np.arange(self.offsets[n], self.offsets[n] + bits.size, dtype=np.int64), bits)
        return sc.sums

    def state(self) -> dict:
        """Everything needed to resume (masters, optimizer, params, step)."""
        return dict(masters={n: m.detach().clone() for n, m in self.masters.items()},
                    opt=self.opt.state_dict(), step=self.step_no)

    @torch.no_grad()
    def load(self, state: dict) -> None:
        """Resume from :meth:`state`."""
        for n, m in self.masters.items():
            m.copy_(state["masters"][n])
            self.params[n].copy_(m.to(torch.bfloat16))
        self.opt.load_state_dict(state["opt"])
        self.step_no = state["step"]


@dataclass
class StoreJob:
    """A stand-in trainer refitting a :class:`~nemo_dcr.apply.TensorEngine` served by an
    :class:`~nemo_dcr.refit.EngineServer` on its own thread, over the store transport at ``url``
    (trainer rank 0, engine rank 1), as across clusters: :func:`store_job`."""

    trainer: ShardTrainer
    engine: object
    server: object
    refit: object


def store_job(url: str, cfg, key: bytes, run: str, shapes: Mapping[str, tuple[int, ...]]):
    """Context manager yielding a :class:`StoreJob`; on exit the refit is closed, the server
    told to stop, and its thread must have ended."""
    import contextlib
    import threading

    from nemo_dcr.apply import TensorEngine
    from nemo_dcr.refit import DeltaRefit, EngineServer
    from nemo_dcr.refit.group import LocalGroup
    from nemo_dcr.refit.wiring import engine_wiring
    from nemo_dcr.transport import Envelope, MessageKind, StoreTransport

    @contextlib.contextmanager
    def job():
        trainer = ShardTrainer(dict(shapes), 0, 1, lr=2e-4)
        engine = TensorEngine({n: torch.zeros(s, dtype=torch.bfloat16) for n, s in shapes.items()}, key=key)
        server = EngineServer(engine, StoreTransport(url, 1, key, run=run), senders=[0])
        thread = threading.Thread(target=server.serve, daemon=True)
        thread.start()
        refit = DeltaRefit(cfg, trainer, engine_wiring(StoreTransport(url, 0, key, run=run), [0], [1], LocalGroup()),
                           key=key)
        try:
            yield StoreJob(trainer, engine, server, refit)
        finally:
            refit.close(5)
            refit.wiring.transport.send(1, Envelope(MessageKind.STOP, 0, 0))
            thread.join(10)
        assert not thread.is_alive()

    return job()
