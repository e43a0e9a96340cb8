"""Processes of the routing test: one trainer rank and two engine ranks (TP=2 stand-in engine).

The engine ranks hold the vLLM-style fused, TP-sharded params of
``tests.standins.vllm_standin`` (a CPU stand-in, not vLLM); both sides derive the same
placement by probing the stand-in's loaders.  Each engine rank records the records it received.
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


def _set_loader(param, fn):
    old = param.weight_loader
    param.weight_loader = fn
    return old


def placements() -> list[dict]:
    """Every engine rank's placement (probed on stand-in models), primary holders assigned."""
    out = []
    for r in range(TP):
        model = StandinModel(D, TP, r)
        out.append(probe_engine(model, SHAPES, _set_loader).placement)
    return assign_primary(out)


def _transport(workdir: str, rank: int):
    from nemo_dcr.transport import DistTransport

    store = dist.FileStore(os.path.join(workdir, "store"), 1 + TP)
    return DistTransport(dist.ProcessGroupGloo(store, rank, 1 + TP), rank, chunk_bytes=1 << 12)


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


def engine_main(workdir: str, rank: int) -> None:
    """Engine rank ``rank`` (1..TP): serve until STOP; dump received records and param bits."""
    from nemo_dcr.refit.server import EngineServer

    torch.set_num_threads(1)
    tp_rank = rank - 1
    model = StandinModel(D, TP, tp_rank)
    params = {n: p.data for n, p in model.named_parameters()}
    engine = RecordingEngine(params, placements()[tp_rank])
    server = EngineServer(engine, _transport(workdir, rank), [0])
    server.serve(timeout=120)
    np.savez(Path(workdir, f"engine{tp_rank}.npz"), **{n: p.view(torch.int16).numpy() for n, p in params.items()})
    Path(workdir, f"engine{tp_rank}.json").write_text(json.dumps(dict(seen=engine.seen, refused=server.stats.refused)))
    server.transport.close()


def _drop_first(envs):
    return envs[1:]


def trainer_main(workdir: str, refits: int) -> None:
    """DeltaRefit with two engine ranks: the placement query sets the routes; attach (a full resync
    through the routes), ``refits`` delta refits, one with a lost part."""
    from nemo_dcr.config.schema import DcrConfig
    from nemo_dcr.refit import DeltaRefit, engine_wiring
    from nemo_dcr.refit.group import LocalGroup
    from nemo_dcr.transport import Envelope, MessageKind
    from tests.standins.shard_trainer import ShardTrainer

    torch.set_num_threads(1)
    transport = _transport(workdir, 0)
    trainer = ShardTrainer(SHAPES, 0, 1, lr=1e-3, seed=1)
    engines = list(range(1, TP + 1))
    cfg = DcrConfig(bucket_size_mb=64 * 10 / (1 << 20), reply_timeout_s=60, telemetry_encodings=[])
    refit = DeltaRefit(cfg, trainer, engine_wiring(transport, [0], engines, LocalGroup()), key=KEY)
    rows = [refit.attach()]
    for i in range(1, refits + 1):
        trainer.step()
        rows.append(refit.step(tamper=_drop_first if i == 2 else None))
    for e in engines:
        transport.send(e, Envelope(MessageKind.STOP, 0, 0))
    transport.flush()
    np.savez(Path(workdir, "trainer.npz"), **{n: p.view(torch.int16).numpy() for n, p in trainer.params.items()})
    Path(workdir, "trainer.json").write_text(json.dumps(
        [dict(committed=o.committed, resynced=o.resynced, ok=o.verify is not None and o.verify.ok,
              detected=list(o.detected), version=o.version, routed=refit.sender.routes is not None) for o in rows]))
    refit.close()
