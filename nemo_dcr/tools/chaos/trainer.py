"""The chaos trainer processes: ``tp * pp`` megatron-core ranks stepping a small GPTModel for real
(fp32-master AdamW, the pipeline driven by hand) and refitting the engine process through
``DeltaRefit`` after every step, as users do.

After every refit trainer rank 0 hands an independent dense export (gather + whole-tensor
conversion) to the engine process, which compares it with what it holds by its own means, and
appends the refit's row to ``rows.jsonl``.  Every few steps the ranks write a trainer checkpoint
(masters, AdamW state, data order), which a relaunch after ``kill-trainer`` resumes from.  When
a refit loses its exchange with the engine (a killed engine, a stall, a full disk), rank 0 asks
the supervisor whether the engine process died; if it did, the ranks wire up to its successor
(a new generation of the refit group) and attach to it.
"""

from __future__ import annotations

import os
import random
import signal
import time

import torch
import torch.distributed as dist

from .faults import FAILS_BY_DESIGN, TRAINER_KILL_POINTS, schedule, tamper_for
from .state import Workdir


class KillSwitch:
    """This rank's refit transport, which SIGKILLs its process after ``after`` more sends once armed."""

    def __init__(self, inner, wd: Workdir):
        self.inner, self.wd, self.rank = inner, wd, inner.rank
        self.left: int | None = None
        self.note: dict = {}

    def arm(self, after: int, **note) -> None:
        self.left, self.note = after, note

    def die(self) -> None:
        """SIGKILL of this process (logged first)."""
        self.wd.append("faults.jsonl", dict(self.note, pid=os.getpid(), t=round(time.time(), 3)))
        os.kill(os.getpid(), signal.SIGKILL)

    def send(self, dst, env):
        if self.left is not None:
            if self.left <= 0:
                self.die()
            self.left -= 1
        self.inner.send(dst, env)

    def flush(self):
        if self.left is not None and self.left <= 0:
            self.die()
        self.inner.flush()

    def recv(self, src=None, timeout=None):
        return self.inner.recv(src, timeout)

    def close(self, timeout: float = 60.0):
        if hasattr(self.inner, "close"):
            self.inner.close(timeout)


