"""Where the demo's engine lives: in trainer rank ``engine.rank``'s process (``colocated``) or in a
process of its own next to it (``separate``, always for vLLM).  Both handles give the starting
trainer rank the same three things: rollouts, the independent dense comparison, and shutdown.
The refit itself never goes through these handles: it is ``DeltaRefit`` to the engine's server.

With ``engine.weights: fp8`` the transformers engine holds the linear layers in FP8
(:class:`~nemo_dcr.integrations.hf.engine.HFEngine` with the plan of ``dcr``), and the dense
comparison checks its FP8 bytes and scales against an independent re-quantization of the dense
export (:func:`nemo_dcr.verify.fp8_reference.fp8_mismatches`).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from nemo_dcr.tools.demo.hf_engine import build_hf_engine, load_and_compare


def write_initial_weights(init_dir: Path) -> Path:
    """The embedded model as an HF folder (fp32 safetensors, config, tokenizer) under ``init_dir``:
    what the trainer ranks and the engine load; removed by :func:`remove_initial_weights`."""
    from nemo_dcr.integrations.hf.model import save_embedded_hf

    return save_embedded_hf(init_dir / "hf")


def remove_initial_weights(init_dir: Path) -> None:
    """The run folder keeps only results: the hand-over folder goes once everything loaded it."""
    shutil.rmtree(init_dir, ignore_errors=True)


class ColocatedEngine:
    """A transformers engine in this process (its refit server runs in a thread of ``DeltaRefit``)."""

    def __init__(self, hf_dir: Path, key: bytes | None, rl_cfg, seed: int, dcr):
        import random

        from transformers import AutoTokenizer

        self.engine = build_hf_engine(hf_dir, key, dcr)
        self.tokenizer = AutoTokenizer.from_pretrained(hf_dir)
        self.rl_cfg, self.rng = rl_cfg, random.Random(seed)

    def wait_ready(self) -> str:
        return f"hf{' fp8' if self.engine.fp8_plan is not None else ''} (colocated)"

    def rollout(self):
        from nemo_dcr.tools.demo.rollout import rollout

        return rollout(self.engine, self.tokenizer, self.rng, self.rl_cfg)

    def compare(self, dense: dict[str, torch.Tensor]) -> tuple[float, bool]:
        """Seconds of the load into scratch (:func:`load_and_compare`; the comparison not counted)
        and whether the engine equals ``dense``."""
        load_s, _, same = load_and_compare(self.engine, dense)
        return load_s, same

    def stop_server(self, transport) -> None:
        """Nothing to do: ``DeltaRefit.close`` stops the server it hosts."""

    def close(self) -> dict:
        return {}


class SeparateEngine:
    """The engine in a process of its own (:mod:`nemo_dcr.tools.demo.engine_process`)."""

    def __init__(self, kind: str, hf_dir: Path, store_dir: Path, trainers: int, key: bytes | None, rl_cfg,
                 seed: int, dcr):
        from nemo_dcr.tools.demo.engine_process import EngineProcess

        self.kind, self.trainers = kind, trainers
        self.proc = EngineProcess(kind, hf_dir, store_dir, trainers, key, rl_cfg, seed, dcr)

    def wait_ready(self) -> str:
        return f"{self.proc.wait_ready()} (separate process)"

    def rollout(self):
        return self.proc.rollout()

    def compare(self, dense: dict[str, torch.Tensor]) -> tuple[float, bool]:
        return self.proc.dense(dense)

    def stop_server(self, transport) -> None:
        """Stop the engine's refit server (a STOP over the refit transport; call it before
        ``DeltaRefit.close``, whose transport handshake the server's process then joins)."""
        from nemo_dcr.transport import Envelope, MessageKind

        transport.send(self.trainers, Envelope(MessageKind.STOP, 0, transport.rank))
        transport.flush()

    def close(self) -> dict:
        """Stop the engine process (after ``DeltaRefit.close``); its server's statistics."""
        return self.proc.stop()
