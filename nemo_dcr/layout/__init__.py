"""Layout stage: Megatron-local (param, flat index) -> canonical HF (name, flat index).

Pure integer arithmetic on index vectors, cost proportional to the changed elements; no
``torch.distributed``, no megatron import. Build a plan once per rank and model chunk, reuse
it every step::

    import torch
    from nemo_dcr.layout import ModelDims, ParallelLayout, build_plan

    dims = ModelDims(num_layers=30, hidden_size=576, num_attention_heads=9,
                     num_query_groups=3, ffn_hidden_size=1536, vocab_size=49152,
                     tie_word_embeddings=True)
    layout = ParallelLayout(tp=3, pp=2, tp_rank=1, pp_rank=0)
    plan = build_plan("llama", dims, layout)          # vpp_chunk=0, local spec
    res = plan.remap("decoder.layers.3.self_attention.linear_qkv.weight",
                     torch.tensor([0, 5, 70000]))
    for name, selection, canonical_idx in res:        # e.g. model.layers.3.self_attn.q_proj...
        ...

With virtual pipeline use :func:`build_chunk_plans` (one plan per model chunk; layer numbers
in Megatron names are local to the chunk). See docs/layout.md.
"""

from nemo_dcr.layout.dims import ModelDims
from nemo_dcr.layout.families import FAMILIES, Rule
from nemo_dcr.layout.hf_config import dims_from_hf_config, unmodelled_fields
from nemo_dcr.layout.mappings import MegatronSpec
from nemo_dcr.layout.models import HF_CONFIGS, MODELS, model_dims
from nemo_dcr.layout.parallel import LayoutError, ParallelLayout, chunk_layers
from nemo_dcr.layout.param_plans import LayoutPlan, ParamPlan, build_chunk_plans, build_plan
from nemo_dcr.layout.shapes import canonical_shapes
from nemo_dcr.layout.transforms import Piece, RemapResult

__all__ = [
    "FAMILIES",
    "HF_CONFIGS",
    "LayoutError",
    "LayoutPlan",
    "MODELS",
    "MegatronSpec",
    "ModelDims",
    "ParallelLayout",
    "ParamPlan",
    "Piece",
    "RemapResult",
    "Rule",
    "build_chunk_plans",
    "build_plan",
    "canonical_shapes",
    "chunk_layers",
    "dims_from_hf_config",
    "model_dims",
    "unmodelled_fields",
]
