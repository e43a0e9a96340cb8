"""Named model descriptions (:class:`ModelDims`): the embedded model, tiny test configurations, and
the large public models ``nemo-dcr plan`` sizes (built from their Hugging Face ``config.json``
values through :func:`~nemo_dcr.layout.hf_config.dims_from_hf_config`).

One table serves the trainer builder (``nemo_dcr.integrations.megatron``), the engines, the
layout checks and the planner, so a model is described once.
"""

from __future__ import annotations

from dataclasses import replace

from nemo_dcr.layout.dims import ModelDims
from nemo_dcr.layout.hf_config import dims_from_hf_config
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

HF_CONFIGS: dict[str, dict] = {
    # moonshotai/Kimi-K2-Instruct config.json (1.03T parameters, 384 routed experts).
    "kimi-k2": dict(
        model_type="kimi_k2", vocab_size=163840, hidden_size=7168, intermediate_size=18432,
        moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=64, num_key_value_heads=64,
        n_routed_experts=384, n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=1,
        moe_layer_freq=1, topk_method="noaux_tc", q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, tie_word_embeddings=False, rope_theta=50000.0,
        rms_norm_eps=1e-6, num_nextn_predict_layers=0,
    ),
    # deepseek-ai/DeepSeek-V3 config.json (671B with the MTP layer, which the refit does not carry).
    "deepseek-v3": dict(
        model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
        moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
        n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=3,
        moe_layer_freq=1, topk_method="noaux_tc", q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, tie_word_embeddings=False, rope_theta=10000.0,
        rms_norm_eps=1e-6, num_nextn_predict_layers=1,
    ),
    # Qwen/Qwen3-235B-A22B config.json (128 experts, every layer MoE).
    "qwen3-235b-a22b": dict(
        model_type="qwen3_moe", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
        moe_intermediate_size=1536, num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4,
        head_dim=128, num_experts=128, num_experts_per_tok=8, decoder_sparse_step=1, mlp_only_layers=[],
        tie_word_embeddings=False, rope_theta=1000000.0, rms_norm_eps=1e-6,
    ),
    # meta-llama/Meta-Llama-3-70B config.json.
    "llama3-70b": dict(
        model_type="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
        num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, tie_word_embeddings=False,
        rope_theta=500000.0, rms_norm_eps=1e-5,
    ),
}
"""Public ``config.json`` values (the fields the layout needs) of the large models the planner sizes."""

MODELS.update({name: dims_from_hf_config(cfg) for name, cfg in HF_CONFIGS.items()})


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