class Trainer:
    """A megatron-core policy on this rank, its checkpoints, and the refit that follows it."""

    def __init__(self, cfg, rank: int, generation: int):
        from nemo_dcr.integrations.megatron.params import local_params
        from nemo_dcr.refit.wiring import trainer_group
        from nemo_dcr.tools.megatron import build as am
        from nemo_dcr.tools.megatron.train import MasterAdamW

        from .config import chaos_dims

        self.cfg, self.rank, self.wd = cfg, rank, Workdir(cfg.workdir)
        self.dims = chaos_dims(cfg)
        am.init_distributed(cfg.tp, cfg.pp, etp=1)
        self.chunks = am.build_gpt_model(self.dims, torch.bfloat16)
        self.opt = MasterAdamW(local_params(self.chunks, self.dims), self.dims.tie_word_embeddings, lr=3e-4)
        self.gen = torch.Generator().manual_seed(cfg.seed)
        self.group = trainer_group()
        self.generation = generation
        self.wiring = self._wire(generation)
        self.refit = self.new_refit()

    def _wire(self, generation: int):
        from nemo_dcr.refit.wiring import engine_wiring

        from .config import refit_transport

        self._engine_up()
        self.switch = KillSwitch(refit_transport(self.cfg, self.wd, self.rank, generation), self.wd)
        if self.rank == 0:  # the group is formed: every rank and the engine are in it
            self.wd.publish("trainers-joined", dict(pid=os.getpid(), gen=generation))
        return engine_wiring(self.switch, range(self.cfg.trainers), [self.cfg.trainers], self.group)

    def _engine_up(self, timeout: float = 900.0) -> None:
        """Wait until the engine process the supervisor started last has loaded its model: an
        engine restarts slower than the run's short reply timeout under load, and the store
        transport, unlike gloo's rendezvous, does not wait for the peer to be there."""
        deadline = time.monotonic() + timeout
        while True:
            started, ready = self.wd.look("engine-started"), self.wd.look("engine-ready")
            if started and ready and ready["pid"] == started["pid"]:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"chaos: engine process {started} not ready within {timeout}s")
            time.sleep(0.2)

    def new_refit(self):
        """A fresh DeltaRefit (a restarted trainer process: new baseline, owners and mirror)."""
        from nemo_dcr.refit import DeltaRefit

        from .config import KEY, dcr_config

        return DeltaRefit.from_config(dcr_config(self.cfg), self.chunks, wiring=self.wiring,
                                      key=KEY if self.cfg.keyed else None, vocab_size=self.dims.vocab_size)

    def rewire(self, generation: int):
        """Wire up to the engine of ``generation`` (its predecessor died) and attach to it."""
        from nemo_dcr.transport import TransportError

        try:
            self.wiring.close(10)
        except TransportError:
            pass  # peers that are gone
        self.generation = generation
        self.wiring = self._wire(generation)
        self.refit = self.new_refit()
        return self.refit.attach()

    def train_step(self) -> None:
        """One real AdamW step on random tokens (forward/backward through the pipeline by hand)."""
        from nemo_dcr.tools.megatron.train import pipeline_forward_backward

        tokens = torch.randint(0, self.dims.vocab_size, (2, 17), generator=self.gen)
        pipeline_forward_backward(self.chunks[0], tokens[:, :-1], tokens[:, 1:], self.dims.hidden_size,
                                  torch.bfloat16)
        self.opt.step()

    # -- trainer checkpoints (what a relaunch resumes from) --------------------------------------

    def save(self, refit: int) -> None:
        """Every rank writes its state after the step of ``refit``; rank 0 then names it the latest."""
        folder = self.wd.path("ckpt", str(refit))
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".rank{self.rank}.tmp"
        torch.save(dict(opt=self.opt.state(), rng=self.gen.get_state(), refit=refit), tmp)
        os.replace(tmp, folder / f"rank{self.rank}.pt")
        dist.barrier()
        if self.rank == 0:
            self.wd.publish("ckpt/latest", dict(refit=refit))

    def resume(self) -> int:
        """Load the latest checkpoint; returns its refit number (0: none, the initial weights)."""
        latest = (self.wd.look("ckpt/latest") or {}).get("refit", 0)
        if latest:
            state = torch.load(self.wd.path("ckpt", str(latest), f"rank{self.rank}.pt"), weights_only=False)
            self.opt.load(state["opt"])
            self.gen.set_state(state["rng"])
        return latest

    # -- the independent check -------------------------------------------------------------------

    def dense_check(self, tag: str, timeout: float = 300.0) -> dict | None:
        """Rank 0: the engine's comparison with an independent dense export (collective)."""
        from nemo_dcr.checkpoint import save_checkpoint
        from nemo_dcr.tools.megatron.dense import dense_export

        dense = dense_export(self.chunks, self.dims, dst=0)
        if dense is None:
            return None
        path = self.wd.checks / f"{tag}.safetensors"
        save_checkpoint({n: t.contiguous() for n, t in dense.items()}, path)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            answer = self.wd.look(f"checks/{tag}.json")
            if answer is not None:
                path.unlink(missing_ok=True)
                return answer
            time.sleep(0.05)
        return dict(version=-1, fingerprint="", differing=["(no answer from the engine)"])


REAP_S = 0.5
"""Seconds between a peer's sockets closing and its exit being seen (reaped) by the supervisor."""


def _ask_supervisor(t: Trainer, since: float) -> int:
    """The engine generation the supervisor saw, looking after ``since`` (collective; rank 0 asks)."""
    gen = [t.generation]
    if t.rank == 0:
        while True:
            status = t.wd.look("status") or {}
            if status.get("t", 0) > since + REAP_S:
                gen = [status["gen"]]
                break
            time.sleep(0.05)
    dist.broadcast_object_list(gen, src=0)
    return gen[0]


def _arm(t: Trainer, i: int, kind: str | None, rng: random.Random) -> dict:
    """Arm this refit's fault where it acts; returns what the row records of it."""
    cfg, rank, note = t.cfg, t.rank, {}
    if kind == "kill-trainer":
        victim = random.Random(cfg.seed * 31 + i).randrange(cfg.trainers)
        if rank == victim and not t.wd.look(f"fired/kill-trainer-{i}"):
            point = rng.choice(TRAINER_KILL_POINTS)
            after = rng.randrange(3) if point == TRAINER_KILL_POINTS[0] else None
            t.wd.publish(f"fired/kill-trainer-{i}", dict(rank=rank))
            note = dict(kill="trainer", rank=rank, refit=i, point=point, after_sends=after)
            if after is not None:
                t.switch.arm(after, **note)
    elif rank == 0 and kind == "crash-mid-apply":
        t.wd.arm("crash", refit=i)
    elif rank == 0 and kind == "kill-engine":
        t.wd.arm("kill-engine", refit=i)
    elif rank == 0 and kind == "stall":
        t.wd.arm("stall", refit=i, seconds=cfg.reply_timeout_s + 5)
    elif rank == 0 and kind == "disk-full":
        _disk(t).exhaust()
    dist.barrier()
    return note


