"""Megatron-Core adapter: CPU shim, model presets, GPTModel construction, topology discovery.

Only this folder imports megatron.  Everything here runs on CPU with gloo (megatron-core
0.16.1 on Python 3.11): models use the local (non-Transformer-Engine) layer spec, CPU
initialization, the allgather MoE dispatcher and SequentialMLP experts.  On a GPU the same
functions build the same modules; only :func:`install_cpu_shim` is skipped.

Related modules:
    :mod:`nemo_dcr.integrations.megatron.convert`: HF <-> megatron dense conversion (load + export).
    :mod:`nemo_dcr.integrations.megatron.train`: pipeline forward/backward and the fp32-master step.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

_SHIM_INSTALLED = False


@dataclass(frozen=True)
class ModelPreset:
    """Architecture of a GPT-style model, enough to build it in megatron and name it in HF.

    Attributes:
        family: layout family name (``"llama"``, ``"qwen3"``, ``"qwen3_moe"``, ``"deepseek_v3"``).
        hidden: hidden size.
        ffn: dense MLP intermediate size.
        layers: number of transformer layers.
        heads: attention heads.
        kv_groups: key/value heads (GQA query groups).
        vocab: true (HF) vocabulary size; megatron pads it (see :func:`padded_vocab`).
        tied: whether input embeddings and the output layer share weights.
        qk_layernorm: per-head RMS norm on q and k (Qwen3).
        head_dim: attention head size (``hidden // heads`` when None).
        num_experts: routed experts (0: dense model).
        moe_ffn: intermediate size of one routed expert.
        topk: experts per token.
        shared_ffn: intermediate size of the shared expert (0: none).
        mla: multi-latent attention (DeepSeek) instead of GQA.
        q_lora_rank: MLA query low-rank size (None: no q compression).
        kv_lora_rank: MLA key/value low-rank size.
        qk_head_dim: MLA non-rotary q/k head size.
        qk_pos_emb_head_dim: MLA rotary q/k head size.
        v_head_dim: MLA value head size.
        rope_theta: rotary base.
        norm_eps: RMS norm epsilon.
    """

    family: str
    hidden: int
    ffn: int
    layers: int
    heads: int
    kv_groups: int
    vocab: int
    tied: bool = False
    qk_layernorm: bool = False
    head_dim: int | None = None
    num_experts: int = 0
    moe_ffn: int = 0
    topk: int = 2
    shared_ffn: int = 0
    mla: bool = False
    q_lora_rank: int | None = None
    kv_lora_rank: int = 32
    qk_head_dim: int = 16
    qk_pos_emb_head_dim: int = 8
    v_head_dim: int = 16
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5


PRESETS: dict[str, ModelPreset] = {
    "smollm2": ModelPreset(
        "llama", hidden=576, ffn=1536, layers=30, heads=9, kv_groups=3, vocab=49152,
        tied=True, rope_theta=100000.0, norm_eps=1e-5,
    ),
    "dense-tiny": ModelPreset(
        "llama", hidden=64, ffn=128, layers=4, heads=4, kv_groups=2, vocab=1000, tied=False,
    ),
    "qwen3-moe-tiny": ModelPreset(
        "qwen3_moe", hidden=64, ffn=128, layers=4, heads=4, kv_groups=2, vocab=1000,
        qk_layernorm=True, head_dim=16, num_experts=4, moe_ffn=32, topk=2,
    ),
    "deepseek-tiny": ModelPreset(
        "deepseek_v3", hidden=64, ffn=128, layers=4, heads=4, kv_groups=4, vocab=1000,
        num_experts=4, moe_ffn=32, topk=2, shared_ffn=32, mla=True, q_lora_rank=None,
        qk_layernorm=True,
        kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16,
    ),
}


def padded_vocab(vocab: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron-LM's vocabulary padding: round up to a multiple of ``divisible_by * tp``."""
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple


def install_cpu_shim() -> None:
    """Let megatron-core modules run forward/backward on CPU (idempotent).

    ``torch.cuda.current_device`` answers ``"cpu"`` (megatron allocates on it),
    ``torch.cuda.synchronize`` and ``Tensor.cuda()`` are no-ops (the tied-embedding
    all-reduce at construction moves the weight with ``.cuda()``), and the CUDA RNG tracker becomes megatron's
    inference tracker, whose ``fork()`` is a null context (dropout is 0 in every preset).
    Skipped when CUDA is available.
    """
    global _SHIM_INSTALLED
    if _SHIM_INSTALLED or torch.cuda.is_available():
        return
    from megatron.core.tensor_parallel import random as mrandom

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    torch.Tensor.cuda = lambda self, *a, **k: self  # tied-embedding setup calls .cuda()
    mrandom.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    _SHIM_INSTALLED = True


def init_distributed(tp: int, pp: int, ep: int = 1, etp: int | None = None,
                     vpp: int | None = None, seed: int = 1234) -> None:
    """Initialize torch.distributed (gloo, from torchrun's env) and megatron's groups.

    Args:
        tp: tensor parallel size.
        pp: pipeline parallel size.
        ep: expert parallel size.
        etp: expert tensor parallel size (``tp`` when None).
        vpp: virtual pipeline chunks per stage (None: no interleaving).
        seed: torch seed, identical on all ranks so CPU initialization is deterministic.
    """
    from megatron.core import parallel_state as ps

    install_cpu_shim()
    vpp = vpp if vpp and vpp > 1 else None  # megatron: None means not interleaved
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend=backend)
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp, expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )
    torch.manual_seed(seed)


