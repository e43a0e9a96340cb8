"""Chaos processes: ``tp * pp`` megatron-core trainer ranks and one engine process over gloo.

Trainer ranks run the refit path exactly as users do (``DeltaRefit`` over a
:class:`~nemo_dcr.integrations.megatron.MegatronSource`, real fp32-master AdamW steps of a small
GPTModel at TP x PP with the pipeline driven by hand); the engine is an
:class:`~nemo_dcr.refit.server.EngineServer` in a process of its own, starting empty, while a
reader thread keeps "generating" under the engine's read guard.  After every refit trainer rank
0 compares an independent dense export (gather + whole-tensor conversion, sha256 of the bits)
with the engine's digests.  Every process draws the same fault schedule from the seed.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import threading
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from .faults import schedule, tamper_for

KEY = b"chaos-refit-key-0123456789abcdef"


@dataclass(frozen=True)
class ChaosConfig:
    """One chaos run (trainers: ``tp * pp`` ranks of ``model``)."""

    refits: int
    faults: tuple[str, ...]
    seed: int = 0
    fault_rate: float = 0.5
    model: str = "dense-tiny"
    tp: int = 2
    pp: int = 2
    keyed: bool = True
    """Payloads carry an HMAC (corruption is then caught by the MAC or the preamble checks)."""
    workdir: str = ""

    @property
    def trainers(self) -> int:
        return self.tp * self.pp


def _dcr_config():
    from nemo_dcr.config.schema import DcrConfig

    # small parts (~1000 changes) so drop and reorder have several parts to act on
    return DcrConfig(bucket_size_mb=0.01, reply_timeout_s=120, verify_steps=4, telemetry_encodings=[])


def _transport(cfg: ChaosConfig, rank: int):
    from nemo_dcr.transport import DistTransport

    store = dist.FileStore(os.path.join(cfg.workdir, "refit_store"), cfg.trainers + 1)
    return DistTransport(dist.ProcessGroupGloo(store, rank, cfg.trainers + 1), rank, chunk_bytes=1 << 14)


def engine_main(cfg: ChaosConfig) -> None:
    """Engine process: serve until STOP while a reader thread 'generates' under the guard."""
    from nemo_dcr.apply import InjectedFault, TensorEngine
    from nemo_dcr.layout import canonical_shapes, model_dims
    from nemo_dcr.refit.server import EngineServer

    dims = model_dims(cfg.model)
    shapes = canonical_shapes(dims.family, dims)
    engine = TensorEngine({n: torch.zeros(s, dtype=torch.bfloat16) for n, s in shapes.items()},
                          key=KEY if cfg.keyed else None, keep_index=_dcr_config().engine_index)
    server = EngineServer(engine, _transport(cfg, cfg.trainers), list(range(cfg.trainers)))
    arm = Path(cfg.workdir, "crash.arm")  # out-of-band fault control: trainer rank 0 arms a crash
    crashed = []

    def fault(name: str) -> None:
        written = fault.count = getattr(fault, "count", 0) + 1
        if arm.exists() and written >= 2:
            arm.unlink()
            crashed.append(name)
            raise InjectedFault(f"chaos: crash after writing {name}")

    def reset_count(parts, resync=False, _prepare=engine.prepare):
        if not resync:  # a delta's writes are counted from its first tensor
            fault.count = 0
        return _prepare(parts, resync)

    engine.fault = fault
    engine.prepare = reset_count
    stop = threading.Event()

    def reader():
        while not stop.is_set():
            with engine.serving():
                hashlib.sha256(engine.tensors["model.norm.weight"].view(torch.int16).numpy().tobytes())

    th = threading.Thread(target=reader, daemon=True)
    th.start()
    server.serve()
    stop.set()
    th.join()
    s = server.stats
    Path(cfg.workdir, "engine.json").write_text(json.dumps(dict(
        committed=s.committed, resyncs=s.resyncs, refused=s.refused, duplicates_dropped=s.duplicates_dropped,
        replays_dropped=s.replays_dropped, reordered=s.reordered, events=s.events, crashes=len(crashed),
        mixed_version_served=engine.guard.mixed_version_served, reads=engine.guard.reads_served)))
    server.transport.close()


class _Trainer:
    """A megatron-core policy on this rank and the refit that follows it."""

    def __init__(self, cfg: ChaosConfig, rank: int):
        from nemo_dcr.tools.megatron import build as am
        from nemo_dcr.integrations.megatron.params import local_params
        from nemo_dcr.tools.megatron.train import MasterAdamW
        from nemo_dcr.layout import model_dims
        from nemo_dcr.refit.wiring import engine_wiring, trainer_group

        self.cfg, self.rank = cfg, rank
        self.dims = model_dims(cfg.model)
        am.init_distributed(cfg.tp, cfg.pp, etp=1)
        self.chunks = am.build_gpt_model(self.dims, torch.bfloat16)
        self.opt = MasterAdamW(local_params(self.chunks, self.dims), self.dims.tie_word_embeddings, lr=3e-4)
        self.wiring = engine_wiring(_transport(cfg, rank), range(cfg.trainers), [cfg.trainers], trainer_group())
        self.gen = torch.Generator().manual_seed(cfg.seed)
        self.refit = self.new_refit()

    def new_refit(self):
        """A fresh DeltaRefit (a restarted trainer process: new baseline, owners and mirror)."""
        from nemo_dcr.refit import DeltaRefit

        return DeltaRefit.from_config(_dcr_config(), self.chunks, wiring=self.wiring,
                                      key=KEY if self.cfg.keyed else None, vocab_size=self.dims.vocab_size)

    def train_step(self) -> None:
        """One real AdamW step on random tokens (forward/backward through the pipeline by hand)."""
        from nemo_dcr.tools.megatron.train import pipeline_forward_backward

        tokens = torch.randint(0, self.dims.vocab_size, (2, 17), generator=self.gen)
        pipeline_forward_backward(self.chunks[0], tokens[:, :-1], tokens[:, 1:], self.dims.hidden_size,
                                  torch.bfloat16)
        self.opt.step()

    def dense_digests(self) -> dict[str, str] | None:
        """Independent dense export on trainer rank 0: sha256 of every canonical tensor's bits."""
        from nemo_dcr.tools.megatron.dense import dense_export
        from nemo_dcr.types import int_view

        dense = dense_export(self.chunks, self.dims, dst=0)
        if dense is None:
            return None
        return {n: hashlib.sha256(int_view(t.contiguous()).numpy().tobytes()).hexdigest() for n, t in dense.items()}


