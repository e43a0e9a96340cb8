"""The one description of a model: what the layout tables, the trainer builder and the engines need
(a small, framework-free mirror of Megatron-Core's ``TransformerConfig`` and a Hugging Face config)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelDims:
    """Shapes of a decoder-only transformer, in Hugging Face terms where they differ.

    Field names follow Megatron-Core's ``TransformerConfig`` where one exists.
    """

    num_layers: int
    """Decoder layers (HF ``num_hidden_layers``)."""
    hidden_size: int
    """Model width."""
    num_attention_heads: int
    """Query heads."""
    vocab_size: int
    """Real vocabulary rows of the HF embedding (before Megatron's padding)."""
    num_query_groups: int | None = None
    """KV heads (HF ``num_key_value_heads``); None = multi-head attention."""
    head_dim: int | None = None
    """Per-head width (Megatron ``kv_channels``); None = hidden_size // num_attention_heads."""
    ffn_hidden_size: int = 0
    """Dense MLP width (HF ``intermediate_size``)."""
    gated_linear_unit: bool = True
    """SwiGLU: ``linear_fc1`` holds gate and up."""
    make_vocab_size_divisible_by: int = 128
    """Megatron pads the vocabulary to a multiple of this times TP."""
    padded_vocab_size: int | None = None
    """Explicit padded vocabulary (overrides the rule above when given)."""
    tie_word_embeddings: bool = False
    """Output layer shares the embedding (no ``lm_head.weight`` in the canonical set)."""
    qk_layernorm: bool = False
    """Per-head RMSNorm on q and k (Qwen3 ``q_norm``/``k_norm``)."""
    add_qkv_bias: bool = False
    """Bias on q/k/v projections (Qwen2)."""
    num_experts: int = 0
    """Routed experts per MoE layer (0 = dense model)."""
    moe_ffn_hidden_size: int = 0
    """Width of each routed expert (HF ``moe_intermediate_size``)."""
    shared_expert_ffn_hidden_size: int = 0
    """Total width of the shared experts (0 = none); DeepSeek: ``n_shared * moe_inter``."""
    router_expert_bias: bool = False
    """Aux-loss-free routing bias (HF ``e_score_correction_bias``; a float32 buffer in
    Megatron, not a parameter)."""
    first_dense_layers: int = 0
    """With experts: the first k layers use a dense MLP (DeepSeek ``first_k_dense_replace``)."""
    multi_latent_attention: bool = False
    """DeepSeek MLA instead of GQA."""
    q_lora_rank: int | None = None
    """MLA query compression rank (None = plain ``q_proj``)."""
    kv_lora_rank: int = 0
    """MLA KV compression rank."""
    qk_head_dim: int = 0
    """MLA non-rotary q/k head width (HF ``qk_nope_head_dim``)."""
    qk_pos_emb_head_dim: int = 0
    """MLA rotary q/k head width (HF ``qk_rope_head_dim``)."""
    v_head_dim: int = 0
    """MLA value head width."""
    moe_router_topk: int = 2
    """Experts per token (builds the model; the layout does not depend on it)."""
    rope_theta: float = 10000.0
    """Rotary base (builds the model and the engine's config; not a layout input)."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon (builds the model and the engine's config; not a layout input)."""

    @property
    def family(self) -> str:
        """The layout family table this model uses (see :data:`nemo_dcr.layout.FAMILIES`)."""
        if self.multi_latent_attention:
            return "deepseek_v3"
        return "qwen3_moe" if self.num_experts else "llama"

    @property
    def kv_heads(self) -> int:
        """Number of query groups (KV heads)."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def kv_channels(self) -> int:
        """Per-head width."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def has_dense_mlp(self) -> bool:
        """Whether any layer has a dense MLP."""
        return not self.num_experts or self.first_dense_layers > 0

    def is_moe_layer(self, layer: int) -> bool:
        """Whether global layer ``layer`` is a MoE layer."""
        return self.num_experts > 0 and layer >= self.first_dense_layers

    def padded_vocab(self, tp: int) -> int:
        """Vocabulary rows Megatron allocates at tensor-parallel size ``tp``.

        Megatron (``_vocab_size_with_padding``) rounds up to a multiple of
        ``make_vocab_size_divisible_by * tp``.
        """
        if self.padded_vocab_size is not None:
            return self.padded_vocab_size
        multiple = self.make_vocab_size_divisible_by * tp
        return -(-self.vocab_size // multiple) * multiple

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of all fields (JSON-serializable)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelDims:
        """Inverse of :meth:`to_dict`."""
        return cls(**d)
