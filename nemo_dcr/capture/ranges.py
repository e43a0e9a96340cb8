"""Which flat slice of each local param this rank captures.

Several ranks hold bit-identical copies of a param: data-parallel replicas (all params),
tensor-parallel replicas (norms, the router), expert-data-parallel replicas (experts).  Each
copy-group splits the param's flat range so every element is captured by exactly one rank and
the work is spread over every rank.

Two sources of ranges:

* Megatron's distributed optimizer (``DistributedDataParallel`` with
  ``use_distributed_optimizer=True``): each DP rank owns a contiguous slice of every bucket of
  the flat param buffer; :func:`nemo_dcr.integrations.megatron.ddp.ranges_from_ddp` intersects
  each param's ``param_index_map`` interval with that slice.  Those ranks update exactly that
  slice, so capture reads params they wrote themselves, before the param all-gather.
* Without it (CPU tests, plain DDP), :func:`split_range` splits each param evenly and
  deterministically by the rank's index in its copy-group.
"""

from __future__ import annotations


def split_range(numel: int, index: int, count: int) -> tuple[int, int]:
    """The ``index``-th of ``count`` near-equal contiguous slices of ``[0, numel)``.

    The first ``numel % count`` slices are one element longer.  Slices of all indices tile
    ``[0, numel)`` exactly, in order.
    """
    if not 0 <= index < count:
        raise ValueError(f"index {index} out of range for count {count}")
    base, extra = divmod(numel, count)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def intersect(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    """Intersection of two half-open intervals (empty intervals come back as (x, x))."""
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, max(lo, hi))
