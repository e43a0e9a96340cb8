"""Named model descriptions (:class:`ModelDims`): the embedded model and tiny test configurations.

One table serves the trainer builder (``nemo_dcr.integrations.megatron``), the engines and the
layout checks, so a model is described once.
"""

from __future__ import annotations

from dataclasses import replace

from nemo_dcr.layout.dims import ModelDims
from nemo_dcr.layout.parallel import LayoutError

MODELS: dict[str, ModelDims] = {
    "smollm2": ModelDims(
        num_layers=30, hidden_size=576, num_attention_heads=9, num_query_groups=3, vocab_size=49152,
        ffn_hidden_size=1536, tie_word_embeddings=True, rope_theta=100000.0, norm_eps=1e-5,
    ),
    "dense-tiny": ModelDims(
        num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, vocab_size=1000,
        ffn_hidden_size=128,
    ),
    "qwen3-moe-tiny": ModelDims(
        num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, vocab_size=1000,
        ffn_hidden_size=128, qk_layernorm=True, head_dim=16, num_experts=4, moe_ffn_hidden_size=32,
    ),
    "deepseek-tiny": ModelDims(
        num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=4, vocab_size=1000,
        ffn_hidden_size=128, num_experts=4, moe_ffn_hidden_size=32, shared_expert_ffn_hidden_size=32,
        multi_latent_attention=True, q_lora_rank=None, kv_lora_rank=32, qk_head_dim=16,
        qk_pos_emb_head_dim=8, v_head_dim=16,
    ),
}
"""Model name -> description.  ``smollm2`` is the embedded SmolLM2-135M-Instruct."""


def model_dims(name: str, layers: int | None = None) -> ModelDims:
    """The description of a named model, optionally with another number of layers.

    Raises:
        LayoutError: unknown name (the message lists the known ones) or ``layers < 1``.
    """
    if name not in MODELS:
        raise LayoutError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}")
    if layers is not None and layers < 1:
        raise LayoutError(f"layers must be >= 1, got {layers}")
    dims = MODELS[name]
    return dims if layers is None else replace(dims, num_layers=layers)
