"""Independent dense reference: HF tensors -> Megatron-local shards, the way a checkpoint
converter does it (whole-tensor views, splits and cats). Shares no code with nemo_dcr.layout.

Values are "iota" tensors: element ``k`` of canonical tensor number ``t`` holds
``t * TAG + k``; padding rows hold ``-1``. After sharding, every local element says exactly
which canonical element it came from.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

TAG = 1 << 40


@dataclass(frozen=True)
class Topo:
    """Sizes and one rank's coordinates, for the reference only."""

    tp: int = 1
    pp: int = 1
    vpp: int = 1
    ep: int = 1
    etp: int = 1
    first: int | None = None
    last: int | None = None
    tp_rank: int = 0
    pp_rank: int = 0
    ep_rank: int = 0
    etp_rank: int = 0


def hf_shapes(family: str, d) -> dict[str, tuple[int, ...]]:
    """Canonical HF names and shapes, written from the HF modeling code's point of view."""
    h = d.hidden_size
    out = {"model.embed_tokens.weight": (d.vocab_size, h), "model.norm.weight": (h,)}
    if not d.tie_word_embeddings:
        out["lm_head.weight"] = (d.vocab_size, h)
    for L in range(d.num_layers):
        p = f"model.layers.{L}."
        out[p + "input_layernorm.weight"] = (h,)
        out[p + "post_attention_layernorm.weight"] = (h,)
        out.update(_mla_shapes(d, p) if family == "deepseek_v3" else _gqa_shapes(d, p))
        moe = d.num_experts and L >= d.first_dense_layers
        if not moe:
            out.update(_mlp_shapes(p + "mlp.", h, d.ffn_hidden_size))
            continue
        out[p + "mlp.gate.weight"] = (d.num_experts, h)
        if d.router_expert_bias:
            out[p + "mlp.gate.e_score_correction_bias"] = (d.num_experts,)
        for x in range(d.num_experts):
            out.update(_mlp_shapes(f"{p}mlp.experts.{x}.", h, d.moe_ffn_hidden_size))
        if d.shared_expert_ffn_hidden_size:
            out.update(_mlp_shapes(p + "mlp.shared_experts.", h, d.shared_expert_ffn_hidden_size))
    return out


