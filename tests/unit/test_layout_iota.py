"""Iota tests: the sparse plan.remap of every local position equals the dense reference.

For each family and layout: canonical tensors hold their own indices (tagged by tensor), the
independent dense reference (test_layout_dense_ref) builds every rank's Megatron shards, and
for every shard and every position the remap must name the same canonical element. Across all
ranks every canonical element is covered exactly once, counting one owner per replica set
(TP-replicated norms/router on tp_rank 0; dense params on ep_rank = etp_rank = 0; routed
experts on tp_rank 0). The tied output-layer copy on the last stage is an alias of the
embedding (``duplicate_of``) and is excluded from the count, as is vocabulary padding.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_layout_dense_ref import TAG, Topo, hf_iota, hf_shapes, megatron_shards

from nemo_dcr.layout import (
    LayoutError,
    MegatronSpec,
    ModelDims,
    ParallelLayout,
    build_plan,
    canonical_shapes,
)

LLAMA = ModelDims(num_layers=4, hidden_size=12, num_attention_heads=6, num_query_groups=3,
                  ffn_hidden_size=12, vocab_size=50, make_vocab_size_divisible_by=4)
SMOL_LIKE = ModelDims(num_layers=4, hidden_size=18, num_attention_heads=9, num_query_groups=3,
                      ffn_hidden_size=12, vocab_size=47, make_vocab_size_divisible_by=8,
                      tie_word_embeddings=True)
QWEN2 = ModelDims(num_layers=2, hidden_size=8, num_attention_heads=4, num_query_groups=2,
                  ffn_hidden_size=8, vocab_size=30, make_vocab_size_divisible_by=4,
                  add_qkv_bias=True, tie_word_embeddings=True)
QWEN3 = ModelDims(num_layers=2, hidden_size=8, num_attention_heads=4, num_query_groups=2,
                  head_dim=3, ffn_hidden_size=8, vocab_size=30, make_vocab_size_divisible_by=4,
                  qk_layernorm=True)
QWEN3_MOE = ModelDims(num_layers=4, hidden_size=8, num_attention_heads=4, num_query_groups=2,
                      ffn_hidden_size=8, vocab_size=30, make_vocab_size_divisible_by=4,
                      qk_layernorm=True, num_experts=4, moe_ffn_hidden_size=6)
DSV3 = ModelDims(num_layers=3, hidden_size=8, num_attention_heads=4, ffn_hidden_size=8,
                 vocab_size=30, make_vocab_size_divisible_by=4, num_experts=4,
                 moe_ffn_hidden_size=4, shared_expert_ffn_hidden_size=4, router_expert_bias=True,
                 first_dense_layers=1, multi_latent_attention=True, q_lora_rank=6, kv_lora_rank=4,
                 qk_head_dim=3, qk_pos_emb_head_dim=2, v_head_dim=3)
DSV2_LITE = ModelDims(num_layers=2, hidden_size=8, num_attention_heads=4, ffn_hidden_size=8,
                      vocab_size=30, make_vocab_size_divisible_by=4, num_experts=2,
                      moe_ffn_hidden_size=4, shared_expert_ffn_hidden_size=8,
                      first_dense_layers=1, multi_latent_attention=True, kv_lora_rank=4,
                      qk_head_dim=2, qk_pos_emb_head_dim=2, v_head_dim=2)

SEQ, TE = MegatronSpec(), MegatronSpec(transformer_engine=True)
TE_GROUPED = MegatronSpec(transformer_engine=True, moe_grouped_gemm=True)
LEGACY = MegatronSpec(moe_grouped_gemm=True, legacy_grouped_gemm=True)

CASES = [
    ("llama", LLAMA, Topo(), SEQ),
    ("llama", LLAMA, Topo(tp=3), SEQ),
    ("llama", QWEN2, Topo(tp=2, pp=2), TE),
    ("llama", LLAMA, Topo(tp=6), SEQ),  # tp > query groups: slices cut inside a group
    ("llama", LLAMA, Topo(pp=2, vpp=2), SEQ),
    ("llama", SMOL_LIKE, Topo(tp=3, pp=2), SEQ),
    ("llama", SMOL_LIKE, Topo(tp=3, pp=3, first=1, last=1), SEQ),
    ("llama", SMOL_LIKE, Topo(pp=3, first=2), SEQ),
    ("llama", SMOL_LIKE, Topo(pp=2, vpp=2, tp=3), TE),
    ("llama", QWEN2, Topo(tp=2), SEQ),
    ("llama", QWEN3, Topo(tp=2, pp=2), SEQ),
    ("qwen3_moe", QWEN3_MOE, Topo(tp=2, pp=2, ep=2, etp=1), SEQ),
    ("qwen3_moe", QWEN3_MOE, Topo(tp=2, pp=2, ep=2, etp=2), SEQ),
    ("qwen3_moe", QWEN3_MOE, Topo(tp=2, ep=2, etp=2), TE_GROUPED),
    ("qwen3_moe", QWEN3_MOE, Topo(ep=2, etp=2, pp=2, vpp=2), LEGACY),
    ("qwen3_moe", QWEN3_MOE, Topo(ep=4), LEGACY),
    ("deepseek_v3", DSV3, Topo(), SEQ),
    ("deepseek_v3", DSV3, Topo(tp=2, ep=2, etp=2), SEQ),
    ("deepseek_v3", DSV3, Topo(tp=2, pp=3, ep=2), TE),
    ("deepseek_v3", DSV3, Topo(tp=2, pp=2, first=1, ep=4, etp=1), LEGACY),
    ("deepseek_v3", DSV2_LITE, Topo(tp=2, ep=2), SEQ),
]


def _layout(t: Topo, pp_rank: int, tp_rank: int, ep_rank: int, etp_rank: int):
    return ParallelLayout(tp=t.tp, pp=t.pp, vpp=t.vpp, ep=t.ep, etp=t.etp, dp=t.ep * t.etp,
                          tp_rank=tp_rank, pp_rank=pp_rank, ep_rank=ep_rank, etp_rank=etp_rank,
                          num_layers_in_first_pipeline_stage=t.first,
                          num_layers_in_last_pipeline_stage=t.last)


def _ranks(t: Topo):
    return itertools.product(range(t.pp), range(t.vpp), range(t.tp), range(t.ep), range(t.etp))


def _owner(plan, tp_rank, ep_rank, etp_rank) -> bool:
    """Whether this rank is the counted owner of the param (one per replica set)."""
    if plan.duplicate_of is not None:
        return False
    if plan.is_expert:
        return tp_rank == 0
    return ep_rank == 0 and etp_rank == 0 and (tp_rank == 0 or not plan.tp_replicated)


def _case_id(case):
    fam, _, t, spec = case
    flags = "".join(k[0] for k, v in vars(spec).items() if v) or "local"
    return f"{fam}-tp{t.tp}pp{t.pp}v{t.vpp}ep{t.ep}etp{t.etp}-f{t.first}l{t.last}-{flags}"


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_iota_every_position(case):
    family, dims, topo, spec = case
    shapes = hf_shapes(family, dims)
    assert canonical_shapes(family, dims) == shapes
    hf, tag_names = hf_iota(shapes)
    counts = {n: torch.zeros(hf[n].numel(), dtype=torch.int64) for n in shapes}
    for pp_rank, chunk, tp_rank, ep_rank, etp_rank in _ranks(topo):
        rank_topo = Topo(**{**vars(topo), "tp_rank": tp_rank, "pp_rank": pp_rank,
                            "ep_rank": ep_rank, "etp_rank": etp_rank})
        shards = megatron_shards(family, dims, hf, rank_topo, chunk, spec)
        plan = build_plan(family, dims, _layout(topo, pp_rank, tp_rank, ep_rank, etp_rank),
                          vpp_chunk=chunk, spec=spec)
        assert set(plan.params) == set(shards), (set(plan.params) ^ set(shards))
        for name, local in shards.items():
            pp_ = plan.params[name]
            assert pp_.local_shape == tuple(local.shape), name
            flat = local.reshape(-1)
            res = plan.remap(name, torch.arange(flat.numel()))
            mapped = torch.zeros(flat.numel(), dtype=torch.int64)
            for piece in res:
                want = flat[piece.selection]
                assert torch.all(want >= 0), f"{name}: padding mapped into {piece.name}"
                assert all(tag_names[t] == piece.name for t in (want // TAG).unique().tolist())
                assert torch.equal(want % TAG, piece.index), (name, piece.name)
                mapped[piece.selection] += 1
                if _owner(pp_, tp_rank, ep_rank, etp_rank):
                    counts[piece.name] += torch.bincount(piece.index,
                                                         minlength=counts[piece.name].numel())
            assert torch.equal(mapped, (flat >= 0).to(torch.int64)), name
    for n, c in counts.items():
        assert torch.all(c == 1), f"{n}: coverage {c.unique().tolist()}"


def _plan_and_shards(case, pp_rank=0, chunk=0, tp_rank=0, ep_rank=0, etp_rank=0):
    family, dims, topo, spec = case
    hf, _ = hf_iota(hf_shapes(family, dims))
    t = Topo(**{**vars(topo), "tp_rank": tp_rank, "pp_rank": pp_rank, "ep_rank": ep_rank,
                "etp_rank": etp_rank})
    plan = build_plan(family, dims, _layout(topo, pp_rank, tp_rank, ep_rank, etp_rank),
                      vpp_chunk=chunk, spec=spec)
    return plan, megatron_shards(family, dims, hf, t, chunk, spec)


_SUBSET_CASES = [CASES[6], CASES[13], CASES[14], CASES[19]]
_SUBSETS = [_plan_and_shards(c, tp_rank=c[2].tp - 1, ep_rank=c[2].ep - 1,
                             etp_rank=c[2].etp - 1) for c in _SUBSET_CASES]


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_random_subsets_match_full_remap(data):
    """Any subset, in any order and with repeats, maps like the same positions of the full."""
    plan, shards = data.draw(st.sampled_from(_SUBSETS))
    name = data.draw(st.sampled_from(sorted(shards)))
    flat = shards[name].reshape(-1)
    pos = data.draw(st.lists(st.integers(0, flat.numel() - 1), max_size=40))
    idx = torch.tensor(pos, dtype=torch.int64)
    seen = torch.zeros(idx.numel(), dtype=torch.int64)
    for piece in plan.remap(name, idx):
        want = flat[idx[piece.selection]]
        assert torch.equal(want % TAG, piece.index)
        seen[piece.selection] += 1
    assert torch.equal(seen, (flat[idx] >= 0).to(torch.int64))


def test_unknown_name_lists_patterns():
    plan = build_plan("llama", LLAMA, ParallelLayout())
    with pytest.raises(LayoutError, match="known patterns.*linear_qkv"):
        plan.remap("decoder.layers.0.self_attention.linear_qkv.wieght", torch.tensor([0]))


def test_module_prefix_and_bounds():
    plan = build_plan("llama", LLAMA, ParallelLayout())
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    res = plan.remap("module.module." + name, torch.tensor([1]))
    assert res.names() == ["model.layers.0.self_attn.q_proj.weight"]
    with pytest.raises(LayoutError, match="out of range"):
        plan.remap(name, torch.tensor([plan.params[name].numel]))


def test_unknown_family():
    with pytest.raises(LayoutError, match="known"):
        build_plan("gpt2", LLAMA, ParallelLayout())


def test_family_aliases_and_attention_kind():
    base = build_plan("llama", QWEN3, ParallelLayout(tp=2))
    alias = build_plan("qwen3", QWEN3, ParallelLayout(tp=2))
    assert set(base.params) == set(alias.params)
    assert set(build_plan("kimi_k2", DSV3, ParallelLayout()).params) == set(
        build_plan("deepseek_v3", DSV3, ParallelLayout()).params)
    with pytest.raises(LayoutError, match="multi_latent_attention"):
        build_plan("deepseek_v3", LLAMA, ParallelLayout())
