"""What every chaos process shares: the run's configuration, the payload key, the chaos model, the
refit settings, the refit group's transport and the engine's initial weights (the supervisor in
:mod:`.run`, the engine in :mod:`.engine` and the trainers in :mod:`.trainer` all import it)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .state import Workdir

KEY = b"chaos-refit-key-0123456789abcdef"


@dataclass(frozen=True)
class ChaosConfig:
    """One chaos run (trainers: ``tp * pp`` ranks of the chaos model, :func:`chaos_dims`)."""

    refits: int
    faults: tuple[str, ...]
    seed: int = 0
    fault_rate: float = 0.5
    tp: int = 2
    pp: int = 2
    keyed: bool = True
    """Payloads carry an HMAC (corruption is then caught by the MAC or the preamble checks)."""
    engine: str = "hf"
    """``hf`` (the transformers model) or ``vllm`` (a real vLLM engine, TP=1)."""
    transport: str = "gloo"
    """``gloo``, or ``store`` (files in the work folder; needed by ``disk-full``)."""
    reply_timeout_s: float = 20.0
    """``dcr.reply_timeout_s``: how long the trainers wait (a ``stall`` lasts 5 s longer)."""
    ckpt_every: int = 2
    """Trainer checkpoints every N refits (what a relaunch after ``kill-trainer`` resumes from)."""
    verify: str = "sampled"
    """``dcr.verify`` of the run."""
    duration_s: float = 0.0
    """A soak: no refit starts once this many seconds have passed since the run began (0: run all
    ``refits``, which stays the most)."""
    until: float = 0.0
    """Wall-clock time (``time.time()``) after which no refit starts; set by the supervisor from
    ``duration_s``, so relaunched trainers keep the run's own end."""
    workdir: str = ""

    @property
    def trainers(self) -> int:
        return self.tp * self.pp


def chaos_dims(cfg: ChaosConfig):
    """``dense-tiny`` at width 128 (head_dim 32: the smallest vLLM's CPU attention takes)."""
    from nemo_dcr.layout import model_dims

    return replace(model_dims("dense-tiny"), hidden_size=128, ffn_hidden_size=256)


def dcr_config(cfg: ChaosConfig):
    from nemo_dcr.config.schema import DcrConfig

    # small parts (~1000 changes) so drop and reorder have several parts to act on
    return DcrConfig(bucket_size_mb=0.01, reply_timeout_s=cfg.reply_timeout_s, verify=cfg.verify, verify_steps=4,
                     telemetry_encodings=[])


def refit_transport(cfg: ChaosConfig, wd: Workdir, rank: int, generation: int):
    """Rank ``rank``'s endpoint of generation ``generation`` of the refit group (engine: rank T)."""
    if cfg.transport == "store":
        from nemo_dcr.transport import StoreTransport

        return StoreTransport(f"file://{wd.store}", rank, KEY, run=f"chaos-{generation}")
    import torch.distributed as dist

    from nemo_dcr.transport import DistTransport

    store = dist.FileStore(wd.refit_store(generation), cfg.trainers + 1)
    return DistTransport(dist.ProcessGroupGloo(store, rank, cfg.trainers + 1), rank, chunk_bytes=1 << 14)


def write_initial_weights(cfg: ChaosConfig, wd: Workdir) -> None:
    """The HF folder every engine start loads: the chaos model's config, all weights zero."""
    import json

    from nemo_dcr.checkpoint import save_checkpoint
    from nemo_dcr.layout import canonical_shapes

    d = chaos_dims(cfg)
    wd.hf.mkdir(parents=True)
    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=d.vocab_size,
                  hidden_size=d.hidden_size, intermediate_size=d.ffn_hidden_size, num_hidden_layers=d.num_layers,
                  num_attention_heads=d.num_attention_heads, num_key_value_heads=d.kv_heads, head_dim=d.kv_channels,
                  max_position_embeddings=512, rms_norm_eps=d.norm_eps, rope_theta=d.rope_theta,
                  tie_word_embeddings=d.tie_word_embeddings, bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16")
    (wd.hf / "config.json").write_text(json.dumps(config, indent=1))
    save_checkpoint({n: torch.zeros(s, dtype=torch.bfloat16) for n, s in canonical_shapes(d.family, d).items()},
                    wd.hf / "model.safetensors")
