"""Rank-aware helpers over a built GPTModel: global names, replicas, capture ranges.

``chunks`` is this rank's list of model chunks (one per virtual pipeline stage), as
returned by :func:`nemo_dcr.tools.megatron.build.build_gpt_model`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from nemo_dcr.capture.ranges import split_range
from nemo_dcr.integrations.megatron.topology import rank_coords, tp_placement
from nemo_dcr.layout import ModelDims

_LOCAL_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_LOCAL_EXPERT = re.compile(r"local_experts\.(\d+)\.")


@dataclass(frozen=True)
class LocalParam:
    """One parameter of this rank.

    Attributes:
        chunk: virtual pipeline chunk index.
        name: megatron-local name (``named_parameters()`` of the chunk).
        global_name: model-wide name (global layer and expert numbers).
        param: the live tensor.
        expert: routed-expert param (split over EP/ETP, replicated over expert-DP).
    """

    chunk: int
    name: str
    global_name: str
    param: torch.Tensor
    expert: bool

    @property
    def key(self) -> str:
        """Name unique over this rank's chunks (capture, baseline and range key).

        ``name`` on chunk 0 (so single-chunk callers see plain names), ``model{c}.name`` on
        virtual-pipeline chunk ``c > 0`` (local names repeat across chunks).
        """
        return self.name if self.chunk == 0 else f"model{self.chunk}.{self.name}"


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside wrappers (``DistributedDataParallel``, ``Float16Module``: ``.module``)."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def local_params(chunks: list[torch.nn.Module], dims: ModelDims) -> list[LocalParam]:
    """Every parameter of this rank with its global megatron name (wrapped chunks are unwrapped)."""
    coords = rank_coords()
    per_rank = dims.num_experts // coords["ep"] if dims.num_experts else 0
    out = []
    for c, model in enumerate(unwrap(m) for m in chunks):
        for name, p in model.named_parameters():
            gname = name
            m = _LOCAL_LAYER.match(name)
            if m is not None:
                layer = model.decoder.layers[int(m.group(1))].layer_number - 1
                gname = f"decoder.layers.{layer}." + name[m.end():]
            expert = getattr(p, "allreduce", True) is False
            if expert:
                gname = _LOCAL_EXPERT.sub(
                    lambda e: f"local_experts.{coords['ep_rank'] * per_rank + int(e.group(1))}.",
                    gname)
            out.append(LocalParam(c, name, gname, p, expert))
    return out


def replica_group(lp: LocalParam, coords: Mapping[str, int]) -> tuple[int, int]:
    """(index, count) of this rank among the ranks holding bit-identical copies of ``lp``.

    Dense params are replicated over DP, and additionally over TP when not TP-sharded
    (norms, router).  Routed experts are replicated over expert-DP (and expert-TP when not
    sharded).
    """
    size, rank, dim = tp_placement(lp.param, coords)
    if lp.expert:
        idx, count = coords["edp_rank"], coords["edp"]
    else:
        idx, count = coords["dp_rank"], coords["dp"]
    if dim is None and size > 1:
        idx, count = idx * size + rank, count * size
    return idx, count


def capture_ranges(params: list[LocalParam], skip: set[str] = frozenset()
                   ) -> dict[str, tuple[int, int]]:
    """Flat (start, stop) slice of each local param this rank captures (no DDP buffers).

    Args:
        params: from :func:`local_params`.
        skip: keys (:attr:`LocalParam.key`) captured by nobody (e.g. the tied output-layer
            copy).

    Returns:
        ``{LocalParam.key: (start, stop)}``.
    """
    coords = rank_coords()
    out = {}
    for lp in params:
        if lp.key in skip:
            out[lp.key] = (0, 0)
            continue
        idx, count = replica_group(lp, coords)
        out[lp.key] = split_range(lp.param.numel(), idx, count)
    return out
