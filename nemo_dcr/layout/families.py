"""Declarative family tables: Megatron name pattern -> typed mapping, plus canonical shapes.

Pattern placeholders: ``{i}`` local layer (index inside the model chunk), ``{j}`` local expert.
HF templates: ``{L}`` global layer, ``{X}`` global expert. ``when`` names predicates from
:data:`PREDICATES`; all must hold for the rule to apply to a layer / rank / spec.

To add a family: list its rule groups in :data:`FAMILIES` and its canonical shapes in
:data:`SHAPES` (see docs/layout.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from nemo_dcr.layout.mappings import (
    QKV,
    Column,
    Ctx,
    GateUp,
    GroupedFC1,
    GroupedFC2,
    Mapping,
    Replicated,
    Row,
    VocabRows,
)

Scope = str  # "first" (embedding stage), "last" (output stage), "layer", "expert"


@dataclass(frozen=True)
class Rule:
    """One row of a family table."""

    pattern: str
    """Megatron local parameter name (``{i}`` local layer, ``{j}`` local expert)."""
    mapping: Mapping
    """How the parameter's indices reach the canonical tensor(s)."""
    scope: Scope = "layer"
    """Where the parameter lives: ``first``/``last`` pipeline chunk, every ``layer``, or every
    local ``expert`` of a layer."""
    when: tuple[str, ...] = ()
    """Predicate names that must all hold."""
    duplicate_of: str | None = None
    """Megatron name holding the same values (tied output layer); the runtime may skip it."""


P = "decoder.layers.{i}."
H = "model.layers.{L}."
SA, HA = P + "self_attention.", H + "self_attn."
MLP, HM = P + "mlp.", H + "mlp."

EMBED = (
    Rule("embedding.word_embeddings.weight", VocabRows("model.embed_tokens.weight"), "first"),
    Rule("output_layer.weight", VocabRows("lm_head.weight"), "last", ("untied",)),
    Rule("output_layer.weight", VocabRows("model.embed_tokens.weight"), "last", ("tied_copy",),
         duplicate_of="embedding.word_embeddings.weight"),
    Rule("decoder.final_layernorm.weight", Replicated("model.norm.weight"), "last"),
)

GQA = (
    Rule(P + "input_layernorm.weight", Replicated(H + "input_layernorm.weight"), when=("local",)),
    Rule(SA + "linear_qkv.layer_norm_weight", Replicated(H + "input_layernorm.weight"),
         when=("te",)),
    Rule(SA + "linear_qkv.weight", QKV(HA + "q_proj.weight", HA + "k_proj.weight",
                                       HA + "v_proj.weight")),
    Rule(SA + "linear_qkv.bias", QKV(HA + "q_proj.bias", HA + "k_proj.bias", HA + "v_proj.bias"),
         when=("qkv_bias",)),
    Rule(SA + "q_layernorm.weight", Replicated(HA + "q_norm.weight"), when=("qk_norm",)),
    Rule(SA + "k_layernorm.weight", Replicated(HA + "k_norm.weight"), when=("qk_norm",)),
    Rule(SA + "linear_proj.weight", Row(HA + "o_proj.weight")),
)

MLA = (
    Rule(P + "input_layernorm.weight", Replicated(H + "input_layernorm.weight")),
    Rule(SA + "linear_q_proj.weight", Column(HA + "q_proj.weight"), when=("no_q_lora",)),
    Rule(SA + "linear_q_down_proj.weight", Column(HA + "q_a_proj.weight"),
         when=("q_lora", "local")),
    Rule(SA + "linear_q_down_proj.weight", Replicated(HA + "q_a_proj.weight"),
         when=("q_lora", "te")),
    Rule(SA + "q_layernorm.weight", Replicated(HA + "q_a_layernorm.weight"),
         when=("q_lora", "local")),
    Rule(SA + "linear_q_up_proj.layer_norm_weight", Replicated(HA + "q_a_layernorm.weight"),
         when=("q_lora", "te")),
    Rule(SA + "linear_q_up_proj.weight", Column(HA + "q_b_proj.weight"), when=("q_lora",)),
    Rule(SA + "linear_kv_down_proj.weight", Column(HA + "kv_a_proj_with_mqa.weight"),
         when=("local",)),
    Rule(SA + "linear_kv_down_proj.weight", Replicated(HA + "kv_a_proj_with_mqa.weight"),
         when=("te",)),
    Rule(SA + "kv_layernorm.weight", Replicated(HA + "kv_a_layernorm.weight"), when=("local",)),
    Rule(SA + "linear_kv_up_proj.layer_norm_weight", Replicated(HA + "kv_a_layernorm.weight"),
         when=("te",)),
    Rule(SA + "linear_kv_up_proj.weight", Column(HA + "kv_b_proj.weight")),
    Rule(SA + "linear_proj.weight", Row(HA + "o_proj.weight")),
)

