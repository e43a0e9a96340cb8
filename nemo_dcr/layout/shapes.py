"""Canonical (Hugging Face) tensor names and shapes of each family, from :class:`ModelDims`."""

from __future__ import annotations

from functools import lru_cache

from nemo_dcr.layout.dims import ModelDims

ShapeMap = dict[str, tuple[int, ...]]


def _globals(d: ModelDims) -> ShapeMap:
    out = {"model.embed_tokens.weight": (d.vocab_size, d.hidden_size),
           "model.norm.weight": (d.hidden_size,)}
    if not d.tie_word_embeddings:
        out["lm_head.weight"] = (d.vocab_size, d.hidden_size)
    return out


def _gqa(d: ModelDims, p: str) -> ShapeMap:
    h, hd, g, n = d.hidden_size, d.kv_channels, d.kv_heads, d.num_attention_heads
    out = {
        p + "input_layernorm.weight": (h,),
        p + "self_attn.q_proj.weight": (n * hd, h),
        p + "self_attn.k_proj.weight": (g * hd, h),
        p + "self_attn.v_proj.weight": (g * hd, h),
        p + "self_attn.o_proj.weight": (h, n * hd),
    }
    if d.add_qkv_bias:
        out[p + "self_attn.q_proj.bias"] = (n * hd,)
        out[p + "self_attn.k_proj.bias"] = (g * hd,)
        out[p + "self_attn.v_proj.bias"] = (g * hd,)
    if d.qk_layernorm:
        out[p + "self_attn.q_norm.weight"] = (hd,)
        out[p + "self_attn.k_norm.weight"] = (hd,)
    return out


def _mla(d: ModelDims, p: str) -> ShapeMap:
    h, n = d.hidden_size, d.num_attention_heads
    qh = d.qk_head_dim + d.qk_pos_emb_head_dim
    a = p + "self_attn."
    out = {p + "input_layernorm.weight": (h,)}
    if d.q_lora_rank is None:
        out[a + "q_proj.weight"] = (n * qh, h)
    else:
        out[a + "q_a_proj.weight"] = (d.q_lora_rank, h)
        out[a + "q_a_layernorm.weight"] = (d.q_lora_rank,)
        out[a + "q_b_proj.weight"] = (n * qh, d.q_lora_rank)
    out[a + "kv_a_proj_with_mqa.weight"] = (d.kv_lora_rank + d.qk_pos_emb_head_dim, h)
    out[a + "kv_a_layernorm.weight"] = (d.kv_lora_rank,)
    out[a + "kv_b_proj.weight"] = (n * (d.qk_head_dim + d.v_head_dim), d.kv_lora_rank)
    out[a + "o_proj.weight"] = (h, n * d.v_head_dim)
    return out


def _mlp(prefix: str, hidden: int, ffn: int) -> ShapeMap:
    return {
        prefix + "gate_proj.weight": (ffn, hidden),
        prefix + "up_proj.weight": (ffn, hidden),
        prefix + "down_proj.weight": (hidden, ffn),
    }


def _ffn(d: ModelDims, p: str, layer: int) -> ShapeMap:
    h = d.hidden_size
    out = {p + "post_attention_layernorm.weight": (h,)}
    if not d.is_moe_layer(layer):
        out.update(_mlp(p + "mlp.", h, d.ffn_hidden_size))
        return out
    out[p + "mlp.gate.weight"] = (d.num_experts, h)
    if d.router_expert_bias:
        out[p + "mlp.gate.e_score_correction_bias"] = (d.num_experts,)
    for x in range(d.num_experts):
        out.update(_mlp(f"{p}mlp.experts.{x}.", h, d.moe_ffn_hidden_size))
    if d.shared_expert_ffn_hidden_size:
        out.update(_mlp(p + "mlp.shared_experts.", h, d.shared_expert_ffn_hidden_size))
    return out


def canonical_shapes(family: str, d: ModelDims) -> ShapeMap:
    """Every canonical tensor of the model, name -> shape (a fresh dict the caller may keep).

    Built once per model description and copied for each call: a plan is built per rank and
    per model chunk, and a 1T MoE model has 70k canonical tensors.

    Args:
        family: a key of :data:`nemo_dcr.layout.families.FAMILIES` (the attention kind
            follows ``d.multi_latent_attention``; :func:`build_plan` checks they agree).
        d: model dimensions.
    """
    return dict(_shapes_of(d))


@lru_cache(maxsize=8)
def _shapes_of(d: ModelDims) -> ShapeMap:
    out = _globals(d)
    for layer in range(d.num_layers):
        p = f"model.layers.{layer}."
        out.update(_mla(d, p) if d.multi_latent_attention else _gqa(d, p))
        out.update(_ffn(d, p, layer))
    return out