def _one_refit(t: _Trainer, i: int, kind: str | None, checkpoints: list, rng, log: list):
    checkpoints.append(t.opt.state())
    t.train_step()
    if kind == "trainer-resume":
        t.opt.load(checkpoints[max(0, len(checkpoints) - 3)])
        t.refit = t.new_refit()
        return t.refit.attach()
    if kind == "crash-mid-apply" and t.rank == 0:
        Path(t.cfg.workdir, "crash.arm").touch()
    dist.barrier()
    return t.refit.step(tamper=tamper_for(kind, t.rank, rng, t.cfg.keyed, log), base_skew=int(kind == "version-skew"))


def trainer_main(cfg: ChaosConfig, rank: int) -> None:
    """Trainer rank: attach, then ``cfg.refits`` refits with the scheduled faults."""
    from nemo_dcr.refit.messages import Ask
    from nemo_dcr.transport import Envelope, MessageKind

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{cfg.workdir}/trainer_store", rank=rank,
                            world_size=cfg.trainers)
    t = _Trainer(cfg, rank)
    before = t.refit.attach().version
    plan, checkpoints, rows = schedule(cfg.refits, cfg.faults, cfg.seed, cfg.fault_rate), [], []
    rng = random.Random(cfg.seed * 7919 + rank)
    for i in range(1, cfg.refits + 1):
        log: list = []
        out = _one_refit(t, i, plan.get(i), checkpoints, rng, log)
        dense = t.dense_digests()
        if rank == 0:
            engine = t.refit.sender.query(Ask.DIGESTS)[0].digests
            rows.append(dict(refit=i, fault=plan.get(i), committed=out.committed, resynced=out.resynced,
                             detected=list(out.detected), version_before=before, version=out.version,
                             bit_exact=dense == engine, changed=out.changed, bytes=out.payload_bytes,
                             corrupted=log))
        before = out.version
    if rank == 0:
        t.wiring.transport.send(cfg.trainers, Envelope(MessageKind.STOP, 0, rank))
        t.wiring.transport.flush()
        Path(cfg.workdir, "trainer.json").write_text(json.dumps(rows))
    t.wiring.close(60)
    dist.barrier()
    dist.destroy_process_group()


def _entry(role: str, cfg: ChaosConfig, rank: int) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    engine_main(cfg) if role == "engine" else trainer_main(cfg, rank)


def run_chaos(cfg: ChaosConfig, timeout: float = 900.0) -> dict:
    """Spawn the trainer processes and one engine process; return the report (:mod:`.report`)."""
    import multiprocessing as mp
    import tempfile

    from .tally import summarize

    with tempfile.TemporaryDirectory(prefix="nemo-dcr-chaos-") as tmp:
        cfg = replace(cfg, workdir=tmp)
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_entry, args=("engine", cfg, cfg.trainers))]
        procs += [ctx.Process(target=_entry, args=("trainer", cfg, r)) for r in range(cfg.trainers)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        codes = [p.exitcode for p in procs]
        for p in procs:
            if p.is_alive():
                p.kill()
        if codes != [0] * len(procs):
            raise RuntimeError(f"chaos processes failed: exit codes {codes} (engine first)")
        rows = json.loads(Path(tmp, "trainer.json").read_text())
        engine = json.loads(Path(tmp, "engine.json").read_text())
    return summarize(cfg, rows, engine)
