"""This rank's place in the Megatron-Core parallel groups: sizes, coordinates, how a param is split.

Read from ``megatron.core.parallel_state`` after ``initialize_model_parallel`` (the product path:
:mod:`nemo_dcr.integrations.megatron.source` and :mod:`.params` use it on every trainer rank).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from nemo_dcr.layout import ParallelLayout


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


def parallel_layout_from_state(num_layers_in_first_pipeline_stage: int | None = None,
                               num_layers_in_last_pipeline_stage: int | None = None):
    """This rank's :class:`~nemo_dcr.layout.ParallelLayout` from ``parallel_state``.

    Reads the initialized megatron groups (call after ``initialize_model_parallel``); the
    uneven-pipeline knobs are not part of ``parallel_state``: pass the values the model was
    built with (None: even split).
    """
    c = rank_coords()
    return ParallelLayout(
        tp=c["tp"], pp=c["pp"], vpp=c["vpp"], ep=c["ep"], etp=c["etp"], dp=c["dp"],
        tp_rank=c["tp_rank"], pp_rank=c["pp_rank"], ep_rank=c["ep_rank"],
        etp_rank=c["etp_rank"], dp_rank=c["dp_rank"],
        num_layers_in_first_pipeline_stage=num_layers_in_first_pipeline_stage,
        num_layers_in_last_pipeline_stage=num_layers_in_last_pipeline_stage,
    )


def tp_placement(param: torch.Tensor, coords: Mapping[str, int]) -> tuple[int, int, int | None]:
    """(tp size, tp rank, partition dim or None) of a megatron param.

    Routed-expert params (megatron marks them ``allreduce=False``) are split over the
    expert-tensor-parallel group, all others over the tensor-parallel group.
    """
    expert = getattr(param, "allreduce", True) is False
    size, rank = (coords["etp"], coords["etp_rank"]) if expert else (coords["tp"], coords["tp_rank"])
    dim = param.partition_dim if getattr(param, "tensor_model_parallel", False) else None
    return size, rank, dim
