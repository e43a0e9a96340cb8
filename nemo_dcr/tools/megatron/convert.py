"""Dense HF <-> Megatron conversion with plain torch ops: the independent reference.

This is deliberately a *different* implementation from :mod:`nemo_dcr.layout`: it works on
whole tensors (concatenate TP shards, de-interleave qkv, split gate/up, drop vocab padding),
so a test can compare the sparse index remap against it.  It gathers full tensors to rank 0,
which the refit path never does; use it only for loading and for verification.

Megatron names used here are *global*: layer numbers are the model-wide layer index
(``TransformerLayer.layer_number - 1``) and experts are numbered model-wide.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from nemo_dcr.layout import ModelDims

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.*)$")

# megatron per-layer suffix -> HF per-layer suffix (one-to-one tensors)
_SIMPLE = {
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.linear_q_proj.weight": "self_attn.q_proj.weight",
    "self_attention.linear_kv_down_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "self_attention.linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight",
    "self_attention.kv_layernorm.weight": "self_attn.kv_a_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.shared_experts.linear_fc2.weight": "mlp.shared_experts.down_proj.weight",
}
_GATE_UP = {
    "mlp.linear_fc1.weight": "mlp.",
    "mlp.shared_experts.linear_fc1.weight": "mlp.shared_experts.",
}


def _layer_suffix_map(preset: ModelDims) -> dict[str, str]:
    table = dict(_SIMPLE)
    if preset.qk_layernorm:
        table["self_attention.q_layernorm.weight"] = "self_attn.q_norm.weight"
        table["self_attention.k_layernorm.weight"] = "self_attn.k_norm.weight"
    return table


def _qkv_split(full: torch.Tensor, p: ModelDims) -> list[torch.Tensor]:
    hd, groups = p.kv_channels, p.kv_heads
    per = p.num_attention_heads // groups
    g = full.reshape(groups, per + 2, hd, -1)
    hidden = full.shape[-1]
    return [g[:, :per].reshape(-1, hidden), g[:, per].reshape(-1, hidden),
            g[:, per + 1].reshape(-1, hidden)]


def _qkv_merge(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: ModelDims):
    hd, groups = p.kv_channels, p.kv_heads
    per = p.num_attention_heads // groups
    hidden = q.shape[-1]
    parts = [q.reshape(groups, per, hd, hidden), k.reshape(groups, 1, hd, hidden),
             v.reshape(groups, 1, hd, hidden)]
    return torch.cat(parts, dim=1).reshape(-1, hidden)


def megatron_to_hf(name: str, full: torch.Tensor, p: ModelDims) -> dict[str, torch.Tensor]:
    """One full (TP-gathered, gate/up un-interleaved) megatron tensor -> its HF tensor(s)."""
    if name == "embedding.word_embeddings.weight":
        return {"model.embed_tokens.weight": full[: p.vocab_size]}
    if name == "output_layer.weight":
        return {} if p.tie_word_embeddings else {"lm_head.weight": full[: p.vocab_size]}
    if name == "decoder.final_layernorm.weight":
        return {"model.norm.weight": full}
    m = _LAYER.match(name)
    if m is None:
        raise KeyError(f"no HF mapping for megatron tensor {name!r}")
    hl, rest = f"model.layers.{m.group(1)}.", m.group(2)
    e = _EXPERT.match(rest)
    if e is not None:
        hx = f"{hl}mlp.experts.{e.group(1)}."
        if e.group(2) == "linear_fc1.weight":
            g, u = full.chunk(2, dim=0)
            return {hx + "gate_proj.weight": g, hx + "up_proj.weight": u}
        return {hx + "down_proj.weight": full}
    if rest == "self_attention.linear_qkv.weight":
        q, k, v = _qkv_split(full, p)
        return {hl + "self_attn.q_proj.weight": q, hl + "self_attn.k_proj.weight": k,
                hl + "self_attn.v_proj.weight": v}
    if rest in _GATE_UP:
        g, u = full.chunk(2, dim=0)
        return {hl + _GATE_UP[rest] + "gate_proj.weight": g,
                hl + _GATE_UP[rest] + "up_proj.weight": u}
    return {hl + _layer_suffix_map(p)[rest]: full}


def hf_to_megatron(name: str, hf: Mapping[str, torch.Tensor], p: ModelDims,
                   tp: int) -> torch.Tensor:
    """The full megatron tensor ``name`` (global name, TP=1 layout) built from HF tensors."""
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        src = hf["model.embed_tokens.weight" if p.tie_word_embeddings or name[0] == "e" else "lm_head.weight"]
        out = src.new_zeros(p.padded_vocab(tp), src.shape[1])
        out[: p.vocab_size] = src
        return out
    if name == "decoder.final_layernorm.weight":
        return hf["model.norm.weight"]
    m = _LAYER.match(name)
    hl, rest = f"model.layers.{m.group(1)}.", m.group(2)
    if rest == "self_attention.linear_qkv.weight":
        a = hl + "self_attn."
        return _qkv_merge(hf[a + "q_proj.weight"], hf[a + "k_proj.weight"],
                          hf[a + "v_proj.weight"], p)
    e = _EXPERT.match(rest)
    prefix = f"{hl}mlp.experts.{e.group(1)}." if e else hl + _GATE_UP.get(rest, "")
    if (e and e.group(2) == "linear_fc1.weight") or rest in _GATE_UP:
        return torch.cat([hf[prefix + "gate_proj.weight"], hf[prefix + "up_proj.weight"]])
    if e:
        return hf[prefix + "down_proj.weight"]
    return hf[hl + _layer_suffix_map(p)[rest]]


def shard_of(name: str, full: torch.Tensor, size: int, rank: int, dim: int | None):
    """This rank's TP shard of a full megatron tensor (gate/up sharded separately)."""
    if dim is None or size == 1:
        return full
    if name.endswith("linear_fc1.weight"):
        g, u = full.chunk(2, dim=0)
        return torch.cat([g.chunk(size, dim=0)[rank], u.chunk(size, dim=0)[rank]])
    return full.chunk(size, dim=dim)[rank]


def merge_shards(name: str, shards: list[torch.Tensor], dim: int | None) -> torch.Tensor:
    """Inverse of :func:`shard_of` given every rank's shard, in TP-rank order."""
    if dim is None or len(shards) == 1:
        return shards[0]
    if name.endswith("linear_fc1.weight"):
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return torch.cat(shards, dim=dim)
