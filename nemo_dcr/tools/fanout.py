"""The fan-out check: one trainer process, ``R`` engine replicas in processes of their own, the
refit run with ``dcr.fanout: direct`` and then ``relay`` (docs/refit.md "Fan-out").

Every process speaks gloo: the refit group (trainer rank 0, engine ranks ``1..R``) over one
two-rank process group per replica (:class:`~nemo_dcr.transport.peers.Peers`), the engines' own
process group for the relay's broadcasts.  Each replica starts empty; per mode the trainer
attaches, then runs ``steps`` refits of sparse bit changes, and after each one compares every
replica's sha256 digests with its own tensors' (the dense reference, not the refit's checksums).
Scheduled faults make one replica fail a version's apply (it rolls back and refuses); the
trainers' recovery resyncs that replica alone while the others keep the version.  Scheduled kills
SIGKILL a replica's process once the first part of a refit reached it (a root: after relaying
it); the local supervisor (:func:`run_fanout`) restarts it, the trainer detaches it, sends the
survivors of its relay group that version directly, connects the restarted process and
reattaches it, which resyncs it alone (refit/replicas.py).

Run locally with :func:`run_fanout` (``multiprocessing``), or one process per role with
``python -m nemo_dcr.tools.fanout --role trainer|engine --rank I --replicas R --master HOST:PORT
--workdir DIR`` (the Slurm check, ``scripts/slurm_cluster.sh fanout``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

KEY = b"fanout-check-key-0123456789abcdef"
MODES = ("direct", "relay")


@dataclass(frozen=True)
class FanoutJob:
    """One run: ``replicas`` engine replicas, ``steps`` refits per mode.

    Attributes:
        faults: ``"mode:step" -> replica`` whose apply fails at that refit (default: see
            :func:`default_faults`).
        kills: ``"mode:step" -> replica`` SIGKILLed at that refit once its first part arrived
            (a root: after relaying it); restarted by :func:`run_fanout` (local runs only).
        relay_nodes: the node of each replica, for relay groups of one root per node
            (``dcr.fanout_roots: node``; None: one group of every replica).
        master: ``host:port`` of the refit group's rendezvous (the trainer's node); empty: files
            in ``workdir``.
        engine_master: ``host:port`` of the engines' own rendezvous (replica 0's node).
    """

    replicas: int
    steps: int = 6
    modes: tuple[str, ...] = MODES
    tensors: int = 4
    numel: int = 1 << 16
    density: float = 0.01
    seed: int = 0
    faults: dict[str, int] | None = None
    kills: dict[str, int] | None = None
    relay_nodes: tuple[int, ...] | None = None
    workdir: str = ""
    master: str = ""
    engine_master: str = ""

    @property
    def engine_ranks(self) -> list[int]:
        return list(range(1, self.replicas + 1))

    def fault_plan(self) -> dict[str, int]:
        return default_faults(self) if self.faults is None else dict(self.faults)

    def relay_groups(self) -> list[list[int]]:
        from nemo_dcr.refit.relay import relay_groups

        if self.relay_nodes is None:
            return relay_groups(self.engine_ranks, 1)
        return relay_groups(self.engine_ranks, 1, list(self.relay_nodes), roots="node")


def default_faults(job: FanoutJob) -> dict[str, int]:
    """A replica that is not the root fails refit 3 of each mode; the root fails refit 5 of relay."""
    if job.replicas < 2 or job.steps < 5:
        return {}
    return {"direct:3": job.replicas - 1, "relay:3": job.replicas - 1, "relay:5": 0}


def _store(job: FanoutJob, name: str, rank: int, world: int):
    where = job.master if name == "refit" else job.engine_master
    if where:
        host, port = where.rsplit(":", 1)
        return dist.TCPStore(host, int(port), world, rank == 0, wait_for_workers=False)
    return dist.FileStore(os.path.join(job.workdir, f"{name}_store"), world)


_TRAINER_STORE: list = []


def _connect(job: FanoutJob, replica: int, generation: int, trainer: bool):
    """The refit connection between the trainer and replica ``replica``'s ``generation``-th
    process: a two-rank gloo group (the trainer rank 0) from its own prefix of the job's store."""
    from nemo_dcr.transport import DistTransport

    if job.master:
        if trainer and not _TRAINER_STORE:
            _TRAINER_STORE.append(_store(job, "refit", 0, job.replicas + 1))
        store = _TRAINER_STORE[0] if trainer else _store(job, "refit", 1, job.replicas + 1)
        store = dist.PrefixStore(f"refit-{replica}-{generation}", store)
    else:
        store = dist.FileStore(os.path.join(job.workdir, f"refit_store_{replica}_{generation}"), 2)
    rank = 0 if trainer else 1
    return DistTransport(dist.ProcessGroupGloo(store, rank, 2), rank, chunk_bytes=1 << 20)