def _disk(t: Trainer):
    from .disk import ScarceFolder

    return ScarceFolder.attached(t.wd.store, t.wd.look("disk")["how"])


def one_refit(t: Trainer, i: int, kind: str | None, checkpoints: list, rng: random.Random, log: list):
    """Step, (checkpoint,) inject ``kind`` and refit; returns ``(report, rewired)``."""
    checkpoints.append(t.opt.state())
    t.train_step()
    if i % t.cfg.ckpt_every == 0:
        t.save(i)
    if kind == "trainer-resume":
        t.opt.load(checkpoints[max(0, len(checkpoints) - 3)])
        t.refit = t.new_refit()
        return t.refit.attach(), False
    note = _arm(t, i, kind, rng)
    out = t.refit.step(tamper=tamper_for(kind, t.rank, rng, t.cfg.keyed, log), base_skew=int(kind == "version-skew"))
    if note.get("point") == TRAINER_KILL_POINTS[1]:
        t.switch.arm(0, **note)
        t.switch.die()
    if kind == "disk-full" and t.rank == 0:
        _disk(t).restore()  # the space returns; the next refit recovers
    dist.barrier()
    if t.refit.sender.uncertain:
        gen = _ask_supervisor(t, time.time())
        if gen != t.generation:
            return t.rewire(gen), True
    return out, False


def _row(t: Trainer, i: int, kind: str | None, out, before: int, gen_before: int, rewired: bool, log: list,
         **extra) -> dict:
    """One row of ``rows.jsonl`` (rank 0), with the engine's answer to the dense check."""
    check = t.dense_check(f"{t.generation}-{i}-{time.monotonic_ns()}") if out.committed else None
    if t.rank != 0:
        return {}
    return dict(refit=i, fault=kind, gen=t.generation, gen_before=gen_before, t=round(time.time(), 3),
                committed=out.committed, resynced=out.resynced,
                mode=out.mode, detected=list(out.detected), version_before=before, version=out.version,
                rewired=rewired, bit_exact=None if check is None else not check["differing"],
                checked_version=None if check is None else check["version"],
                fingerprint=None if check is None else check["fingerprint"], changed=out.changed,
                bytes=out.payload_bytes, corrupted=log, seconds=round(out.times.get("total", 0.0), 4), **extra)


def _time_is_up(cfg) -> bool:
    """Whether a soak's time is over (rank 0's clock, broadcast so every rank stops at the same refit)."""
    if not cfg.until:
        return False
    flag = torch.tensor([1 if time.time() >= cfg.until else 0], dtype=torch.int32)
    dist.broadcast(flag, 0)
    return bool(flag.item())


def trainer_main(cfg, rank: int, generation: int, restart: dict | None) -> None:
    """Trainer rank: attach (resuming from the latest checkpoint after a relaunch), then the refits
    with the scheduled faults, until refit ``cfg.refits`` (or a soak's ``cfg.until``)."""
    from nemo_dcr.transport import Envelope, MessageKind

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{cfg.workdir}/trainer_store.{generation}", rank=rank,
                            world_size=cfg.trainers)
    t = Trainer(cfg, rank, generation)
    start = t.resume() if restart else 0
    out = t.refit.attach()
    row = _row(t, start, None, out, -1, generation, False, [], restart=restart)
    if rank == 0:
        t.wd.append("rows.jsonl", row)
    before = out.version
    plan, checkpoints = schedule(cfg.refits, cfg.faults, cfg.seed, cfg.fault_rate), []
    rng = random.Random(cfg.seed * 7919 + rank + 1000 * generation)
    for i in range(start + 1, cfg.refits + 1):
        if plan.get(i - 1) not in FAILS_BY_DESIGN and _time_is_up(cfg):
            break  # (a refit that recovers the one before it is always made)
        kind = plan.get(i)
        if kind == "kill-trainer" and t.wd.look(f"fired/kill-trainer-{i}"):
            kind = None  # the relaunch redoes this refit without killing again
        log: list = []
        gen_before = t.generation
        out, rewired = one_refit(t, i, kind, checkpoints, rng, log)
        row = _row(t, i, kind, out, before, gen_before, rewired, log)
        if rank == 0:
            t.wd.append("rows.jsonl", row)
        before = out.version
    if rank == 0:
        t.wiring.transport.send(cfg.trainers, Envelope(MessageKind.STOP, 0, rank))
        t.wiring.transport.flush()
    t.wiring.close(60)
    dist.barrier()
    dist.destroy_process_group()
