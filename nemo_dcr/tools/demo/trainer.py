"""Megatron-Core side of the GRPO recipe: build the policy and its fp32-master optimizer, and the
policy-gradient backward pass through the pipeline.

The refit reads the built chunks through :class:`nemo_dcr.integrations.megatron.MegatronSource`
(derived from the model itself by ``DeltaRefit.from_config``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nemo_dcr.checkpoint import load_checkpoint
from nemo_dcr.tools.megatron import build as am
from nemo_dcr.integrations.megatron.params import local_params
from nemo_dcr.tools.megatron.dense import load_hf
from nemo_dcr.tools.megatron.train import MasterAdamW, pipeline_forward_backward
from nemo_dcr.layout import ModelDims, model_dims


@dataclass(frozen=True)
class Trainer:
    """A Megatron policy with its fp32-master optimizer."""

    dims: ModelDims
    chunks: list[torch.nn.Module]
    optimizer: MasterAdamW


def build_trainer(model: str, tp: int, pp: int, checkpoint: str, lr: float,
                  weight_decay: float = 0.0) -> Trainer:
    """Initialize megatron's groups, build the model, load HF weights, make the optimizer.

    Args:
        model: model name (``smollm2``; see :data:`nemo_dcr.layout.MODELS`).
        tp: tensor parallel size.
        pp: pipeline parallel size.
        checkpoint: HF weights as safetensors (a file or a folder).
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
    """
    dims = model_dims(model)
    am.init_distributed(tp, pp, 1, tp if dims.num_experts else 1)  # dense: expert-TP 1
    chunks = am.build_gpt_model(dims, torch.bfloat16)
    load_hf(chunks, load_checkpoint(checkpoint), dims)
    opt = MasterAdamW(local_params(chunks, dims), dims.tie_word_embeddings, lr=lr, weight_decay=weight_decay)
    return Trainer(dims, chunks, opt)


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
                                     reduce=lambda out: (out.float() * weights.to(out.device)).sum() / batch)