def _trainer_transport(job: FanoutJob):
    from nemo_dcr.transport.peers import Peers

    return Peers(0, {i + 1: (_connect(job, i, 0, True), 1) for i in range(job.replicas)})


class _KillOnPart:
    """An engine's endpoint that SIGKILLs its process when the first part of a refit arrives
    while ``arm`` exists (the trainer creates it before that refit); the root has relayed the
    part by then (:meth:`RelayEndpoint.recv` relays before it returns)."""

    def __init__(self, inner, arm: Path):
        self.inner, self.arm, self.rank = inner, arm, inner.rank

    def recv(self, src=None, timeout=None):
        from nemo_dcr.transport import MessageKind

        env = self.inner.recv(src, timeout)
        if env.kind == MessageKind.DELTA and not env.last and self.arm.exists():
            self.arm.unlink()
            os.kill(os.getpid(), signal.SIGKILL)
        return env

    def send(self, dst, env):
        self.inner.send(dst, env)

    def flush(self):
        self.inner.flush()


def _weights(job: FanoutJob) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(job.seed)
    return {f"layer{i}.weight": torch.randn(job.numel, generator=g).bfloat16() for i in range(job.tensors)}


def _digests(tensors) -> dict[str, str]:
    from nemo_dcr.types import int_view

    return {n: hashlib.sha256(int_view(t.contiguous()).numpy().tobytes()).hexdigest() for n, t in tensors.items()}


def engine_main(job: FanoutJob, replica: int, generation: int = 0, modes: tuple[str, ...] | None = None) -> None:
    """Engine replica ``replica`` (refit rank ``replica + 1``): serve each mode until its STOP.
    A restarted process (``generation`` > 0) starts empty and serves ``modes`` (the one it died
    in on) over its own connection alone: the engines' process group cannot take it back."""
    from nemo_dcr.apply import InjectedFault, TensorEngine
    from nemo_dcr.refit.server import EngineServer
    from nemo_dcr.transport.peers import Peers
    from nemo_dcr.transport.relay import RelayEndpoint, relay_endpoint

    rank = replica + 1
    base = Peers(rank, {0: (_connect(job, replica, generation, False), 0)})
    if not generation:
        dist.init_process_group("gloo", store=_store(job, "engines", replica, job.replicas), rank=replica,
                                world_size=job.replicas)
    shapes = {n: t.shape for n, t in _weights(job).items()}
    engine = TensorEngine({n: torch.zeros(s, dtype=torch.bfloat16) for n, s in shapes.items()}, key=KEY)
    arm = Path(job.workdir, f"fail.{replica}.arm")

    def fault(name: str) -> None:
        if arm.exists():
            arm.unlink()
            raise InjectedFault(f"fan-out check: replica {replica} fails after writing {name}")

    engine.fault = fault
    kill = Path(job.workdir, f"kill.{replica}.arm")
    done = Path(job.workdir, f"engine{replica}.json")
    out, ep = json.loads(done.read_text()) if generation and done.exists() else {}, base
    for mode in job.modes if modes is None else modes:
        if mode == "relay" and not generation and not isinstance(ep, RelayEndpoint):
            ep = relay_endpoint(base, job.relay_groups(), {e: e - 1 for e in job.engine_ranks})
        server = EngineServer(engine, _KillOnPart(ep if mode == "relay" else base, kill), [0])
        server.serve()
        s = server.stats
        relay = asdict(ep.stats) if mode == "relay" and isinstance(ep, RelayEndpoint) else None
        out[mode] = dict(committed=s.committed, resyncs=s.resyncs, refused=s.refused,
                         replays_dropped=s.replays_dropped, duplicates_dropped=s.duplicates_dropped,
                         events=s.events, version=engine.version, relay=relay, generation=generation)
        done.write_text(json.dumps(out))  # after each mode: a process killed later keeps what it served
    ep.close(60) if ep is not base else base.close(60)
    if not generation:
        dist.destroy_process_group()


