"""ParallelLayout validation / serialization and the pipeline layer assignment."""

from __future__ import annotations

import json
import warnings

import pytest
from test_layout_dense_ref import Topo, pipeline_blocks

from nemo_dcr.layout import LayoutError, ModelDims, ParallelLayout, chunk_layers

DENSE = ModelDims(num_layers=8, hidden_size=16, num_attention_heads=8, num_query_groups=4,
                  ffn_hidden_size=32, vocab_size=100)
MOE = ModelDims(num_layers=8, hidden_size=16, num_attention_heads=8, num_query_groups=4,
                ffn_hidden_size=32, vocab_size=100, num_experts=8, moe_ffn_hidden_size=12)

# (num_layers, pp, vpp, first, last)
PIPELINES = [
    (8, 2, 1, None, None), (8, 4, 2, None, None), (12, 3, 2, None, None),
    (8, 2, 2, None, None), (10, 3, 1, 2, None), (10, 3, 1, None, 2), (10, 3, 1, 2, 4),
    (9, 3, 1, 1, 2), (10, 3, 2, 2, 4), (14, 4, 2, 2, None), (14, 4, 2, None, 2),
    (6, 2, 1, 1, None), (6, 2, 2, 2, 4),
]


def test_roundtrip_dict_and_json():
    lay = ParallelLayout(tp=2, pp=2, vpp=2, ep=2, etp=1, dp=2, tp_rank=1, pp_rank=1, ep_rank=1,
                         num_layers_in_first_pipeline_stage=3)
    assert ParallelLayout.from_dict(lay.to_dict()) == lay
    assert ParallelLayout.from_json(lay.to_json()) == lay
    json.loads(lay.to_json())
    assert ModelDims.from_dict(MOE.to_dict()) == MOE
    with pytest.raises(LayoutError, match="unknown ParallelLayout keys"):
        ParallelLayout.from_dict({"tp": 2, "tensor_parallel": 2})


def test_sizes_and_summary():
    lay = ParallelLayout(tp=8, pp=8, ep=32, etp=1, dp=16, tp_rank=3, pp_rank=2,
                         num_layers_in_first_pipeline_stage=7, num_layers_in_last_pipeline_stage=6)
    assert (lay.world_size, lay.expert_dp) == (1024, 4)
    assert lay.describe() == "TP8 PP8(7/../6) EP32 ETP1 DP16"
    assert lay.sizes() == {"tp": 8, "pp": 8, "vpp": 1, "ep": 32, "etp": 1, "dp": 16, "cp": 1,
                           "num_layers_in_first_pipeline_stage": 7, "num_layers_in_last_pipeline_stage": 6}
    assert ParallelLayout(**lay.sizes()).describe() == lay.describe()  # the coordinates are not sizes
    assert ParallelLayout(tp=2, pp=2, vpp=2, cp=2, num_layers_in_last_pipeline_stage=4).describe() == \
        "TP2 PP2(=/../4) VPP2 EP1 ETP1 DP1 CP2"


@pytest.mark.parametrize("kwargs,world,dims,match", [
    (dict(tp=2, dp=2), 8, None, "world size 8"),
    (dict(tp=2, tp_rank=2), None, None, "tp_rank=2 out of range"),
    (dict(pp=2, pp_rank=-1), None, None, "pp_rank=-1"),
    (dict(tp=0), None, None, "tp=0"),
    (dict(tp=2, ep=4), None, None, "etp\\*ep"),
    (dict(vpp=2), None, None, "vpp > 1 needs pp > 1"),
    (dict(tp=3), None, DENSE, "tp=3"),
    (dict(tp=6), None, ModelDims(num_layers=2, hidden_size=12, num_attention_heads=12,
                                 num_query_groups=4, ffn_hidden_size=12, vocab_size=10),
     "num_query_groups"),
    (dict(ep=2, dp=2), None, DENSE, "need a model with experts"),
    (dict(ep=3, dp=3), None, MOE, "num_experts"),
    (dict(etp=8, dp=8), None, MOE, "moe_ffn_hidden_size"),
    (dict(pp=3), None, DENSE, "not divisible by pp"),
    (dict(pp=3, num_layers_in_first_pipeline_stage=1), None, DENSE, "middle layers"),
    (dict(pp=2, vpp=2, num_layers_in_first_pipeline_stage=3), None, DENSE, "divisible by vpp"),
    (dict(pp=2, num_layers_in_first_pipeline_stage=9), None, DENSE, "do not fit"),
])
def test_validate_rejects(kwargs, world, dims, match):
    with pytest.raises(LayoutError, match=match):
        ParallelLayout(**kwargs).validate(world_size=world, dims=dims)