def _gqa_shapes(d, p):
    hd = d.head_dim or d.hidden_size // d.num_attention_heads
    nq, nkv, h = d.num_attention_heads * hd, (d.num_query_groups or d.num_attention_heads) * hd, \
        d.hidden_size
    out = {p + "self_attn.q_proj.weight": (nq, h), p + "self_attn.k_proj.weight": (nkv, h),
           p + "self_attn.v_proj.weight": (nkv, h), p + "self_attn.o_proj.weight": (h, nq)}
    if d.add_qkv_bias:
        out.update({p + "self_attn.q_proj.bias": (nq,), p + "self_attn.k_proj.bias": (nkv,),
                    p + "self_attn.v_proj.bias": (nkv,)})
    if d.qk_layernorm:
        out.update({p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
    return out


def _mla_shapes(d, p):
    a, h, n = p + "self_attn.", d.hidden_size, d.num_attention_heads
    qh = d.qk_head_dim + d.qk_pos_emb_head_dim
    out = {a + "kv_a_proj_with_mqa.weight": (d.kv_lora_rank + d.qk_pos_emb_head_dim, h),
           a + "kv_a_layernorm.weight": (d.kv_lora_rank,),
           a + "kv_b_proj.weight": (n * (d.qk_head_dim + d.v_head_dim), d.kv_lora_rank),
           a + "o_proj.weight": (h, n * d.v_head_dim)}
    if d.q_lora_rank is None:
        out[a + "q_proj.weight"] = (n * qh, h)
    else:
        out.update({a + "q_a_proj.weight": (d.q_lora_rank, h),
                    a + "q_a_layernorm.weight": (d.q_lora_rank,),
                    a + "q_b_proj.weight": (n * qh, d.q_lora_rank)})
    return out


def _mlp_shapes(p, h, f):
    return {p + "gate_proj.weight": (f, h), p + "up_proj.weight": (f, h),
            p + "down_proj.weight": (h, f)}


def hf_iota(shapes: dict[str, tuple[int, ...]]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Index-valued canonical tensors; returns (tensors, names by tag id)."""
    names = sorted(shapes)
    out = {}
    for t, n in enumerate(names):
        numel = 1
        for s in shapes[n]:
            numel *= s
        out[n] = (torch.arange(numel, dtype=torch.int64) + t * TAG).view(shapes[n])
    return out, names


def pipeline_blocks(num_layers: int, topo: Topo) -> dict[tuple[int, int], list[int]]:
    """(pp_rank, chunk) -> global layers, by laying layers out chunk-major over stages."""
    if topo.pp == 1:
        return {(0, 0): list(range(num_layers))}
    sizes = [None] * topo.pp
    if topo.first is not None:
        sizes[0] = topo.first
    if topo.last is not None:
        sizes[-1] = topo.last
    rest = num_layers - sum(s for s in sizes if s is not None)
    free = [i for i, s in enumerate(sizes) if s is None]
    for i in free:
        sizes[i] = rest // len(free)
    blocks, nxt = {}, 0
    for v in range(topo.vpp):
        for s in range(topo.pp):
            n = sizes[s] // topo.vpp
            blocks[(s, v)] = list(range(nxt, nxt + n))
            nxt += n
    assert nxt == num_layers
    return blocks


def pad_vocab(d, tp: int) -> int:
    mult = d.make_vocab_size_divisible_by * tp
    return d.padded_vocab_size or ((d.vocab_size + mult - 1) // mult) * mult


def fuse_qkv(q, k, v, groups: int) -> torch.Tensor:
    """Megatron's linear_qkv from HF q/k/v: per group, its q heads then k then v."""
    tail = q.shape[1:]
    parts = [q.reshape(groups, -1, *tail), k.reshape(groups, -1, *tail),
             v.reshape(groups, -1, *tail)]
    return torch.cat(parts, dim=1).reshape(-1, *tail)


def fuse_gate_up(gate, up, parts: int, rank: int) -> torch.Tensor:
    return torch.cat([gate.chunk(parts, 0)[rank], up.chunk(parts, 0)[rank]], 0)


def col(t, parts, rank):
    return t.chunk(parts, 0)[rank].clone()


def row(t, parts, rank):
    return t.chunk(parts, 1)[rank].clone()


def megatron_shards(family: str, d, hf: dict, topo: Topo, chunk: int, spec) -> dict:
    """Local parameter dict of one rank's model chunk (names as named_parameters())."""
    out = {}
    T, r = topo.tp, topo.tp_rank
    layers = pipeline_blocks(d.num_layers, topo)[(topo.pp_rank, chunk)]
    first = topo.pp_rank == 0 and chunk == 0
    last = topo.pp_rank == topo.pp - 1 and chunk == topo.vpp - 1
    pv = pad_vocab(d, T)
    emb = hf["model.embed_tokens.weight"]
    padded = torch.cat([emb, torch.full((pv - emb.shape[0], emb.shape[1]), -1)], 0)
    if first:
        out["embedding.word_embeddings.weight"] = col(padded, T, r)
    if last:
        out["decoder.final_layernorm.weight"] = hf["model.norm.weight"].clone()
        if not d.tie_word_embeddings:
            head = hf["lm_head.weight"]
            head = torch.cat([head, torch.full((pv - head.shape[0], head.shape[1]), -1)], 0)
            out["output_layer.weight"] = col(head, T, r)
        elif topo.pp > 1:
            out["output_layer.weight"] = col(padded, T, r)
    for i, L in enumerate(layers):
        p, h = f"decoder.layers.{i}.", f"model.layers.{L}."
        attn = _mla_layer if family == "deepseek_v3" else _gqa_layer
        out.update(attn(d, hf, topo, spec, p, h))
        out.update(_mlp_layer(d, hf, topo, spec, p, h, L))
    return out


def _gqa_layer(d, hf, topo, spec, p, h):
    T, r = topo.tp, topo.tp_rank
    a, ha = p + "self_attention.", h + "self_attn."
    g = d.num_query_groups or d.num_attention_heads
    out = {}
    ln = hf[h + "input_layernorm.weight"].clone()
    out[a + "linear_qkv.layer_norm_weight" if spec.transformer_engine
        else p + "input_layernorm.weight"] = ln
    qkv = fuse_qkv(hf[ha + "q_proj.weight"], hf[ha + "k_proj.weight"], hf[ha + "v_proj.weight"], g)
    out[a + "linear_qkv.weight"] = col(qkv, T, r)
    if d.add_qkv_bias:
        b = fuse_qkv(hf[ha + "q_proj.bias"], hf[ha + "k_proj.bias"], hf[ha + "v_proj.bias"], g)
        out[a + "linear_qkv.bias"] = col(b, T, r)
    if d.qk_layernorm:
        out[a + "q_layernorm.weight"] = hf[ha + "q_norm.weight"].clone()
        out[a + "k_layernorm.weight"] = hf[ha + "k_norm.weight"].clone()
    out[a + "linear_proj.weight"] = row(hf[ha + "o_proj.weight"], T, r)
    return out


def _mla_layer(d, hf, topo, spec, p, h):
    T, r, te = topo.tp, topo.tp_rank, spec.transformer_engine
    a, ha = p + "self_attention.", h + "self_attn."
    down = (lambda t: t.clone()) if te else (lambda t: col(t, T, r))
    out = {p + "input_layernorm.weight": hf[h + "input_layernorm.weight"].clone()}
    if d.q_lora_rank is None:
        out[a + "linear_q_proj.weight"] = col(hf[ha + "q_proj.weight"], T, r)
    else:
        out[a + "linear_q_down_proj.weight"] = down(hf[ha + "q_a_proj.weight"])
        qn = a + ("linear_q_up_proj.layer_norm_weight" if te else "q_layernorm.weight")
        out[qn] = hf[ha + "q_a_layernorm.weight"].clone()
        out[a + "linear_q_up_proj.weight"] = col(hf[ha + "q_b_proj.weight"], T, r)
    out[a + "linear_kv_down_proj.weight"] = down(hf[ha + "kv_a_proj_with_mqa.weight"])
    kn = a + ("linear_kv_up_proj.layer_norm_weight" if te else "kv_layernorm.weight")
    out[kn] = hf[ha + "kv_a_layernorm.weight"].clone()
    out[a + "linear_kv_up_proj.weight"] = col(hf[ha + "kv_b_proj.weight"], T, r)
    out[a + "linear_proj.weight"] = row(hf[ha + "o_proj.weight"], T, r)
    return out


def _mlp_layer(d, hf, topo, spec, p, h, L):
    T, r, te = topo.tp, topo.tp_rank, spec.transformer_engine
    m, hm = p + "mlp.", h + "mlp."
    moe = d.num_experts and L >= d.first_dense_layers
    out = {}
    ln = hf[h + "post_attention_layernorm.weight"].clone()
    out[m + "linear_fc1.layer_norm_weight" if te and not moe else p + "pre_mlp_layernorm.weight"] = ln
    if not moe:
        out[m + "linear_fc1.weight"] = fuse_gate_up(hf[hm + "gate_proj.weight"],
                                                    hf[hm + "up_proj.weight"], T, r)
        out[m + "linear_fc2.weight"] = row(hf[hm + "down_proj.weight"], T, r)
        return out
    out[m + "router.weight"] = hf[hm + "gate.weight"].clone()
    if d.router_expert_bias:
        out[m + "router.expert_bias"] = hf[hm + "gate.e_score_correction_bias"].clone()
    out.update(_experts(d, hf, topo, spec, m, hm))
    if d.shared_expert_ffn_hidden_size:
        s, hs = m + "shared_experts.", hm + "shared_experts."
        out[s + "linear_fc1.weight"] = fuse_gate_up(hf[hs + "gate_proj.weight"],
                                                    hf[hs + "up_proj.weight"], T, r)
        out[s + "linear_fc2.weight"] = row(hf[hs + "down_proj.weight"], T, r)
    return out


def _experts(d, hf, topo, spec, m, hm):
    n = d.num_experts // topo.ep
    E, er = topo.etp, topo.etp_rank
    fc1, fc2 = [], []
    for j in range(n):
        x = topo.ep_rank * n + j
        hx = f"{hm}experts.{x}."
        fc1.append(fuse_gate_up(hf[hx + "gate_proj.weight"], hf[hx + "up_proj.weight"], E, er))
        fc2.append(row(hf[hx + "down_proj.weight"], E, er))
    out, ex = {}, m + "experts."
    if not spec.moe_grouped_gemm:
        for j in range(n):
            out[f"{ex}local_experts.{j}.linear_fc1.weight"] = fc1[j]
            out[f"{ex}local_experts.{j}.linear_fc2.weight"] = fc2[j]
    elif not spec.legacy_grouped_gemm:
        for j in range(n):
            out[f"{ex}linear_fc1.weight{j}"] = fc1[j]
            out[f"{ex}linear_fc2.weight{j}"] = fc2[j]
    else:
        # GroupedMLP reads weight1 as view(E_local, hidden, -1) and weight2 as
        # view(E_local, -1, hidden): each expert's block is its transposed linear weight.
        w1 = torch.stack([w.t() for w in fc1]).contiguous()
        w2 = torch.stack([w.t() for w in fc2]).contiguous()
        out[ex + "weight1"] = w1.reshape(d.hidden_size, -1)
        out[ex + "weight2"] = w2.reshape(-1, d.hidden_size)
    return out


# --- tests of the reference itself -------------------------------------------------------


def test_fuse_qkv_matches_megatron_split():
    """Megatron splits linear_qkv output via view(groups, (q/g + 2) * hd) then split."""
    groups, qpg, hd, hid = 3, 2, 4, 5
    q = torch.randn(groups * qpg * hd, hid)
    k, v = torch.randn(groups * hd, hid), torch.randn(groups * hd, hid)
    fused = fuse_qkv(q, k, v, groups).view(groups, (qpg + 2) * hd, hid)
    q2, k2, v2 = torch.split(fused, [qpg * hd, hd, hd], dim=1)
    assert torch.equal(q2.reshape(-1, hid), q)
    assert torch.equal(k2.reshape(-1, hid), k)
    assert torch.equal(v2.reshape(-1, hid), v)


@pytest.mark.parametrize("n,first,last", [(9, None, None), (8, 2, None), (8, None, 2), (6, 2, 2)])
def test_pipeline_blocks_cover_all_layers(n, first, last):
    topo = Topo(pp=3, vpp=1, first=first, last=last)
    blocks = pipeline_blocks(n, topo)
    flat = [L for s in range(3) for L in blocks[(s, 0)]]
    assert flat == sorted(flat) and len(set(flat)) == len(flat)