def _mutate(weights: dict[str, torch.Tensor], gen: torch.Generator, density: float) -> None:
    """Flip low bits of a ``density`` share of every tensor (a sparse optimizer step)."""
    for t in weights.values():
        n = max(1, int(t.numel() * density))
        pos = torch.randint(0, t.numel(), (n,), generator=gen)
        t.view(torch.int16)[pos] ^= torch.randint(1, 8, (n,), generator=gen, dtype=torch.int16)


def _one_mode(job: FanoutJob, base, weights, gen, mode: str, generations: dict[int, int]) -> list[dict]:
    from nemo_dcr.config.schema import DcrConfig
    from nemo_dcr.refit import DeltaRefit
    from nemo_dcr.refit.canonical import CanonicalSource
    from nemo_dcr.refit.group import LocalGroup
    from nemo_dcr.refit.messages import Ask
    from nemo_dcr.refit.wiring import engine_wiring
    from nemo_dcr.transport import Envelope, MessageKind

    cfg = DcrConfig(fanout=mode, reply_timeout_s=120, telemetry_encodings=[], verify="incremental", verify_steps=0)
    wiring = engine_wiring(base, [0], job.engine_ranks, LocalGroup(), relay=job.relay_groups())
    refit = DeltaRefit(cfg, CanonicalSource(weights), wiring, key=KEY)
    faults, kills, rows = job.fault_plan(), dict(job.kills or {}), []
    for step in range(job.steps + 1):
        if step:
            _mutate(weights, gen, job.density)
        failing, killed = faults.get(f"{mode}:{step}"), kills.get(f"{mode}:{step}")
        for what, replica in (("fail", failing), ("kill", killed)):
            if replica is not None:
                Path(job.workdir, f"{what}.{replica}.arm").touch()
        r = refit.attach() if step == 0 else refit.step()
        back = None
        if r.detached:  # their processes died: connect the restarted ones, resync them alone
            for e in r.detached:
                generations[e] = generations.get(e, 0) + 1
                base.replace(e, _connect(job, e - 1, generations[e], True), 1)
            back = refit.reattach(r.detached)
        want = _digests(weights)
        replies = refit.sender.query(Ask.DIGESTS)
        rows.append(dict(mode=mode, replicas=job.replicas, step=step, kind=r.mode, version=r.version,
                         committed=r.committed, resynced=r.resynced, failing=failing, killed=killed,
                         detached=list(r.detached), resynced_ranks=list(r.resynced_ranks),
                         detected=list(r.detected), links=r.bytes_on_links, seconds=r.times.get("total", 0.0),
                         reattach=None if back is None else dict(
                             committed=back.committed, version=back.version, resynced_ranks=list(back.resynced_ranks),
                             links=back.bytes_on_links, seconds=back.times.get("total", 0.0)),
                         versions=[x.version for x in replies], bit_exact=[x.digests == want for x in replies]))
    for e in job.engine_ranks:
        base.send(e, Envelope(MessageKind.STOP, 0, 0))
    base.flush()
    return rows


def trainer_main(job: FanoutJob) -> None:
    """The trainer (refit rank 0): every mode in turn, rows to ``trainer.json``."""
    base = _trainer_transport(job)
    weights, gen, generations = _weights(job), torch.Generator().manual_seed(job.seed + 1), {}
    rows = [row for mode in job.modes for row in _one_mode(job, base, weights, gen, mode, generations)]
    Path(job.workdir, "trainer.json").write_text(json.dumps(rows))
    base.close(60)  # after every replica wrote its counts
    Path(job.workdir, "summary.json").write_text(json.dumps(summarize(collect(job)), indent=1))


def _entry(role: str, job: FanoutJob, replica: int, generation: int = 0, modes: tuple[str, ...] | None = None) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    trainer_main(job) if role == "trainer" else engine_main(job, replica, generation, modes)


