"""Processes of the routing test: one or three trainer ranks and two engine ranks (TP=2 stand-in
engine).

The engine ranks hold the vLLM-style fused, TP-sharded params of
``tests.standins.vllm_standin`` (a CPU stand-in, not vLLM); both sides derive the same
placement by probing the stand-in's loaders.  Each engine rank records the records it received.
With three trainer ranks (row shards of every canonical tensor, gloo between them) the trainer
ranks route their changes to the owners over their own process group, and a larger stand-in
is used so that the bytes per link are those of real tensors, not of headers.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from nemo_dcr.apply import TensorEngine
from nemo_dcr.apply.placement import assign_primary
from nemo_dcr.apply.probe import probe_engine
from tests.standins.vllm_standin import StandinDims, StandinModel, canonical_shapes

KEY = b"routing-test-key-0123456789abcdef"
TP = 2
D = StandinDims()
SHAPES = canonical_shapes(D)
BIG = StandinDims(hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=128, vocab=96, experts=4, moe_ffn=32)
"""The stand-in of the multi-trainer run (about 60k elements)."""


def dims(trainers: int) -> StandinDims:
    """The stand-in's sizes for a run with ``trainers`` trainer ranks."""
    return D if trainers == 1 else BIG


def _set_loader(param, fn):
    old = param.weight_loader
    param.weight_loader = fn
    return old


def placements(d: StandinDims = D) -> list[dict]:
    """Every engine rank's placement (probed on stand-in models), primary holders assigned."""
    out, shapes = [], canonical_shapes(d)
    for r in range(TP):
        model = StandinModel(d, TP, r)
        out.append(probe_engine(model, shapes, _set_loader).placement)
    return assign_primary(out)


def _transport(workdir: str, rank: int, trainers: int):
    from nemo_dcr.transport import DistTransport

    store = dist.FileStore(os.path.join(workdir, "store"), trainers + TP)
    return DistTransport(dist.ProcessGroupGloo(store, rank, trainers + TP), rank, chunk_bytes=1 << 12)


class RecordingEngine(TensorEngine):
    """A :class:`TensorEngine` over the stand-in's params and a placement that notes
    (name, shape, nnz) of every record it is sent."""

    def __init__(self, params, placement):
        super().__init__(params, key=KEY, placement=placement)
        self.seen = []

    def prepare(self, parts, resync=False):
        from nemo_dcr.codec import inspect

        for p in (p for ps in parts.values() for p in ps):
            self.seen += [(r.name, list(r.shape), r.changed) for r in inspect(p, KEY).records]
        return super().prepare(parts, resync)


def engine_main(workdir: str, rank: int, trainers: int = 1) -> None:
    """Engine rank ``rank`` (after the trainers): serve until STOP; dump received records and param bits."""
    from nemo_dcr.refit.server import EngineServer

    torch.set_num_threads(1)
    tp_rank = rank - trainers
    model = StandinModel(dims(trainers), TP, tp_rank)
    params = {n: p.data for n, p in model.named_parameters()}
    engine = RecordingEngine(params, placements(dims(trainers))[tp_rank])
    server = EngineServer(engine, _transport(workdir, rank, trainers), list(range(trainers)))
    server.serve(timeout=120)
    np.savez(Path(workdir, f"engine{tp_rank}.npz"), **{n: p.view(torch.int16).numpy() for n, p in params.items()})
    Path(workdir, f"engine{tp_rank}.json").write_text(json.dumps(dict(seen=engine.seen, refused=server.stats.refused)))
    server.transport.close()


def _drop_first(envs):
    return envs[1:]


def _report_row(o, refit) -> dict:
    return dict(committed=o.committed, resynced=o.resynced, ok=o.verify is not None and o.verify.ok,
                detected=list(o.detected), version=o.version, routed=refit.sender.routes is not None,
                mode=o.mode, density=o.density, links=o.bytes_on_links)


def trainer_main(workdir: str, refits: int, rank: int = 0, trainers: int = 1) -> None:
    """DeltaRefit with two engine ranks: the placement query sets the routes; attach (a full resync
    through the routes), ``refits`` delta refits; with one trainer rank the second loses a part,
    with several the trainer ranks route their changes to the owners over a gloo group."""
    from nemo_dcr.config.schema import DcrConfig
    from nemo_dcr.refit import DeltaRefit, engine_wiring
    from nemo_dcr.refit.group import DistGroup, LocalGroup
    from nemo_dcr.transport import Envelope, MessageKind
    from tests.standins.shard_trainer import ShardTrainer

    torch.set_num_threads(1)
    transport = _transport(workdir, rank, trainers)
    if trainers > 1:
        dist.init_process_group("gloo", init_method=f"file://{workdir}/trainer_store", rank=rank, world_size=trainers)
    group = DistGroup() if trainers > 1 else LocalGroup()
    shapes = canonical_shapes(dims(trainers))
    trainer = ShardTrainer(shapes, rank, trainers, lr=1e-3 if trainers == 1 else 1e-5, seed=1)
    engines = list(range(trainers, trainers + TP))
    cfg = DcrConfig(bucket_size_mb=64 * 10 / (1 << 20), reply_timeout_s=60, telemetry_encodings=[])
    refit = DeltaRefit(cfg, trainer, engine_wiring(transport, range(trainers), engines, group), key=KEY)
    rows = [refit.attach()]
    for i in range(1, refits + 1):
        trainer.step()
        rows.append(refit.step(tamper=_drop_first if i == 2 and trainers == 1 else None))
    if rank == 0:
        for e in engines:
            transport.send(e, Envelope(MessageKind.STOP, 0, 0))
        transport.flush()
    suffix = "" if trainers == 1 else str(rank)
    np.savez(Path(workdir, f"trainer{suffix}.npz"), **{n: p.view(torch.int16).numpy() for n, p in trainer.params.items()})
    if rank == 0:
        Path(workdir, "trainer.json").write_text(json.dumps([_report_row(o, refit) for o in rows]))
    refit.close()
