"""Megatron-Core side of the GRPO recipe: the trainer shard the hook refits from, and the
policy-gradient backward pass through the pipeline.

:class:`MegatronShard` implements :class:`nemo_dcr.hook.TrainerShard` for a GPTModel built
with :func:`nemo_dcr.integrations.megatron.build.build_gpt_model`: local params, the flat slice each rank
captures, the layout plan that remaps changed local indices to canonical HF indices, and the
dense export used for full resyncs and for the independent bit-exactness check.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from nemo_dcr.integrations.megatron import build as am
from nemo_dcr.integrations.megatron.params import capture_ranges, dense_export, load_hf, local_params
from nemo_dcr.integrations.megatron.train import MasterAdamW, pipeline_forward_backward
from nemo_dcr.types import SparseDelta


class MegatronShard:
    """This rank's view of a Megatron model for the refit hook.

    Args:
        chunks: this rank's model chunks (one without virtual pipeline).
        preset: the model preset.
        engine_rank: rank that receives the dense export.
    """

    def __init__(self, chunks: list[torch.nn.Module], preset: am.ModelPreset, engine_rank: int = 0):
        from nemo_dcr.layout import build_plan

        self.chunks = chunks
        self.preset = preset
        self.engine_rank = engine_rank
        layout = am.parallel_layout_from_state()
        self.plan = build_plan(preset.family, am.model_dims(preset), layout)
        self.shapes = self.plan.canonical_shapes()
        self.local = local_params(chunks, preset)
        skip = {lp.name for lp in self.local if self.plan.lookup(lp.name).duplicate_of}
        self.ranges = capture_ranges(self.local, skip)
        self.params = {lp.name: lp.param for lp in self.local}

    def remap(self, delta: SparseDelta) -> list[SparseDelta]:
        """Canonical pieces of one local delta (pure index arithmetic, no gather)."""
        res = self.plan.remap(delta.name, torch.from_numpy(delta.positions))
        out = []
        for piece in res:
            sel = piece.selection.numpy()
            out.append(SparseDelta(piece.name, delta.dtype, tuple(self.shapes[piece.name]),
                                   piece.index.numpy().astype(np.int64), delta.new_bits[sel],
                                   delta.old_bits[sel]))
        return out

    def dense_export(self) -> dict[str, torch.Tensor] | None:
        """Every canonical tensor on the engine rank (collective)."""
        return dense_export(self.chunks, self.preset, dst=self.engine_rank)


@dataclass(frozen=True)
class Trainer:
    """A Megatron policy with its fp32-master optimizer."""

    preset: am.ModelPreset
    chunks: list[torch.nn.Module]
    optimizer: MasterAdamW


def build_trainer(model: str, tp: int, pp: int, hf_state: str, lr: float,
                  weight_decay: float = 0.0) -> Trainer:
    """Initialize gloo + megatron groups, build the model, load HF weights, make the optimizer.

    Args:
        model: preset name (``smollm2``).
        tp: tensor parallel size.
        pp: pipeline parallel size.
        hf_state: ``torch.save``'d fp32 HF state dict.
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
    """
    preset = am.PRESETS[model]
    am.init_distributed(tp, pp, 1, tp if preset.num_experts else 1)  # dense: expert-TP 1
    chunks = am.build_gpt_model(preset, torch.bfloat16)
    load_hf(chunks, torch.load(hf_state, mmap=True), preset)
    opt = MasterAdamW(local_params(chunks, preset), preset.tied, lr=lr,
                      weight_decay=weight_decay)
    return Trainer(preset, chunks, opt)


def policy_gradient_backward(model, tokens: torch.Tensor, weights: torch.Tensor, hidden: int,
                             dtype: torch.dtype = torch.bfloat16) -> float | None:
    """Forward/backward of ``sum(weights * token NLL) / batch`` through the pipeline.

    With ``weights`` = advantage on answer-token labels and 0 elsewhere this is the GRPO
    policy-gradient loss ``-mean_i A_i * log pi(answer_i | prompt_i)``.

    Args:
        model: this rank's single model chunk.
        tokens: ``[B, L+1]`` right-padded sequences (identical on every rank).
        weights: ``[B, L]`` float weights of the labels ``tokens[:, 1:]``.
        hidden: hidden size.
        dtype: activation dtype.

    Returns:
        The loss on the last pipeline stage, None elsewhere.
    """
    batch = tokens.shape[0]
    return pipeline_forward_backward(model, tokens[:, :-1], tokens[:, 1:], hidden, dtype,
                                     reduce=lambda out: (out.float() * weights).sum() / batch)