def collect(job: FanoutJob) -> dict:
    """The trainer's rows and every replica's counts of a finished job."""
    rows = json.loads(Path(job.workdir, "trainer.json").read_text())
    engines = [json.loads(Path(job.workdir, f"engine{i}.json").read_text()) for i in range(job.replicas)]
    job_keys = {k: v for k, v in asdict(job).items() if k not in ("workdir", "master", "engine_master")}
    return {"job": job_keys, "rows": rows, "engines": engines}


def run_fanout(job: FanoutJob, timeout: float = 300.0) -> dict:
    """Spawn the trainer and the replicas on this machine; return :func:`collect`'s result."""
    import tempfile

    from .procs import run_processes

    with tempfile.TemporaryDirectory(prefix="nemo-dcr-fanout-") as tmp:
        job = replace(job, workdir=tmp)
        roles = [("trainer", job, -1)] + [("engine", job, i) for i in range(job.replicas)]
        kills = {replica: key.split(":")[0] for key, replica in (job.kills or {}).items()}
        restarts: dict[int, int] = {}

        def restart(i: int, code: int):
            """A replica killed by its scheduled SIGKILL comes back as a fresh process."""
            replica = i - 1
            if code != -signal.SIGKILL or replica not in kills or restarts.get(replica):
                return None
            restarts[replica] = 1
            modes = job.modes[job.modes.index(kills[replica]):]
            return ("engine", job, replica, 1, modes)

        run_processes(_entry, roles, timeout, "fan-out (trainer first)", restart=restart)
        return collect(job)


def summarize(result: dict) -> list[dict]:
    """Per mode: the run's figures (what ``runs/slurm-fanout/summary.json`` lists)."""
    out = []
    for mode in result["job"]["modes"]:
        rows = [r for r in result["rows"] if r["mode"] == mode and r["step"] > 0]
        clean = [r for r in rows if r["failing"] is None and r.get("killed") is None]
        out.append(dict(
            mode=mode, replicas=result["job"]["replicas"], steps=len(rows),
            bit_exact_steps=sum(all(r["bit_exact"]) for r in rows),
            cross_link_bytes_per_version=sum(r["links"]["trainer_to_engine"] for r in clean) / max(len(clean), 1),
            engine_fanout_bytes_per_version=sum(r["links"]["engine_fanout"] for r in clean) / max(len(clean), 1),
            refit_seconds_delta=sum(r["seconds"] for r in clean) / max(len(clean), 1),
            resynced_alone=[r["step"] for r in rows if r["failing"] is not None and r["committed"]],
            killed=[dict(step=r["step"], replica=r["killed"], detached=r["detached"],
                         resynced_ranks=r["reattach"]["resynced_ranks"] if r["reattach"] else [],
                         cross_link_bytes=r["links"]["trainer_to_engine"],
                         resync_bytes=r["reattach"]["links"]["trainer_to_engine"] if r["reattach"] else 0)
                    for r in rows if r.get("killed") is not None]))
    return out


def main(argv: list[str] | None = None) -> None:
    """One process of a job (see the module docstring); the trainer prints the summary."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--role", choices=("trainer", "engine", "merge"), required=True,
                    help="merge: the runs' summaries under WORKDIR/r*/ into WORKDIR/summary.json")
    ap.add_argument("--rank", type=int, default=0, help="engine replica index")
    ap.add_argument("--replicas", type=int, default=0, help="engine replicas (trainer and engine roles)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--numel", type=int, default=1 << 20)
    ap.add_argument("--master", default="", help="host:port of the refit group's rendezvous (trainer node)")
    ap.add_argument("--engine-master", default="", help="host:port of the engines' rendezvous (replica 0's node)")
    ap.add_argument("--workdir", required=True)
    a = ap.parse_args(argv)
    if a.role == "merge":
        runs = [r for p in sorted(Path(a.workdir).glob("r*/summary.json")) for r in json.loads(p.read_text())]
        runs.sort(key=lambda r: (r["replicas"], r["mode"]))
        Path(a.workdir, "summary.json").write_text(json.dumps(runs, indent=1))
        print(json.dumps(runs, indent=1))
        return
    if a.replicas < 1:
        ap.error(f"--replicas must be >= 1 for the {a.role} role, got {a.replicas}")
    job = FanoutJob(a.replicas, a.steps, numel=a.numel, workdir=a.workdir, master=a.master,
                    engine_master=a.engine_master)
    _entry(a.role, job, a.rank)


if __name__ == "__main__":
    main()
