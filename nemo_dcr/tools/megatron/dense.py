"""Dense HF <-> megatron copies over a built GPTModel (scaffolding and the independent reference).

* :func:`load_hf`: copy HF weights into this rank's shards (the demo and tests start from them);
* :func:`dense_export`: gather every shard to one rank and convert to HF tensors, the dense reference
  that tests, check-layout and the demo compare the engine with (never on the refit path).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nemo_dcr.integrations.megatron.params import local_params, replica_group
from nemo_dcr.integrations.megatron.topology import rank_coords, tp_placement
from nemo_dcr.layout import ModelDims

from .convert import hf_to_megatron, megatron_to_hf, merge_shards, shard_of


@torch.no_grad()
def load_hf(chunks: list[torch.nn.Module], hf: Mapping[str, torch.Tensor],
            dims: ModelDims) -> int:
    """Copy HF weights into this rank's shards; returns the number of params loaded."""
    coords = rank_coords()
    n = 0
    for lp in local_params(chunks, dims):
        full = hf_to_megatron(lp.global_name, hf, dims, coords["tp"])
        size, rank, dim = tp_placement(lp.param, coords)
        shard = shard_of(lp.global_name, full, size, rank, dim)
        if tuple(shard.shape) != tuple(lp.param.shape):
            raise ValueError(f"{lp.name}: HF shard {tuple(shard.shape)} != {tuple(lp.param.shape)}")
        lp.param.copy_(shard.to(lp.param.dtype))
        n += 1
    return n


@dataclass(frozen=True)
class ShardRecord:
    """One megatron shard a rank contributes to a dense copy (its first replica only)."""

    name: str
    """Global megatron name (global layer and expert numbers)."""
    tp_rank: int
    """Its rank in the (expert-)tensor-parallel group."""
    dim: int | None
    """Partition dim (None: not split)."""
    shape: tuple[int, ...]
    """Local shape."""


def first_replica_shards(chunks: list[torch.nn.Module], dims: ModelDims) -> list[tuple[ShardRecord, torch.Tensor]]:
    """This rank's shards that a dense copy needs: its params of which it holds the first replica
    (the tied output-layer copy left out), with where each sits in the full tensor."""
    coords = rank_coords()
    out = []
    for lp in local_params(chunks, dims):
        if dims.tie_word_embeddings and lp.global_name == "output_layer.weight":
            continue
        if replica_group(lp, coords)[0]:
            continue
        _, rank, dim = tp_placement(lp.param, coords)
        out.append((ShardRecord(lp.global_name, rank, dim, tuple(lp.param.shape)), lp.param.detach()))
    return out


def to_hf(shards: Iterable[tuple[ShardRecord, torch.Tensor]], dims: ModelDims) -> dict[str, torch.Tensor]:
    """HF tensors of every rank's shards: TP shards merged, megatron names converted."""
    by_name: dict[str, dict[int, torch.Tensor]] = defaultdict(dict)
    split_dim = {}
    for rec, t in shards:
        by_name[rec.name][rec.tp_rank] = t
        split_dim[rec.name] = rec.dim
    out = {}
    for name, by_rank in by_name.items():
        full = merge_shards(name, [by_rank[r] for r in sorted(by_rank)], split_dim[name])
        out.update(megatron_to_hf(name, full, dims))
    return out


@torch.no_grad()
def dense_export(chunks: list[torch.nn.Module], dims: ModelDims,
                 dst: int = 0) -> dict[str, torch.Tensor] | None:
    """Gather every shard to rank ``dst`` and convert to HF tensors (the dense reference: pickled
    objects, slow, never timed; the demo's timed dense refit is :mod:`nemo_dcr.tools.demo.dense_refit`).

    Returns the HF state dict on ``dst`` and None elsewhere.  Collective: every rank must call it.
    """
    records = [(rec, t.cpu().clone()) for rec, t in first_replica_shards(chunks, dims)]
    gathered = [None] * dist.get_world_size() if dist.get_rank() == dst else None
    dist.gather_object(records, gathered, dst=dst)
    if dist.get_rank() != dst:
        return None
    return to_hf((r for recs in gathered for r in recs), dims)
