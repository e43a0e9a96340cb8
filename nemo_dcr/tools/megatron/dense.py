"""Dense HF <-> megatron copies over a built GPTModel (scaffolding and the independent reference).

* :func:`load_hf`: copy HF weights into this rank's shards (the demo and tests start from them);
* :func:`dense_export`: gather every shard to one rank and convert to HF tensors, the dense reference
  that tests, check-layout and the demo compare the engine with (never on the refit path).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping

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


@torch.no_grad()
def dense_export(chunks: list[torch.nn.Module], dims: ModelDims,
                 dst: int = 0) -> dict[str, torch.Tensor] | None:
    """Gather every shard to rank ``dst`` and convert to HF tensors (the dense reference).

    Only the first replica of each shard sends.  Returns the HF state dict on ``dst`` and
    None elsewhere.  Collective: every rank must call it.
    """
    coords = rank_coords()
    records = []
    for lp in local_params(chunks, dims):
        if dims.tie_word_embeddings and lp.global_name == "output_layer.weight":
            continue
        idx, _ = replica_group(lp, coords)
        if idx:
            continue
        size, rank, dim = tp_placement(lp.param, coords)
        records.append((lp.global_name, rank, dim, lp.param.detach().cpu().clone()))
    gathered = [None] * dist.get_world_size() if dist.get_rank() == dst else None
    dist.gather_object(records, gathered, dst=dst)
    if dist.get_rank() != dst:
        return None
    shards = defaultdict(dict)
    split_dim = {}
    for recs in gathered:
        for gname, rank, dim, t in recs:
            shards[gname][rank] = t
            split_dim[gname] = dim
    out = {}
    for gname, by_rank in shards.items():
        full = merge_shards(gname, [by_rank[r] for r in sorted(by_rank)], split_dim[gname])
        out.update(megatron_to_hf(gname, full, dims))
    return out