def transformer_config(preset: ModelPreset, dtype: torch.dtype, pp: int, vpp: int | None = None,
                       first_stage_layers: int | None = None,
                       last_stage_layers: int | None = None):
    """The megatron ``TransformerConfig`` (or ``MLATransformerConfig``) of a preset.

    ``first_stage_layers`` / ``last_stage_layers`` are megatron's uneven-pipeline knobs
    (``num_layers_in_{first,last}_pipeline_stage``; None: even split).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.transformer import TransformerConfig

    kw = dict(
        num_layers=preset.layers, hidden_size=preset.hidden, ffn_hidden_size=preset.ffn,
        num_attention_heads=preset.heads, num_query_groups=preset.kv_groups,
        kv_channels=preset.head_dim, normalization="RMSNorm", layernorm_epsilon=preset.norm_eps,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, qk_layernorm=preset.qk_layernorm,
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp and vpp > 1 else None,
        num_layers_in_first_pipeline_stage=first_stage_layers,
        num_layers_in_last_pipeline_stage=last_stage_layers,
        expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
        expert_tensor_parallel_size=ps.get_expert_tensor_parallel_world_size(),
        use_cpu_initialization=True, params_dtype=dtype, bf16=dtype == torch.bfloat16,
        pipeline_dtype=dtype if pp > 1 else None, perform_initialization=True,
        persist_layer_norm=False, bias_activation_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, sequence_parallel=False,
    )
    if preset.num_experts:
        kw.update(
            num_moe_experts=preset.num_experts, moe_ffn_hidden_size=preset.moe_ffn,
            moe_router_topk=preset.topk, moe_token_dispatcher_type="allgather",
            moe_grouped_gemm=False, moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_shared_expert_intermediate_size=preset.shared_ffn or None,
        )
    if not preset.mla:
        return TransformerConfig(**kw)
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    kw.pop("kv_channels")
    return MLATransformerConfig(
        **kw, q_lora_rank=preset.q_lora_rank, kv_lora_rank=preset.kv_lora_rank,
        qk_head_dim=preset.qk_head_dim, qk_pos_emb_head_dim=preset.qk_pos_emb_head_dim,
        v_head_dim=preset.v_head_dim, rope_type="rope", rotary_base=preset.rope_theta,
    )


def build_gpt_model(preset: ModelPreset, dtype: torch.dtype = torch.bfloat16,
                    vpp: int | None = None, first_stage_layers: int | None = None,
                    last_stage_layers: int | None = None) -> list[torch.nn.Module]:
    """Build this rank's GPTModel chunk(s) (one per virtual pipeline stage).

    Call :func:`init_distributed` first.  Returns a list of length ``vpp`` (1 without
    interleaving), in megatron's model-list order.

    With virtual pipeline, megatron-core 0.16.1 picks each chunk's layers from the
    ``vp_stage`` argument (``TransformerBlock`` -> ``get_num_layers_to_build(config,
    vp_stage)`` and ``get_transformer_layer_offset(config, vp_stage)``; ``layer_number`` is
    then global); only chunk 0 of the first stage has the embedding and only the last chunk of
    the last stage the output layer.  The global ``set_virtual_pipeline_model_parallel_rank``
    is deprecated there (nothing reads it while building) and is not used.

    Args:
        preset: the model.
        dtype: parameter dtype.
        vpp: model chunks per pipeline stage (None: ``parallel_state``'s virtual size).
        first_stage_layers: layers on the first pipeline stage (uneven pipeline).
        last_stage_layers: layers on the last pipeline stage (uneven pipeline).

    Raises:
        ValueError: uneven first *and* last stage with ``pp == 2`` and ``vpp > 1``:
            megatron-core 0.16.1's ``get_transformer_layer_offset`` divides by the number of
            middle stages (0) on the last stage.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    pp = ps.get_pipeline_model_parallel_world_size()
    if vpp is None:
        vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    vpp = vpp if vpp and vpp > 1 else None
    if vpp and pp == 2 and first_stage_layers is not None and last_stage_layers is not None:
        raise ValueError(
            "uneven first and last stage with pp=2 and vpp>1: megatron-core 0.16.1's "
            "get_transformer_layer_offset divides by zero middle stages; set only one of them")
    config = transformer_config(preset, dtype, pp, vpp, first_stage_layers, last_stage_layers)
    spec = get_gpt_layer_local_spec(
        num_experts=preset.num_experts or None, moe_grouped_gemm=False,
        qk_layernorm=preset.qk_layernorm, multi_latent_attention=preset.mla,
        normalization="RMSNorm",
    )
    if preset.mla:
        _patch_mla_core_attention(spec)
    vocab = padded_vocab(preset.vocab, ps.get_tensor_model_parallel_world_size())
    chunks = []
    for stage in range(vpp or 1):
        vp_stage = stage if vpp else None
        chunks.append(GPTModel(
            config=config, transformer_layer_spec=spec, vocab_size=vocab,
            max_sequence_length=4096,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            share_embeddings_and_output_weights=preset.tied, position_embedding_type="rope",
            rotary_base=int(preset.rope_theta), vp_stage=vp_stage,
        ).to(dtype))  # like Float16Module: the torch-norm fallback allocates fp32 weights
    return chunks


def _patch_mla_core_attention(spec) -> None:
    """Make the local spec's MLA buildable on megatron-core 0.16.1.

    ``MLASelfAttention`` passes ``k_channels``/``v_channels`` to its core attention, which the
    local ``DotProductAttention`` does not accept (only Transformer Engine's does).  The core
    attention holds no parameters, so a subclass that drops both arguments yields the exact
    parameter set (without Transformer Engine, 0.16.1 leaves ``HAVE_TE`` True with
    ``TELinear`` a mock stub, which breaks an ``isinstance``; reset it).  Its forward is not used on CPU (MLA presets are driven by Adam-like
    updates of the masters, not by a training forward).
    """
    from megatron.core.transformer import multi_latent_attention as mla_mod
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    if not isinstance(getattr(mla_mod, "TELinear", None), type):  # TE absent: a mock stub
        mla_mod.HAVE_TE = False

    class _MlaLocalCoreAttention(DotProductAttention):
        def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
            super().__init__(*args, **kwargs)

    spec.submodules.self_attention.submodules.core_attention = _MlaLocalCoreAttention


def rank_coords() -> dict[str, int]:
    """This rank's sizes and coordinates from ``megatron.core.parallel_state``."""
    from megatron.core import parallel_state as ps

    return dict(
        tp=ps.get_tensor_model_parallel_world_size(), tp_rank=ps.get_tensor_model_parallel_rank(),
        pp=ps.get_pipeline_model_parallel_world_size(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        ep=ps.get_expert_model_parallel_world_size(), ep_rank=ps.get_expert_model_parallel_rank(),
        etp=ps.get_expert_tensor_parallel_world_size(),
        etp_rank=ps.get_expert_tensor_parallel_rank(),
        dp=ps.get_data_parallel_world_size(), dp_rank=ps.get_data_parallel_rank(),
        edp=ps.get_expert_data_parallel_world_size(),
        edp_rank=ps.get_expert_data_parallel_rank(),
        vpp=ps.get_virtual_pipeline_model_parallel_world_size() or 1,
    )


def world_env() -> tuple[int, int]:
    """(rank, world size) from torchrun's environment."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def with_layers(preset: ModelPreset, layers: int) -> ModelPreset:
    """A copy of ``preset`` with a different number of layers."""
    return replace(preset, layers=layers)


def model_dims(preset: ModelPreset):
    """The layout stage's :class:`~nemo_dcr.layout.ModelDims` of a preset."""
    from nemo_dcr.layout import ModelDims

    return ModelDims(
        num_layers=preset.layers, hidden_size=preset.hidden,
        num_attention_heads=preset.heads, vocab_size=preset.vocab,
        num_query_groups=preset.kv_groups, head_dim=preset.head_dim,
        ffn_hidden_size=preset.ffn, tie_word_embeddings=preset.tied,
        qk_layernorm=preset.qk_layernorm and not preset.mla, num_experts=preset.num_experts,
        moe_ffn_hidden_size=preset.moe_ffn, shared_expert_ffn_hidden_size=preset.shared_ffn,
        multi_latent_attention=preset.mla, q_lora_rank=preset.q_lora_rank,
        kv_lora_rank=preset.kv_lora_rank if preset.mla else 0,
        qk_head_dim=preset.qk_head_dim if preset.mla else 0,
        qk_pos_emb_head_dim=preset.qk_pos_emb_head_dim if preset.mla else 0,
        v_head_dim=preset.v_head_dim if preset.mla else 0,
    )


def parallel_layout_from_state(first_stage_layers: int | None = None,
                               last_stage_layers: int | None = None):
    """This rank's :class:`~nemo_dcr.layout.ParallelLayout` from ``parallel_state``.

    Reads the initialized megatron groups (call after ``initialize_model_parallel``); the
    uneven-pipeline knobs are not part of ``parallel_state``: pass the values the model was
    built with (None: even split).
    """
    from nemo_dcr.layout import ParallelLayout

    c = rank_coords()
    return ParallelLayout(
        tp=c["tp"], pp=c["pp"], vpp=c["vpp"], ep=c["ep"], etp=c["etp"], dp=c["dp"],
        tp_rank=c["tp_rank"], pp_rank=c["pp_rank"], ep_rank=c["ep_rank"],
        etp_rank=c["etp_rank"], dp_rank=c["dp_rank"],
        num_layers_in_first_pipeline_stage=first_stage_layers,
        num_layers_in_last_pipeline_stage=last_stage_layers,
    )
