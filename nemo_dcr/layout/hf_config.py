"""A Hugging Face ``config.json`` -> :class:`ModelDims` (the one model description).

Covers the families the layout tables know: Llama-style dense models (Llama, Mistral, SmolLM2,
Qwen2 with q/k/v bias, Qwen3 with q/k norm), Qwen3-MoE, and DeepSeek-V3 / Kimi-K2 (MLA, routed
plus shared experts, leading dense layers, aux-loss-free router bias).  What the tables cannot
describe is refused naming the field, never silently dropped; multi-token-prediction layers
(``num_nextn_predict_layers``) are not part of the served model the refit updates and are
reported by :func:`unmodelled_fields`.

Example::

    import json
    from nemo_dcr.layout import dims_from_hf_config
    dims = dims_from_hf_config(json.load(open("config.json")))
"""

from __future__ import annotations

from typing import Any, Mapping

from nemo_dcr.layout.dims import ModelDims
from nemo_dcr.layout.parallel import LayoutError

DENSE_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
"""``model_type`` values of dense models (q/k/v bias for ``qwen2``, q/k norm for ``qwen3``)."""
MOE_TYPES = frozenset({"qwen3_moe"})
"""``model_type`` values of GQA models with routed experts (no shared expert)."""
MLA_TYPES = frozenset({"deepseek_v3", "kimi_k2"})
"""``model_type`` values of MLA models with routed and shared experts."""


def _text(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language-model part of a config (multimodal wrappers keep it under ``text_config``)."""
    text = config.get("text_config")
    return text if isinstance(text, Mapping) and "hidden_size" in text else config


def _need(cfg: Mapping[str, Any], key: str, where: str) -> Any:
    if cfg.get(key) is None:
        raise LayoutError(f"config.json ({where}): missing field {key!r}")
    return cfg[key]


def _common(cfg: Mapping[str, Any], kind: str) -> dict[str, Any]:
    heads = int(_need(cfg, "num_attention_heads", kind))
    kv = cfg.get("num_key_value_heads")
    return dict(
        num_layers=int(_need(cfg, "num_hidden_layers", kind)),
        hidden_size=int(_need(cfg, "hidden_size", kind)),
        num_attention_heads=heads,
        num_query_groups=None if kv is None or int(kv) == heads else int(kv),
        vocab_size=int(_need(cfg, "vocab_size", kind)),
        ffn_hidden_size=int(cfg.get("intermediate_size") or 0),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rope_theta=float(cfg.get("rope_theta", 10000.0)),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
    )


def _refuse_if(cond: bool, kind: str, field: str, value: Any, why: str) -> None:
    if cond:
        raise LayoutError(f"config.json ({kind}): {field}={value!r} is not described by the layout tables ({why})")


def _dense(cfg: Mapping[str, Any], kind: str) -> ModelDims:
    _refuse_if(kind in ("llama", "mistral") and bool(cfg.get("attention_bias")), kind, "attention_bias", True,
               "o_proj bias")
    _refuse_if(bool(cfg.get("mlp_bias")), kind, "mlp_bias", True, "MLP biases")
    d = _common(cfg, kind)
    head_dim = cfg.get("head_dim")
    if head_dim is not None and int(head_dim) != d["hidden_size"] // d["num_attention_heads"]:
        d["head_dim"] = int(head_dim)
    return ModelDims(**d, add_qkv_bias=kind == "qwen2", qk_layernorm=kind == "qwen3")


def _qwen3_moe(cfg: Mapping[str, Any], kind: str) -> ModelDims:
    sparse_step = cfg.get("decoder_sparse_step", 1)
    _refuse_if(sparse_step != 1, kind, "decoder_sparse_step", sparse_step, "every layer must be MoE")
    _refuse_if(bool(cfg.get("mlp_only_layers")), kind, "mlp_only_layers", cfg.get("mlp_only_layers"),
               "every layer must be MoE")
    _refuse_if(bool(cfg.get("shared_expert_intermediate_size")), kind, "shared_expert_intermediate_size",
               cfg.get("shared_expert_intermediate_size"), "gated shared expert")
    d = _common(cfg, kind)
    return ModelDims(**d, head_dim=int(_need(cfg, "head_dim", kind)), qk_layernorm=True,
                     num_experts=int(_need(cfg, "num_experts", kind)),
                     moe_ffn_hidden_size=int(_need(cfg, "moe_intermediate_size", kind)),
                     moe_router_topk=int(cfg.get("num_experts_per_tok", 2)))


def _mla(cfg: Mapping[str, Any], kind: str) -> ModelDims:
    freq = cfg.get("moe_layer_freq", 1)
    _refuse_if(freq != 1, kind, "moe_layer_freq", freq, "only leading dense layers")
    _refuse_if(bool(cfg.get("attention_bias")), kind, "attention_bias", True, "MLA projections have no bias")
    d = _common(cfg, kind)
    d["num_query_groups"] = None  # MLA: every head has its own k/v (the tables ignore groups)
    moe_ffn = int(_need(cfg, "moe_intermediate_size", kind))
    q_lora = cfg.get("q_lora_rank")
    return ModelDims(
        **d, num_experts=int(_need(cfg, "n_routed_experts", kind)), moe_ffn_hidden_size=moe_ffn,
        shared_expert_ffn_hidden_size=int(cfg.get("n_shared_experts") or 0) * moe_ffn,
        router_expert_bias=cfg.get("topk_method") == "noaux_tc",
        first_dense_layers=int(cfg.get("first_k_dense_replace", 0)),
        multi_latent_attention=True, q_lora_rank=None if q_lora is None else int(q_lora),
        kv_lora_rank=int(_need(cfg, "kv_lora_rank", kind)), qk_head_dim=int(_need(cfg, "qk_nope_head_dim", kind)),
        qk_pos_emb_head_dim=int(_need(cfg, "qk_rope_head_dim", kind)), v_head_dim=int(_need(cfg, "v_head_dim", kind)),
        moe_router_topk=int(cfg.get("num_experts_per_tok", 2)),
    )


def dims_from_hf_config(config: Mapping[str, Any]) -> ModelDims:
    """The :class:`ModelDims` of a Hugging Face ``config.json`` (parsed to a dict).

    Args:
        config: the config dict; a multimodal wrapper with ``text_config`` is unwrapped.

    Raises:
        LayoutError: unknown ``model_type`` (the message lists the known ones), a missing
            field, or a feature the layout tables do not describe (names the field).
    """
    cfg = _text(config)
    kind = str(cfg.get("model_type", ""))
    if kind in DENSE_TYPES:
        return _dense(cfg, kind)
    if kind in MOE_TYPES:
        return _qwen3_moe(cfg, kind)
    if kind in MLA_TYPES:
        return _mla(cfg, kind)
    known = sorted(DENSE_TYPES | MOE_TYPES | MLA_TYPES)
    raise LayoutError(f"config.json: model_type {kind!r} has no layout table; known: {', '.join(known)}")


def unmodelled_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """Fields of ``config`` that add weights the refit does not carry (e.g. MTP layers)."""
    cfg = _text(config)
    out = {}
    if int(cfg.get("num_nextn_predict_layers") or 0):
        out["num_nextn_predict_layers"] = int(cfg["num_nextn_predict_layers"])
    return out
