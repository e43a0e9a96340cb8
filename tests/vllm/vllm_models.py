"""Tiny random-weight models for the vLLM tests (saved as HF folders vLLM loads), and the trainer
side: the one refit path (``DeltaRefit`` over canonical tensors) into a real vLLM engine whose
refit server runs in this process."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Mapping

import torch

from nemo_dcr.checkpoint import load_checkpoint, save_checkpoint
from nemo_dcr.config.schema import DcrConfig
from nemo_dcr.refit import DeltaRefit, RefitReport, colocated_wiring
from nemo_dcr.refit.canonical import CanonicalSource

KEY = b"vllm-test-key-0123456789abcdef01"
PROMPTS = [[5, 6, 7, 8, 9], [100, 200, 300], [42] * 6]
ENGINE_ARGS = dict(skip_tokenizer_init=True, max_num_seqs=4, max_model_len=256)
"""Small engines: token-id prompts (no tokenizer), few sequences."""

_COMMON = dict(vocab_size=1000, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=32, max_position_embeddings=512, tie_word_embeddings=False,
               bos_token_id=1, eos_token_id=2)
"""vocab 1000 (vLLM pads it to 1024), 4 heads and 2 KV heads (TP=2 splits both), head_dim 32 (the
smallest vLLM's CPU attention supports); expert sizes multiples of 32 (the CPU MoE kernel's tile)."""


def save_tiny(kind: str, out: Path, seed: int = 0) -> Path:
    """A random ``llama`` or ``qwen3_moe`` (4 experts, top-2) model in bf16 at ``out``."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3MoeConfig

    if kind == "llama":
        config = LlamaConfig(intermediate_size=128, **_COMMON)
    else:
        config = Qwen3MoeConfig(moe_intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                                norm_topk_prob=True, **_COMMON)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(out)
    return out


def perturbed(tensors: Mapping[str, torch.Tensor], fraction: float = 0.1, seed: int = 1) -> dict[str, torch.Tensor]:
    """``fraction`` of every tensor's elements replaced by new values of the same scale (enough to
    change greedy generations, so token identity with a fresh engine means something)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in tensors.items():
        mask = torch.rand(t.shape, generator=g) < fraction
        noise = (torch.randn(t.shape, generator=g) * t.float().std().clamp_min(1e-3)).to(t.dtype)
        out[name] = torch.where(mask, noise, t).contiguous()
    return out


def write_like(model_dir: Path, tensors: Mapping[str, torch.Tensor], out: Path) -> Path:
    """An HF folder with ``model_dir``'s config files and ``tensors`` as its weights."""
    out.mkdir(parents=True)
    for f in Path(model_dir).iterdir():
        if f.suffix == ".json" and not f.name.endswith("index.json"):
            shutil.copy(f, out / f.name)
    save_checkpoint(dict(tensors), out)
    return out


class Trainer:
    """A trainer holding canonical tensors, refitting ``engine`` through :class:`DeltaRefit`: the
    engine's :class:`~nemo_dcr.refit.EngineServer` runs in a thread of this process (in-process
    transport), the engine reports its placement (one shard per TP rank), and every refit is
    routed, encoded, applied transactionally and verified exactly as in a training job.

    Args:
        engine: the engine (a :class:`~nemo_dcr.integrations.vllm.engine.VllmEngine`).
        tensors: the trainer's weights at the start; the first sync (:attr:`first`) sends what
            the engine does not hold yet.
    """

    def __init__(self, engine, tensors: Mapping[str, torch.Tensor]):
        self.params = {n: t.clone() for n, t in tensors.items()}
        cfg = DcrConfig(transport="inprocess", reply_timeout_s=900, verify="full", telemetry_encodings=[])
        self.refit = DeltaRefit(cfg, CanonicalSource(self.params), colocated_wiring(cfg, 0, KEY), engine, key=KEY)
        self.first: RefitReport = self.refit.attach()

    def step_to(self, tensors: Mapping[str, torch.Tensor], tamper=None) -> RefitReport:
        """The trainer's weights become ``tensors``; one refit (``tamper``: fault injection)."""
        for n, p in self.params.items():
            p.copy_(tensors[n])
        return self.refit.step(tamper=tamper)

    @property
    def events(self) -> list[tuple[int, str, str]]:
        """What the engine's refit server saw (refusals, commits), with versions."""
        return list(self.refit.server.stats.events)

    def close(self) -> None:
        self.refit.close(60)

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Contiguous copies of a checkpoint's tensors."""
    return {n: t.clone() for n, t in load_checkpoint(path).items()}
