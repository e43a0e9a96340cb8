"""Chaos processes and their supervisor: ``tp * pp`` megatron-core trainer ranks (:mod:`.trainer`)
and one engine process (:mod:`.engine`: the transformers model or a real vLLM engine), started,
watched and restarted by :func:`run_chaos`, the supervisor, in this process.

The supervisor polls the processes; it publishes what it saw (``status``: the refit group's
generation and the time it looked) and logs every death it sees with its exit code.  An engine
that died is started afresh from the initial weights (a new generation of the refit group, which
the trainers wire up to); a trainer rank that died brings the other ranks down (SIGKILL: they may
be stuck in a collective with it) and the job is relaunched from its last trainer checkpoint.
Only the supervisor starts or kills processes on purpose; a fault's own SIGKILL comes from the
process it hits.  Every process draws the same fault schedule from the seed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
import threading
import time
from dataclasses import replace

from .config import ChaosConfig, write_initial_weights
from .state import Workdir


def _entry(role: str, cfg: ChaosConfig, rank: int, generation: int, restart: dict | None) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if role == "engine":
        os.setsid()  # its own process group: nothing it started outlives it
        from .engine import engine_main

        engine_main(cfg, generation)
    else:
        from .trainer import trainer_main

        trainer_main(cfg, rank, generation, restart)


class Supervisor:
    """Starts the processes, sees them die, restarts them (see the module docstring)."""

    def __init__(self, cfg: ChaosConfig, wd: Workdir):
        import multiprocessing as mp

        self.cfg, self.wd, self.ctx = cfg, wd, mp.get_context("spawn")
        self.generation = 0
        self.restarts = 0

    def _start(self, role: str, rank: int, restart: dict | None = None):
        p = self.ctx.Process(target=_entry, args=(role, self.cfg, rank, self.generation, restart),
                             name=f"chaos-{role}-{rank}")
        p.start()
        self.wd.append("supervisor.jsonl", dict(started=role, rank=rank, pid=p.pid, gen=self.generation,
                                                t=round(time.time(), 3)))
        return p

    def _start_engine(self):
        """The engine process; ``engine-started`` names it before any trainer wires up to its
        generation, so trainers wait for that very process to be ready (``engine-ready``)."""
        p = self._start("engine", self.cfg.trainers)
        self.wd.publish("engine-started", dict(pid=p.pid, gen=self.generation))
        return p

    def _next_generation(self, why: str, engine: bool = False):
        """A new generation of the refit group (with a fresh engine process first if ``engine``)."""
        self.restarts += 1
        if self.restarts > 2 * self.cfg.refits + 4:
            raise RuntimeError(f"chaos: {self.restarts} restarts for {self.cfg.refits} refits; giving up")
        self.generation += 1
        started = self._start_engine() if engine else None
        self.wd.publish("generation", dict(gen=self.generation, why=why))
        return started

    sample_s = 10.0
    """Seconds between two samples of the processes' resident memory."""

    def _sample(self, engine, trainers) -> None:
        """Resident memory of the engine and the trainer ranks (MB; the rank-0 pid names the job)."""
        mb = {p.pid: _rss_mb(p.pid) for p in [engine] + trainers if p.exitcode is None}
        row = dict(t=round(time.time(), 1))
        if engine.pid in mb:
            row["engine"] = dict(pid=engine.pid, mb=mb[engine.pid])
        if all(p.pid in mb for p in trainers):
            row["trainers"] = dict(pid=trainers[0].pid, mb=round(sum(mb[p.pid] for p in trainers), 1))
        self.wd.append("supervisor.jsonl", dict(rss=row))

    def _died(self, role: str, rank: int, p) -> dict:
        row = dict(died=role, rank=rank, pid=p.pid, code=p.exitcode, gen=self.generation, t=round(time.time(), 3))
        self.wd.append("supervisor.jsonl", row)
        return row

    def run(self, timeout: float) -> None:
        """Until every trainer rank finished its refits and the engine stopped (or ``timeout``)."""
        self.wd.publish("generation", dict(gen=0, why="start"))
        engine = self._start_engine()
        trainers = [self._start("trainer", r) for r in range(self.cfg.trainers)]
        deadline = time.monotonic() + timeout
        next_sample = time.monotonic()
        try:
            while time.monotonic() < deadline:
                looked = time.time()  # what the status says it saw was looked at after this
                if all(p.exitcode == 0 for p in trainers):
                    engine.join(max(1.0, deadline - time.monotonic()))
                    if engine.exitcode != 0:
                        raise RuntimeError(f"chaos: the engine process ended with exit code {engine.exitcode}")
                    return
                if engine.exitcode not in (None, 0):  # 0: it served its STOP and ended
                    self._died("engine", self.cfg.trainers, engine)
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(engine.pid, signal.SIGKILL)  # what it started (vLLM's engine core)
                    engine = self._next_generation("the engine process died", engine=True)
                dead = [(r, p) for r, p in enumerate(trainers) if p.exitcode not in (None, 0)]
                if dead:
                    seen = [self._died("trainer", r, p) for r, p in dead]
                    for p in trainers:
                        if p.exitcode is None:
                            p.kill()  # the others may wait on it in a collective
                    for p in trainers:
                        p.join(60)
                    self._next_generation("a trainer process died")
                    trainers = [self._start("trainer", r, dict(after=seen)) for r in range(self.cfg.trainers)]
                self.wd.publish("status", dict(gen=self.generation, t=looked))
                if time.monotonic() >= next_sample:
                    next_sample = time.monotonic() + self.sample_s
                    self._sample(engine, trainers)
                time.sleep(0.1)
            raise TimeoutError(f"chaos: not finished within {timeout}s")
        finally:
            for p in trainers + [engine]:
                if p.exitcode is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.pid, signal.SIGKILL) if p is engine else p.kill()
                    p.join(10)


def _rss_mb(pid: int) -> float:
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return 0.0


def _disk(cfg: ChaosConfig, wd: Workdir):
    """The store's folder: scarce (a tmpfs, or read-only when full) when ``disk-full`` is scheduled."""
    if "disk-full" not in cfg.faults:
        return contextlib.nullcontext()
    from .disk import ScarceFolder

    return ScarceFolder(wd.store, size_mb=64)


@contextlib.contextmanager
def _terminated_exits():
    """SIGTERM (e.g. ``timeout``) ends the run through its cleanup: the processes it started are
    killed, the tmpfs is unmounted, the work folder removed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_chaos(cfg: ChaosConfig, timeout: float = 1800.0) -> dict:
    """Run the chaos scenario under the supervisor; return the report (:mod:`.tally`)."""
    from .tally import summarize

    if "disk-full" in cfg.faults and cfg.transport != "store":
        raise ValueError("disk-full is a fault of the store transport: run with transport 'store'")
    with tempfile.TemporaryDirectory(prefix="nemo-dcr-chaos-") as tmp:
        cfg = replace(cfg, workdir=tmp, until=time.time() + cfg.duration_s if cfg.duration_s > 0 else 0.0)
        wd = Workdir(tmp)
        write_initial_weights(cfg, wd)
        for folder in (wd.checks, wd.path("ckpt"), wd.path("fired")):
            folder.mkdir()
        t0 = time.monotonic()
        with _disk(cfg, wd) as disk:
            if disk is not None:
                wd.publish("disk", dict(how=disk.how))
            with _terminated_exits():
                Supervisor(cfg, wd).run(timeout)
        return summarize(cfg, wd, time.monotonic() - t0)
