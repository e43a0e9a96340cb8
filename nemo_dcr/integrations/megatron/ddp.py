"""Capture ranges from megatron-core's distributed-optimizer buffers (GPU training path).

With ``DistributedDataParallel(..., use_distributed_optimizer=True)`` every param lives in a
flat ``_ParamAndGradBuffer`` (``ddp.buffers`` for dense params, ``ddp.expert_parallel_buffers``
for routed experts).  ``buffer.param_index_map[param] = (start, end, bucket_id)`` locates the
param in the buffer; each bucket (``buffer.buckets[i]``, at ``bucket.offset``, padded so its
``grad_data.numel()`` divides by the DP size) is split into ``dp`` equal contiguous shards and
DP rank ``r`` owns ``[offset + r * shard, offset + (r + 1) * shard)`` -- the same arithmetic as
``DistributedOptimizer._build_model_gbuf_range`` in megatron-core 0.16.  The DP rank updates
exactly that slice, so capturing it reads values it wrote itself, before the param
all-gather (immune to ``overlap_param_gather`` staleness).

Megatron's DDP builds its buffers on CPU too (with the CPU shim of :mod:`.build`), so the
distributed tests exercise this path at DP=2 on gloo.
"""

from __future__ import annotations

from nemo_dcr.capture.ranges import intersect, split_range


def ranges_from_ddp(ddp, names: dict) -> dict[str, tuple[int, int]]:
    """Local flat (start, stop) of each param owned by this DP rank.

    Args:
        ddp: megatron ``DistributedDataParallel`` built with the distributed optimizer.
        names: param object -> local name.

    Returns:
        name -> range in the param's own flat index space (possibly empty).  TP-replicated
        params (norms, router) are further split over the TP group inside the DP slice, so
        each element is captured once model-wide.
    """
    from megatron.core import parallel_state as ps

    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    out = {}
    for buffer in list(ddp.buffers) + list(getattr(ddp, "expert_parallel_buffers", [])):
        group = buffer.data_parallel_group
        rank, size = group.rank(), group.size()
        for bucket in buffer.buckets:
            shard = bucket.grad_data.numel() // size
            owned = (bucket.offset + rank * shard, bucket.offset + (rank + 1) * shard)
            for param in bucket.params_list:
                start, end, _ = buffer.param_index_map[param]
                lo, hi = intersect((start, end), owned)
                lo, hi = (lo - start, hi - start) if hi > lo else (0, 0)
                if not getattr(param, "tensor_model_parallel", False) and tp > 1:
                    a, b = split_range(hi - lo, tp_rank, tp)
                    lo, hi = lo + a, lo + b
                out[names[param]] = (lo, hi)
    return out
