"""A :class:`~nemo_dcr.layout.ModelDims` read from a built Megatron-Core model (no preset needed).

The description comes from the model's ``TransformerConfig`` and its module tree; anything the
layout tables cannot describe (biases on linear layers, LayerNorm instead of RMSNorm, Transformer
Engine or grouped-GEMM modules, unknown parameter names) is refused with an error that names what
is missing, instead of a silent wrong remap.
"""

from __future__ import annotations

import torch

from nemo_dcr.layout import LayoutError, MegatronSpec, ModelDims

from .params import unwrap


class DescribeError(LayoutError):
    """The model has something the layout tables cannot describe."""


def _require(config, attr: str, allowed, what: str) -> None:
    value = getattr(config, attr, None)
    if value not in allowed:
        raise DescribeError(f"TransformerConfig.{attr}={value!r}: {what}")


def layer_spec(chunks: list[torch.nn.Module]) -> MegatronSpec:
    """Which layer spec built the model (local modules and SequentialMLP experts are supported)."""
    names = {type(m).__name__ for c in chunks for m in unwrap(c).modules()}
    te = sorted(n for n in names if n.startswith("TE"))
    if te:
        raise DescribeError(f"Transformer Engine modules {te[:3]}: build the model with the local layer spec "
                            "(get_gpt_layer_local_spec); TE layouts are in the tables but not derived yet")
    config = unwrap(chunks[0]).config
    if getattr(config, "moe_grouped_gemm", False):
        raise DescribeError("TransformerConfig.moe_grouped_gemm=True: only SequentialMLP experts are derived")
    return MegatronSpec()


def dims_from_model(chunks: list[torch.nn.Module], vocab_size: int | None = None) -> ModelDims:
    """The model description of this rank's chunks.

    Args:
        chunks: this rank's model chunks (possibly wrapped in DDP / Float16Module).
        vocab_size: the real (Hugging Face) vocabulary; Megatron pads its embedding and does not
            keep the unpadded size.  None: the model's own ``vocab_size`` is taken as real.

    Raises:
        DescribeError: naming the config field or module the tables cannot describe.
    """
    model = unwrap(chunks[0])
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "vocab_size"):
        raise DescribeError(f"{type(model).__name__} is not a megatron-core GPTModel (no config / vocab_size)")
    _require(config, "normalization", ("RMSNorm",), "the layout tables describe RMSNorm models (no norm bias)")
    _require(config, "add_bias_linear", (False,), "linear biases are not in the layout tables")
    _require(config, "gated_linear_unit", (True,), "the tables describe SwiGLU MLPs (linear_fc1 = gate|up)")
    mla = bool(getattr(config, "multi_latent_attention", False))
    experts = int(getattr(config, "num_moe_experts", None) or 0)
    freq = getattr(config, "moe_layer_freq", 1)
    first_dense = _first_dense_layers(freq, config.num_layers) if experts else 0
    real_vocab = int(vocab_size if vocab_size is not None else model.vocab_size)
    if real_vocab > model.vocab_size:
        raise DescribeError(f"vocab_size={real_vocab} exceeds the model's embedding rows {model.vocab_size}")
    dims = ModelDims(
        num_layers=config.num_layers, hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads, vocab_size=real_vocab,
        num_query_groups=config.num_query_groups, head_dim=_head_dim(config, mla),
        ffn_hidden_size=config.ffn_hidden_size, padded_vocab_size=model.vocab_size,
        tie_word_embeddings=bool(model.share_embeddings_and_output_weights),
        qk_layernorm=bool(config.qk_layernorm) and not mla, add_qkv_bias=bool(getattr(config, "add_qkv_bias", False)),
        num_experts=experts, moe_ffn_hidden_size=int(getattr(config, "moe_ffn_hidden_size", 0) or 0),
        shared_expert_ffn_hidden_size=int(getattr(config, "moe_shared_expert_intermediate_size", 0) or 0),
        router_expert_bias=bool(getattr(config, "moe_router_enable_expert_bias", False)),
        first_dense_layers=first_dense, multi_latent_attention=mla,
        moe_router_topk=int(getattr(config, "moe_router_topk", 2) or 2),
        rope_theta=float(getattr(config, "rotary_base", None) or _rotary_base(model)),
        norm_eps=float(config.layernorm_epsilon),
    )
    if mla:
        dims = _with_mla(dims, config)
    return dims


def _head_dim(config, mla: bool) -> int | None:
    """``kv_channels`` when it differs from ``hidden / heads`` (None: the default, as in ModelDims)."""
    if mla or config.kv_channels == config.hidden_size // config.num_attention_heads:
        return None
    return int(config.kv_channels)


def _rotary_base(model) -> float:
    rope = getattr(model, "rotary_pos_emb", None)
    base = getattr(rope, "rotary_base", None)
    return float(base) if base is not None else 10000.0


def _first_dense_layers(freq, num_layers: int) -> int:
    """Leading dense layers of ``moe_layer_freq`` (an int period or a 0/1 list per layer)."""
    if isinstance(freq, int):
        if freq != 1:
            raise DescribeError(f"TransformerConfig.moe_layer_freq={freq}: only leading dense layers are described")
        return 0
    pattern = list(freq)
    first = next((i for i, x in enumerate(pattern) if x), len(pattern))
    if any(not x for x in pattern[first:]) or len(pattern) != num_layers:
        raise DescribeError(f"TransformerConfig.moe_layer_freq={pattern}: only leading dense layers are described")
    return first


def _with_mla(dims: ModelDims, config) -> ModelDims:
    from dataclasses import replace

    missing = [a for a in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")
               if getattr(config, a, None) is None]
    if missing:
        raise DescribeError(f"multi-latent attention config lacks {missing}")
    return replace(dims, q_lora_rank=config.q_lora_rank, kv_lora_rank=config.kv_lora_rank,
                   qk_head_dim=config.qk_head_dim, qk_pos_emb_head_dim=config.qk_pos_emb_head_dim,
                   v_head_dim=config.v_head_dim)