DENSE_MLP = (
    Rule(P + "pre_mlp_layernorm.weight", Replicated(H + "post_attention_layernorm.weight"),
         when=("pre_mlp_norm",)),
    Rule(MLP + "linear_fc1.layer_norm_weight", Replicated(H + "post_attention_layernorm.weight"),
         when=("te", "dense")),
    Rule(MLP + "linear_fc1.weight", GateUp(HM + "gate_proj.weight", HM + "up_proj.weight"),
         when=("dense",)),
    Rule(MLP + "linear_fc2.weight", Row(HM + "down_proj.weight"), when=("dense",)),
)

EX, HX = MLP + "experts.", HM + "experts.{X}."
MOE = (
    Rule(MLP + "router.weight", Replicated(HM + "gate.weight"), when=("moe",)),
    Rule(MLP + "router.expert_bias", Replicated(HM + "gate.e_score_correction_bias"),
         when=("moe", "expert_bias")),
    Rule(EX + "local_experts.{j}.linear_fc1.weight",
         GateUp(HX + "gate_proj.weight", HX + "up_proj.weight", expert=True), "expert",
         ("moe", "sequential")),
    Rule(EX + "local_experts.{j}.linear_fc2.weight", Row(HX + "down_proj.weight", expert=True),
         "expert", ("moe", "sequential")),
    Rule(EX + "linear_fc1.weight{j}",
         GateUp(HX + "gate_proj.weight", HX + "up_proj.weight", expert=True), "expert",
         ("moe", "te_grouped")),
    Rule(EX + "linear_fc2.weight{j}", Row(HX + "down_proj.weight", expert=True), "expert",
         ("moe", "te_grouped")),
    Rule(EX + "weight1", GroupedFC1(HX + "gate_proj.weight", HX + "up_proj.weight"),
         when=("moe", "legacy_grouped")),
    Rule(EX + "weight2", GroupedFC2(HX + "down_proj.weight"), when=("moe", "legacy_grouped")),
)

SHARED = (
    Rule(MLP + "shared_experts.linear_fc1.weight",
         GateUp(HM + "shared_experts.gate_proj.weight", HM + "shared_experts.up_proj.weight"),
         when=("shared",)),
    Rule(MLP + "shared_experts.linear_fc2.weight", Row(HM + "shared_experts.down_proj.weight"),
         when=("shared",)),
)

_DENSE = EMBED + GQA + DENSE_MLP
_MLA_MOE = EMBED + MLA + DENSE_MLP + MOE + SHARED
FAMILIES: dict[str, tuple[Rule, ...]] = {
    "llama": _DENSE,
    "smollm2": _DENSE,
    "qwen2": _DENSE,
    "qwen3": _DENSE,
    "qwen3_moe": EMBED + GQA + DENSE_MLP + MOE,
    "deepseek_v3": _MLA_MOE,
    "kimi_k2": _MLA_MOE,
}
"""Family name -> rules. ``llama`` (aliases ``smollm2``, ``qwen2``, ``qwen3``) covers Llama,
SmolLM2, Qwen2 (qkv bias), Qwen3 (q/k norm); ``kimi_k2`` is an alias of ``deepseek_v3``."""

MLA_FAMILIES = frozenset({"deepseek_v3", "kimi_k2"})
"""Families whose attention is MLA (``ModelDims.multi_latent_attention`` must be set)."""


def _spec(ctx: Ctx) -> dict[str, bool]:
    s = ctx.spec
    return {
        "local": not s.transformer_engine,
        "te": s.transformer_engine,
        "sequential": not s.moe_grouped_gemm,
        "te_grouped": s.moe_grouped_gemm and not s.legacy_grouped_gemm,
        "legacy_grouped": s.moe_grouped_gemm and s.legacy_grouped_gemm,
    }


def _model(ctx: Ctx) -> dict[str, bool]:
    d, layer = ctx.dims, ctx.layer
    moe = layer is not None and d.is_moe_layer(layer)
    te = ctx.spec.transformer_engine
    return {
        "untied": not d.tie_word_embeddings,
        "tied_copy": d.tie_word_embeddings and ctx.layout.pp > 1,
        "qkv_bias": d.add_qkv_bias,
        "qk_norm": d.qk_layernorm,
        "q_lora": d.q_lora_rank is not None,
        "no_q_lora": d.q_lora_rank is None,
        "dense": layer is not None and not moe,
        "moe": moe,
        "pre_mlp_norm": not te or moe,
        "shared": moe and d.shared_expert_ffn_hidden_size > 0,
        "expert_bias": moe and d.router_expert_bias,
    }


def rule_applies(rule: Rule, ctx: Ctx) -> bool:
    """Whether every predicate of ``rule`` holds in ``ctx``."""
    truth = {**_spec(ctx), **_model(ctx)}
    return all(truth[w] for w in rule.when)