def test_validate_accepts():
    ParallelLayout(tp=2, pp=2, dp=2, ep=2, etp=2, tp_rank=1).validate(world_size=8, dims=MOE)
    ParallelLayout(tp=8).validate(dims=ModelDims(num_layers=2, hidden_size=16,
                                                 num_attention_heads=8, num_query_groups=2,
                                                 ffn_hidden_size=16, vocab_size=10))


def test_interleaved_example_from_megatron_docstring():
    """8 layers, 2 stages, 2 chunks: stage 0 [0, 1] [4, 5], stage 1 [2, 3] [6, 7]."""
    lay = ParallelLayout(pp=2, vpp=2)
    got = {(r, v): chunk_layers(8, lay, v, pp_rank=r) for r in range(2) for v in range(2)}
    assert got == {(0, 0): (0, 2), (0, 1): (4, 2), (1, 0): (2, 2), (1, 1): (6, 2)}


@pytest.mark.parametrize("n,pp,vpp,first,last", PIPELINES)
def test_chunk_layers_match_reference_blocks(n, pp, vpp, first, last):
    lay = ParallelLayout(pp=pp, vpp=vpp, num_layers_in_first_pipeline_stage=first,
                         num_layers_in_last_pipeline_stage=last)
    blocks = pipeline_blocks(n, Topo(pp=pp, vpp=vpp, first=first, last=last))
    for (r, v), layers in blocks.items():
        off, cnt = chunk_layers(n, lay, v, pp_rank=r)
        assert list(range(off, off + cnt)) == layers, (r, v)


def test_chunk_layers_match_megatron_core():
    """Same offsets and counts as megatron-core's own functions (skipped without it)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    for n, pp, vpp, first, last in PIPELINES:
        if vpp > 1 and pp == 2 and first is not None and last is not None:
            continue  # megatron divides by zero middle stages here
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cfg = TransformerConfig(
                num_layers=n, hidden_size=8, num_attention_heads=2, pipeline_dtype=torch.float32,
                pipeline_model_parallel_size=pp,
                virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
                num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last)
        lay = ParallelLayout(pp=pp, vpp=vpp, num_layers_in_first_pipeline_stage=first,
                             num_layers_in_last_pipeline_stage=last)
        for r in range(pp):
            for v in range(vpp):
                vp = v if vpp > 1 else None
                want = (get_transformer_layer_offset(cfg, vp_stage=vp, pp_rank=r),
                        get_num_layers_to_build(cfg, vp_stage=vp, pp_rank=r))
                assert chunk_layers(n, lay, v, pp_rank=r) == want, (n, pp, vpp, first, last, r, v)


def test_padded_vocab_rule():
    d = ModelDims(num_layers=1, hidden_size=4, num_attention_heads=1, vocab_size=49152)
    assert d.padded_vocab(1) == 49152
    assert d.padded_vocab(3) == 49152  # 49152 = 128 * 3 * 128
    assert d.padded_vocab(5) == 49280
    d2 = ModelDims(num_layers=1, hidden_size=4, num_attention_heads=1, vocab_size=151936)
    assert d2.padded_vocab(8) == 152576
