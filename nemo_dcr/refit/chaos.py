"""Chaos run: trainer ranks and an engine rank as separate processes (gloo), faults injected at
random refits, every refit checked against an independent dense export (sha256 of bits).

The trainer is :class:`tests.standins.shard_trainer.ShardTrainer` (row shards, fp32-master AdamW),
documented in docs/refit.md as the smaller stand-in for Megatron shards.  Every process draws
the same fault schedule from the seed, so the engine knows on which version to crash.

Fault kinds and how each is meant to be caught:
  drop: a payload part of rank 0 is lost -> engine sees a part-index gap -> NACK -> resync.
  duplicate: every part is sent twice -> engine drops the copies (absorbed).
  reorder: parts are sent in reverse order -> engine reassembles by part index (absorbed).
  corrupt: bytes of a part are zeroed -> codec refuses (crc/MAC) -> NACK -> resync.
  crash-mid-apply: engine raises after the 2nd tensor written -> rollback -> NACK -> resync.
  trainer-resume: trainers reload a checkpoint 2 refits old in fresh senders -> checksums differ -> resync.
  version-skew: payload base version off by one -> VersionMismatchError -> NACK -> resync.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

FAULTS = ("drop", "duplicate", "reorder", "corrupt", "crash-mid-apply", "trainer-resume", "version-skew")
KEY = b"chaos-refit-key-0123456789abcdef"
SHAPES = {f"model.layers.{i}.{p}.weight": s for i in range(2)
          for p, s in (("self_attn.qkv", (96, 64)), ("mlp.up", (128, 64)), ("mlp.down", (64, 128)))}
SHAPES["model.norm.weight"] = (64,)


@dataclass(frozen=True)
class ChaosConfig:
    """One chaos run."""

    refits: int
    faults: tuple[str, ...]
    seed: int = 0
    trainers: int = 2
    fault_rate: float = 0.5
    workdir: str = ""


def schedule(cfg: ChaosConfig) -> dict[int, str]:
    """Refit index (1-based) -> fault kind; identical in every process.

    With ``fault_rate >= 1`` every refit from the second on gets a fault, cycling through all
    kinds in a seeded order; otherwise each refit draws a fault with that probability.
    """
    rng = random.Random(cfg.seed)
    plan = {}
    if cfg.fault_rate >= 1.0 and cfg.faults:  # every refit after the first, each kind in turn
        order = list(cfg.faults)
        rng.shuffle(order)
        return {i: order[(i - 2) % len(order)] for i in range(2, cfg.refits + 1)}
    for i in range(2, cfg.refits + 1):
        if cfg.faults and rng.random() < cfg.fault_rate:
            plan[i] = rng.choice(cfg.faults)
    return plan


def _transport(cfg: ChaosConfig, rank: int):
    from nemo_dcr.transport import DistTransport

    store = dist.FileStore(os.path.join(cfg.workdir, "refit_store"), cfg.trainers + 1)
    return DistTransport(dist.ProcessGroupGloo(store, rank, cfg.trainers + 1), rank, chunk_bytes=1 << 14)


def engine_main(cfg: ChaosConfig) -> None:
    """Engine process: serve until STOP while a reader thread 'generates' under the guard."""
    from nemo_dcr.apply import InjectedFault, TensorEngine
    from nemo_dcr.refit.server import EngineServer

    torch.set_num_threads(1)
    engine = TensorEngine({n: torch.zeros(s, dtype=torch.bfloat16) for n, s in SHAPES.items()}, key=KEY)
    server = EngineServer(engine, _transport(cfg, cfg.trainers), list(range(cfg.trainers)))
    arm = Path(cfg.workdir, "crash.arm")  # out-of-band fault control: trainer rank 0 arms a crash
    crashed = []

    def fault(name: str) -> None:
        if arm.exists() and list(engine.tensors).index(name) == 1:
            arm.unlink()
            crashed.append(name)
            raise InjectedFault(f"chaos: crash after writing {name}")

    engine.fault = fault
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
    stats = dict(committed=server.stats.committed, resyncs=server.stats.resyncs, refused=server.stats.refused,
                 duplicates_dropped=server.stats.duplicates_dropped, replays_dropped=server.stats.replays_dropped,
                 mixed_version_served=engine.guard.mixed_version_served, reads=engine.guard.reads_served,
                 crashes=len(crashed))
    Path(cfg.workdir, "engine.json").write_text(json.dumps(stats))
    server.transport.close()


def _tamper(kind: str, rank: int):
    from nemo_dcr.transport import Envelope

    if kind == "drop" and rank == 0:
        return lambda envs: envs[1:]
    if kind == "duplicate":
        return lambda envs: envs + envs
    if kind == "reorder":
        return lambda envs: envs[::-1]
    if kind == "corrupt" and rank == 0:
        return lambda envs: [Envelope(e.kind, e.version, e.sender, e.part, e.last,
                                      e.body[:-48] + bytes(48) if i == 0 else e.body) for i, e in enumerate(envs)]
    return None


def _dense_digests(trainer) -> dict[str, str] | None:
    """Independent dense export: gather every shard on rank 0, sha256 of the bits."""
    out = {}
    for name, p in trainer.params.items():
        parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(p.clone(), parts, dst=0)
        if parts is not None:
            out[name] = hashlib.sha256(torch.cat(parts).view(torch.int16).numpy().tobytes()).hexdigest()
    return out if dist.get_rank() == 0 else None


def _engine_digests(sender) -> dict[str, str]:
    from nemo_dcr.refit.messages import QUERY_DIGESTS
    from nemo_dcr.transport import Envelope, MessageKind

    sender.transport.send(sender.engine_ranks[0], Envelope(MessageKind.QUERY, QUERY_DIGESTS, sender.transport.rank))
    sender.transport.flush()
    return sender._await(QUERY_DIGESTS, (MessageKind.STATE,))[0].digests


def _new_sender(cfg: ChaosConfig, rank: int, transport):
    from nemo_dcr.refit.group import DistGroup
    from nemo_dcr.refit.mirror import SenderMirror
    from nemo_dcr.refit.routing import assign_owners
    from nemo_dcr.refit.sender import RefitConfig, RefitSender
    from nemo_dcr.verify.report import VerifyPolicy

    owners = assign_owners({n: int(torch.tensor(s).prod()) for n, s in SHAPES.items()}, cfg.trainers)
    mirror = SenderMirror({n: ("bf16", s) for n, s in SHAPES.items() if owners[n] == rank})
    config = RefitConfig(key=KEY, max_changes_per_part=400, reply_timeout=60, verify=VerifyPolicy(True, 4),
                         model="chaos")
    return RefitSender(config, DistGroup(), transport, [cfg.trainers], owners, mirror)


def _one_refit(cfg, i, kind, rank, trainer, sender, transport, checkpoints):
    """Run refit ``i`` (with its fault); returns the outcome and the possibly new sender."""
    checkpoints.append(trainer.state())
    trainer.step()
    if kind == "trainer-resume":
        trainer.load(checkpoints[max(0, len(checkpoints) - 3)])
        sender = _new_sender(cfg, rank, transport)
        out = sender.attach(trainer.pieces(i), trainer.checksums())
    else:
        if kind == "crash-mid-apply" and rank == 0:
            Path(cfg.workdir, "crash.arm").touch()
        dist.barrier()
        out = sender.refit(trainer.pieces(i), trainer.checksums(), tamper=_tamper(kind or "", rank),
                           base_skew=int(kind == "version-skew"))
    if out.committed:
        trainer.commit(i)
    return out, sender


def trainer_main(cfg: ChaosConfig, rank: int) -> None:
    """Trainer rank: attach, then ``cfg.refits`` refits with the scheduled faults."""
    from nemo_dcr.transport import Envelope, MessageKind
    from tests.standins.shard_trainer import ShardTrainer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{cfg.workdir}/trainer_store", rank=rank,
                            world_size=cfg.trainers)
    transport = _transport(cfg, rank)
    trainer = ShardTrainer(SHAPES, rank, cfg.trainers, seed=cfg.seed)
    sender = _new_sender(cfg, rank, transport)
    if sender.attach(trainer.pieces(0), trainer.checksums()).committed:
        trainer.commit(0)
    plan, checkpoints, rows = schedule(cfg), [], []
    for i in range(1, cfg.refits + 1):
        out, sender = _one_refit(cfg, i, plan.get(i), rank, trainer, sender, transport, checkpoints)
        dense = _dense_digests(trainer)
        if rank == 0:
            exact = dense == _engine_digests(sender)
            rows.append(dict(refit=i, fault=plan.get(i), committed=out.committed, resynced=out.resynced,
                             detected=list(out.detected), version=out.version, bit_exact=exact,
                             changed=out.changed, bytes=out.bytes_sent))
    if rank == 0:
        transport.send(cfg.trainers, Envelope(MessageKind.STOP, 0, rank))
        transport.flush()
        Path(cfg.workdir, "trainer.json").write_text(json.dumps(rows))
    transport.close()
    dist.barrier()
    dist.destroy_process_group()


def summarize(cfg: ChaosConfig, rows: list[dict], engine: dict) -> dict:
    """The JSON report."""
    absorbed = {"duplicate": engine["duplicates_dropped"] > 0, "reorder": True}
    by = {k: dict(injected=0, detected=0, recovered=0) for k in cfg.faults}
    for r in rows:
        k = r["fault"]
        if k is None:
            continue
        by[k]["injected"] += 1
        by[k]["detected"] += int(bool(r["detected"]) or absorbed.get(k, False))
        by[k]["recovered"] += int(r["committed"] and r["bit_exact"])
    return dict(refits=len(rows), faults_injected={k: v["injected"] for k, v in by.items()},
                detected=sum(v["detected"] for v in by.values()),
                recovered=sum(v["recovered"] for v in by.values()), by_fault=by,
                bit_exact_after_every_refit=all(r["bit_exact"] for r in rows) and len(rows) == cfg.refits,
                mixed_version_served=engine["mixed_version_served"], engine=engine,
                changed_per_refit=[r["changed"] for r in rows], seed=cfg.seed, trainer_ranks=cfg.trainers,
                engine_ranks=1, trainer="ShardTrainer (row shards, fp32-master AdamW)")


def _entry(role: str, cfg: ChaosConfig, rank: int) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    engine_main(cfg) if role == "engine" else trainer_main(cfg, rank)


def run_chaos(cfg: ChaosConfig, timeout: float = 300.0) -> dict:
    """Spawn ``cfg.trainers`` trainer processes and one engine process; return the report."""
    import multiprocessing as mp
    import tempfile

    with tempfile.TemporaryDirectory(prefix="nemo-dcr-chaos-") as tmp:
        cfg = ChaosConfig(cfg.refits, cfg.faults, cfg.seed, cfg.trainers, cfg.fault_rate, tmp)
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
