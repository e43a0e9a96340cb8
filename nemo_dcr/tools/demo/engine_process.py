"""The demo's engine in a process of its own (``engine.placement: separate``).

Trainer rank ``engine.rank`` starts it on its own node; trainers and engine then form two gloo
groups over file stores in the run folder (trainer ranks ``0..T-1``, the engine ``T``): the refit
runs over the first exactly as for any remote engine (every trainer rank sends what it owns over
``DistTransport`` to the :class:`~nemo_dcr.refit.EngineServer` in this process, in a thread); the
second carries the efficient dense refit timed next to it (:mod:`nemo_dcr.tools.demo.dense_refit`).

The demo itself (not the refit) talks to the engine over a pipe to the starting trainer rank:
readiness, rollouts and the dense refit's start.  Engines: the transformers model, or a real vLLM
engine (:class:`~nemo_dcr.integrations.vllm.engine.VllmEngine`, TP=1) loaded from the HF folder the
starting rank wrote.  Unless the run is verbose, everything the engine process (and vLLM in it)
prints goes to ``log`` (``runs/<run>/engine.log``).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from nemo_dcr.tools.demo.dense_refit import DenseLink, DenseResult, engine_group, load_dense
from nemo_dcr.tools.demo.hf_engine import build_hf_engine


@dataclass(frozen=True)
class EngineSetup:
    """What the engine process is started with (pickled once to the spawned process: demo data)."""

    kind: str
    hf_dir: str
    store_dir: str
    trainers: int
    key: bytes | None
    rl_cfg: object
    seed: int
    dcr: object
    dims: object
    log: str | None
    """File the engine process writes its output to (None: the terminal)."""


def refit_group(store_dir: Path, rank: int, trainers: int):
    """This process's :class:`~nemo_dcr.transport.DistTransport` of the trainers + engine group."""
    from nemo_dcr.transport import DistTransport

    store = dist.FileStore(str(store_dir / "refit_store"), trainers + 1)
    return DistTransport(dist.ProcessGroupGloo(store, rank, trainers + 1), rank)


def dense_link(store_dir: Path, rank: int, trainers: int, chunks=None, dims=None) -> DenseLink:
    """This process's end of the dense refit's group (collective with every trainer rank and the engine)."""
    group = engine_group(str(store_dir / "dense_store"), rank, trainers)
    return DenseLink(group, rank, trainers, trainers, chunks, dims)


def _redirect(log: str | None) -> None:
    """Send this process's (and its children's) stdout and stderr to ``log``."""
    if log is None:
        return
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _build(setup: EngineSetup):
    """``(engine, tokenizer, startup seconds)`` of ``setup.kind`` loaded from its HF folder."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(setup.hf_dir)
    t0 = time.perf_counter()
    if setup.kind == "vllm":
        from nemo_dcr.integrations.vllm.engine import VllmEngine

        engine = VllmEngine.start(setup.hf_dir, key=setup.key, keep_index=setup.dcr.engine_index,
                                  threads=setup.dcr.threads, max_model_len=512, max_num_seqs=64)
        return engine, tokenizer, dict(engine.startup_seconds)
    return build_hf_engine(Path(setup.hf_dir), setup.key, setup.dcr), tokenizer, {"load": time.perf_counter() - t0}


def engine_main(conn, setup: EngineSetup) -> None:
    """The engine process: serve refits in a thread, answer the demo over ``conn`` until ``stop``."""
    import random

    from nemo_dcr.refit.server import EngineServer
    from nemo_dcr.tools.demo.rollout import rollout

    _redirect(setup.log)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    try:
        engine, tokenizer, startup = _build(setup)
    except Exception as exc:
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        raise
    store, trainers = Path(setup.store_dir), setup.trainers
    server = EngineServer(engine, refit_group(store, trainers, trainers), list(range(trainers)))

    def serve() -> None:  # until STOP; then join the trainers' transport close handshake
        server.serve()
        server.transport.close()

    thread = threading.Thread(target=serve, name="nemo-dcr-engine", daemon=True)
    thread.start()
    link = dense_link(store, trainers, trainers, dims=setup.dims)
    conn.send(("ready", startup))
    rng, fp8 = random.Random(setup.seed), setup.dcr.engine_format == "fp8"
    while True:
        verb, arg = conn.recv()
        if verb == "rollout":
            conn.send(rollout(engine, tokenizer, rng, setup.rl_cfg))
        elif verb == "settle":  # the engine's work behind its last commit, waited for before the dense refit
            conn.send(engine.settle())
        elif verb == "dense":  # every trainer rank sends its shards now; load them by the engine's own loader
            tensors, recv_s, convert_s, nbytes = link.receive()
            load_s, check_s, same = load_dense(engine, tensors, arg, fp8)
            conn.send(DenseResult(recv_s, convert_s, load_s, check_s, same, nbytes))
        elif verb == "stop":
            break
    thread.join()  # the server stopped and its transport closed with the trainers'
    if setup.kind == "vllm":
        engine.close()
    conn.send(("stopped", {"committed": server.stats.committed, "refused": server.stats.refused}))


class EngineProcess:
    """The starting trainer rank's handle on the engine process."""

    def __init__(self, setup: EngineSetup):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.log = setup.log
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=engine_main, name="nemo-dcr-engine", args=(child, setup))
        self.proc.start()

    def wait_ready(self, timeout: float = 900.0) -> dict[str, float]:
        """Block until the engine loaded (vLLM takes a while); returns its start-up seconds.

        Raises:
            RuntimeError: the engine process failed or died (its log is named).
        """
        deadline = time.monotonic() + timeout
        while not self.conn.poll(1.0):
            if not self.proc.is_alive():
                raise RuntimeError(f"the engine process exited with code {self.proc.exitcode}{self._see_log()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the engine process did not start within {timeout}s{self._see_log()}")
        what, arg = self.conn.recv()
        if what != "ready":
            raise RuntimeError(f"the engine process failed: {arg}{self._see_log()}")
        return arg

    def died(self) -> str | None:
        """Why the engine process is gone (None while it runs): its exit code, or the signal that
        killed it."""
        if self.proc.is_alive():
            return None
        code = self.proc.exitcode
        if code is not None and code < 0:
            import signal

            name = signal.Signals(-code).name
            hint = ": often the kernel's out-of-memory killer (see dmesg)" if -code == signal.SIGKILL else ""
            return f"the engine process was killed by {name}{hint}{self._see_log()}"
        return f"the engine process exited with code {code}{self._see_log()}"

    def _see_log(self) -> str:
        return f" (its output: {self.log})" if self.log else ""

    def rollout(self):
        """One step's rollout batch from the engine's current version."""
        self.conn.send(("rollout", None))
        return self.conn.recv()

    def settle(self) -> float:
        """The engine waits for the work its last commit left running (its kept indexes' move);
        the seconds it waited."""
        self.conn.send(("settle", None))
        return self.conn.recv()

    def start_dense(self, version: int) -> None:
        """Tell the engine a dense refit to ``version`` begins (the trainers send their shards next)."""
        self.conn.send(("dense", version))

    def dense_result(self) -> DenseResult:
        """The engine's account of the dense refit it just loaded."""
        return self.conn.recv()

    def stop(self, timeout: float = 120.0) -> dict:
        """Stop the engine process (after the refit closed); its server's statistics."""
        self.conn.send(("stop", None))
        stats = self.conn.recv()[1] if self.conn.poll(timeout) else {}
        self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.kill()
        return stats
