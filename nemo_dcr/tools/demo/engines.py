"""Where the demo's engine lives: in trainer rank ``engine.rank``'s process (``colocated``) or in a
process of its own next to it (``separate``, always for vLLM).  Both handles give the trainer ranks
the same things: readiness, rollouts, the efficient dense refit (every rank sends its shards over the
dense link; the engine's host loads them by the engine's own loader and checks the engine held what
that load gives it, :mod:`nemo_dcr.tools.demo.dense_refit`), and shutdown.  The refit itself never
goes through these handles: it is ``DeltaRefit`` to the engine's server.

With ``engine.weights: fp8`` the transformers engine holds the linear layers in FP8
(:class:`~nemo_dcr.integrations.hf.engine.HFEngine` with the plan of ``dcr``), and the dense
check compares its FP8 bytes and scales with an independent re-quantization of the dense tensors
(:func:`nemo_dcr.verify.fp8_reference.fp8_mismatches`).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import torch

from nemo_dcr.tools.demo.dense_refit import DenseLink, DenseResult, load_dense
from nemo_dcr.tools.demo.hf_engine import build_hf_engine


def write_initial_weights(init_dir: Path) -> Path:
    """The embedded model as an HF folder (bf16 safetensors, the dtype the trainer and the engine
    serve, config, tokenizer) under ``init_dir``: what the trainer ranks and the engine load;
    removed by :func:`remove_initial_weights`."""
    from nemo_dcr.integrations.hf.model import save_embedded_hf

    return save_embedded_hf(init_dir / "hf", torch.bfloat16)


def remove_initial_weights(init_dir: Path) -> None:
    """The run folder keeps only results: the hand-over folder goes once everything loaded it."""
    shutil.rmtree(init_dir, ignore_errors=True)


class ColocatedEngine:
    """A transformers engine in this process (its refit server runs in a thread of ``DeltaRefit``)."""

    def __init__(self, hf_dir: Path, key: bytes | None, rl_cfg, seed: int, dcr):
        import random

        from transformers import AutoTokenizer

        t0 = time.perf_counter()
        self.engine = build_hf_engine(hf_dir, key, dcr)
        self.startup = {"load": time.perf_counter() - t0}
        self.tokenizer = AutoTokenizer.from_pretrained(hf_dir)
        self.rl_cfg, self.rng, self.fp8 = rl_cfg, random.Random(seed), dcr.engine_format == "fp8"

    def describe(self) -> str:
        return f"transformers{' (FP8 weights)' if self.fp8 else ''}, colocated in this rank"

    def wait_ready(self) -> dict[str, float]:
        return self.startup

    def died(self) -> str | None:
        """Never: the engine lives in this process."""
        return None

    def rollout(self):
        from nemo_dcr.tools.demo.rollout import rollout

        return rollout(self.engine, self.tokenizer, self.rng, self.rl_cfg)

    def settle(self) -> float:
        """The engine's wait for the work its last commit left running; the seconds waited."""
        return self.engine.settle()

    def dense(self, link: DenseLink, version: int) -> DenseResult:
        """The host's side of one dense refit: the other ranks' shards and its own, loaded."""
        from nemo_dcr.tools.megatron.dense import first_replica_shards

        tensors, recv_s, convert_s, nbytes = link.receive(first_replica_shards(link.chunks, link.dims))
        load_s, check_s, same = load_dense(self.engine, tensors, version, self.fp8)
        return DenseResult(recv_s, convert_s, load_s, check_s, same, nbytes)

    def stop_server(self, transport) -> None:
        """Nothing to do: ``DeltaRefit.close`` stops the server it hosts."""

    def close(self) -> dict:
        return {}


class SeparateEngine:
    """The engine in a process of its own (:mod:`nemo_dcr.tools.demo.engine_process`)."""

    def __init__(self, setup):
        from nemo_dcr.tools.demo.engine_process import EngineProcess

        self.kind, self.trainers = setup.kind, setup.trainers
        self.proc = EngineProcess(setup)

    def describe(self) -> str:
        return f"{'vLLM' if self.kind == 'vllm' else 'transformers'} in a process of its own"

    def wait_ready(self) -> dict[str, float]:
        return self.proc.wait_ready()

    def died(self) -> str | None:
        """Why the engine process is gone (None while it runs)."""
        return self.proc.died()

    def rollout(self):
        return self.proc.rollout()

    def settle(self) -> float:
        """The engine process's wait for the work its last commit left running; the seconds waited."""
        return self.proc.settle()

    def dense(self, link: DenseLink, version: int) -> DenseResult:
        """This rank's shards to the engine process, which loads everyone's; its account."""
        self.proc.start_dense(version)
        link.send()
        return self.proc.dense_result()

    def stop_server(self, transport) -> None:
        """Stop the engine's refit server (a STOP over the refit transport; call it before
        ``DeltaRefit.close``, whose transport handshake the server's process then joins)."""
        from nemo_dcr.transport import Envelope, MessageKind

        transport.send(self.trainers, Envelope(MessageKind.STOP, 0, transport.rank))
        transport.flush()

    def close(self) -> dict:
        """Stop the engine process (after ``DeltaRefit.close``); its server's statistics."""
        return self.proc.stop()
