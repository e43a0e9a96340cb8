"""The demo's engine in a process of its own (``engine.placement: separate``).

Trainer rank ``engine.rank`` starts it on its own node; trainers and engine then form one gloo
group over a file store in the run folder (trainer ranks ``0..T-1``, the engine ``T``), and the
refit path runs exactly as for any remote engine: every trainer rank sends what it owns over
``DistTransport`` to the :class:`~nemo_dcr.refit.EngineServer` in this process (in a thread).

The demo itself (not the refit) talks to the engine over a pipe to the starting trainer rank:
rollouts, the independent dense comparison and the dense-refit timing.  Engines: the transformers
model, or a real vLLM engine (:class:`~nemo_dcr.integrations.vllm.engine.VllmEngine`, TP=1) loaded
from the HF folder the starting rank wrote.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from nemo_dcr.tools.demo.hf_engine import build_hf_engine, load_and_compare


def refit_group(store_dir: Path, rank: int, trainers: int):
    """This process's :class:`~nemo_dcr.transport.DistTransport` of the trainers + engine group."""
    from nemo_dcr.transport import DistTransport

    store = dist.FileStore(str(store_dir / "refit_store"), trainers + 1)
    return DistTransport(dist.ProcessGroupGloo(store, rank, trainers + 1), rank)


def _build(kind: str, hf_dir: Path, key: bytes | None, dcr):
    """(engine, tokenizer) of ``kind`` loaded from the HF folder ``hf_dir``."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    if kind == "vllm":
        from nemo_dcr.integrations.vllm.engine import VllmEngine

        return VllmEngine.start(str(hf_dir), key=key, keep_index=dcr.engine_index, max_model_len=512,
                                max_num_seqs=16), tokenizer
    return build_hf_engine(hf_dir, key, dcr), tokenizer


def _load_and_compare(kind: str, engine, dense: dict[str, torch.Tensor]) -> tuple[float, float, bool]:
    """The dense refit's last hop and whether the engine equals the dense export, bit for bit (by
    the engine's own means): ``(seconds of the load, seconds of the comparison, same)``."""
    if kind != "vllm":
        return load_and_compare(engine, dense)
    t0 = time.perf_counter()
    scratch = {n: t.clone() for n, t in dense.items()}
    t1 = time.perf_counter()
    from nemo_dcr.checkpoint import save_checkpoint

    with tempfile.TemporaryDirectory() as tmp:  # vLLM: every placed element of every rank against the checkpoint
        save_checkpoint(scratch, Path(tmp, "model.safetensors"))
        same = all(not bad for bad in engine.compare(tmp).values())
    return t1 - t0, time.perf_counter() - t1, same


def engine_main(conn, kind: str, hf_dir: str, store_dir: str, trainers: int, key: bytes | None,
                rl_cfg, seed: int, dcr) -> None:
    """The engine process: serve refits in a thread, answer the demo over ``conn`` until ``stop``."""
    import random

    from nemo_dcr.tools.demo.rollout import rollout
    from nemo_dcr.refit.server import EngineServer

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    engine, tokenizer = _build(kind, Path(hf_dir), key, dcr)
    server = EngineServer(engine, refit_group(Path(store_dir), trainers, trainers), list(range(trainers)))

    def serve() -> None:  # until STOP; then join the trainers' transport close handshake
        server.serve()
        server.transport.close()

    thread = threading.Thread(target=serve, name="nemo-dcr-engine", daemon=True)
    thread.start()
    conn.send(("ready", kind))
    rng = random.Random(seed)
    while True:
        verb, arg = conn.recv()
        if verb == "rollout":
            conn.send(rollout(engine, tokenizer, rng, rl_cfg))
        elif verb == "dense":  # the dense refit's last hop: load a dense export into scratch, then compare
            conn.send(_load_and_compare(kind, engine, arg))
        elif verb == "stop":
            break
    thread.join()  # the server stopped and its transport closed with the trainers'
    if kind == "vllm":
        engine.close()
    conn.send(("stopped", {"committed": server.stats.committed, "refused": server.stats.refused}))


class EngineProcess:
    """The starting trainer rank's handle on the engine process."""

    def __init__(self, kind: str, hf_dir: Path, store_dir: Path, trainers: int, key: bytes | None, rl_cfg,
                 seed: int, dcr):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=engine_main, name="nemo-dcr-engine",
                                args=(child, kind, str(hf_dir), str(store_dir), trainers, key, rl_cfg, seed, dcr))
        self.proc.start()

    def wait_ready(self, timeout: float = 900.0) -> str:
        """Block until the engine loaded (vLLM takes a while); returns its kind."""
        if not self.conn.poll(timeout):
            raise TimeoutError(f"the engine process did not start within {timeout}s")
        return self.conn.recv()[1]

    def rollout(self):
        """One step's rollout batch from the engine's current version."""
        self.conn.send(("rollout", None))
        return self.conn.recv()

    def dense(self, tensors: dict[str, torch.Tensor]) -> tuple[float, bool]:
        """Hand a dense export over; returns the seconds of the hand-over and the load into scratch
        (the comparison after it is not counted) and whether the engine equals the export."""
        t0 = time.perf_counter()
        self.conn.send(("dense", tensors))
        _load_s, compare_s, same = self.conn.recv()
        return time.perf_counter() - t0 - compare_s, same

    def stop(self, timeout: float = 120.0) -> dict:
        """Stop the engine process (after the refit closed); its server's statistics."""
        self.conn.send(("stop", None))
        stats = self.conn.recv()[1] if self.conn.poll(timeout) else {}
        self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.kill()
        return stats
