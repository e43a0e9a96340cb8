"""Megatron-Core integration: CPU shim, GPTModel construction from a :class:`ModelDims`, topology.

Only this folder imports megatron.  Everything here runs on CPU with gloo (megatron-core
0.16.1 on Python 3.11): models use the local (non-Transformer-Engine) layer spec, CPU
initialization, the allgather MoE dispatcher and SequentialMLP experts.  On a GPU host the same
functions build the same modules (initialized on the CPU, the same bits), then move them to the
current CUDA device (:func:`model_device`, set from ``LOCAL_RANK``); :func:`install_cpu_shim` is
skipped there.  (No GPU run of this path has been made yet.)

Related modules:
    :mod:`nemo_dcr.tools.megatron.convert`: HF <-> megatron dense conversion (load + export).
    :mod:`nemo_dcr.tools.megatron.train`: pipeline forward/backward and the fp32-master step.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from nemo_dcr.layout import ModelDims

_SHIM_INSTALLED = False


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
        if torch.cuda.is_available():  # one GPU per rank, as torchrun numbers them on the node
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp, expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )
    torch.manual_seed(seed)


def model_device() -> torch.device:
    """Where models and their pipeline buffers live: the current CUDA device, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def transformer_config(dims: ModelDims, dtype: torch.dtype, pp: int, vpp: int | None = None,
                       num_layers_in_first_pipeline_stage: int | None = None,
                       num_layers_in_last_pipeline_stage: int | None = None):
    """The megatron ``TransformerConfig`` (or ``MLATransformerConfig``) of a model description.

    ``num_layers_in_first_pipeline_stage`` / ``num_layers_in_last_pipeline_stage`` are megatron's uneven-pipeline knobs (None: even split).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.transformer import TransformerConfig

    kw = dict(
        num_layers=dims.num_layers, hidden_size=dims.hidden_size, ffn_hidden_size=dims.ffn_hidden_size,
        num_attention_heads=dims.num_attention_heads, num_query_groups=dims.kv_heads,
        kv_channels=dims.head_dim, normalization="RMSNorm", layernorm_epsilon=dims.norm_eps,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        add_qkv_bias=dims.add_qkv_bias, hidden_dropout=0.0, attention_dropout=0.0,
        qk_layernorm=_megatron_qk_layernorm(dims),
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp and vpp > 1 else None,
        num_layers_in_first_pipeline_stage=num_layers_in_first_pipeline_stage,
        num_layers_in_last_pipeline_stage=num_layers_in_last_pipeline_stage,
        expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
        expert_tensor_parallel_size=ps.get_expert_tensor_parallel_world_size(),
        use_cpu_initialization=True, params_dtype=dtype, bf16=dtype == torch.bfloat16,
        pipeline_dtype=dtype if pp > 1 else None, perform_initialization=True,
        persist_layer_norm=False, bias_activation_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, sequence_parallel=False,
    )
    if dims.num_experts:
        kw.update(
            num_moe_experts=dims.num_experts, moe_ffn_hidden_size=dims.moe_ffn_hidden_size,
            moe_router_topk=dims.moe_router_topk, moe_token_dispatcher_type="allgather",
            moe_grouped_gemm=False, moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_shared_expert_intermediate_size=dims.shared_expert_ffn_hidden_size or None,
            moe_router_enable_expert_bias=dims.router_expert_bias,
        )
        if dims.first_dense_layers:
            kw["moe_layer_freq"] = [0] * dims.first_dense_layers + [1] * (dims.num_layers - dims.first_dense_layers)
    if not dims.multi_latent_attention:
        return TransformerConfig(**kw)
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    kw.pop("kv_channels")
    return MLATransformerConfig(
        **kw, q_lora_rank=dims.q_lora_rank, kv_lora_rank=dims.kv_lora_rank,
        qk_head_dim=dims.qk_head_dim, qk_pos_emb_head_dim=dims.qk_pos_emb_head_dim,
        v_head_dim=dims.v_head_dim, rope_type="rope", rotary_base=dims.rope_theta,
    )


def _megatron_qk_layernorm(dims: ModelDims) -> bool:
    """Megatron's ``qk_layernorm``: Qwen3's q/k norms, or MLA's ``kv_layernorm`` (and q norm)."""
    return dims.qk_layernorm or dims.multi_latent_attention


def build_gpt_model(dims: ModelDims, dtype: torch.dtype = torch.bfloat16,
                    vpp: int | None = None, num_layers_in_first_pipeline_stage: int | None = None,
                    num_layers_in_last_pipeline_stage: int | None = None) -> list[torch.nn.Module]:
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
        dims: the model.
        dtype: parameter dtype.
        vpp: model chunks per pipeline stage (None: ``parallel_state``'s virtual size).
        num_layers_in_first_pipeline_stage: layers on the first pipeline stage (uneven pipeline).
        num_layers_in_last_pipeline_stage: layers on the last pipeline stage (uneven pipeline).

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
    if vpp and pp == 2 and num_layers_in_first_pipeline_stage is not None and num_layers_in_last_pipeline_stage is not None:
        raise ValueError(
            "uneven first and last stage with pp=2 and vpp>1: megatron-core 0.16.1's "
            "get_transformer_layer_offset divides by zero middle stages; set only one of them")
    config = transformer_config(dims, dtype, pp, vpp, num_layers_in_first_pipeline_stage, num_layers_in_last_pipeline_stage)
    spec = get_gpt_layer_local_spec(
        num_experts=dims.num_experts or None, moe_grouped_gemm=False,
        qk_layernorm=_megatron_qk_layernorm(dims), multi_latent_attention=dims.multi_latent_attention,
        normalization="RMSNorm",
    )
    if dims.multi_latent_attention:
        _patch_mla_core_attention(spec)
    vocab = dims.padded_vocab(ps.get_tensor_model_parallel_world_size())
    chunks = []
    for stage in range(vpp or 1):
        vp_stage = stage if vpp else None
        chunks.append(GPTModel(
            config=config, transformer_layer_spec=spec, vocab_size=vocab,
            max_sequence_length=4096,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            share_embeddings_and_output_weights=dims.tie_word_embeddings, position_embedding_type="rope",
            rotary_base=int(dims.rope_theta), vp_stage=vp_stage,
        ).to(device=model_device(), dtype=dtype))  # dtype like Float16Module: the torch-norm fallback
        # allocates fp32 weights; built on the CPU (use_cpu_initialization), then on the current device
    return chunks


def wrap_ddp(chunks: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """Megatron DDP with the distributed optimizer around every chunk (buffers on this device)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    cfg = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True,
                                        overlap_grad_reduce=False, bucket_size=1 << 14)
    return [DistributedDataParallel(c.config, cfg, c) for c in chunks]


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
