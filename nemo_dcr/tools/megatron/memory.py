"""Track the largest tensor allocated by torch ops inside a block (views are not counted).

Python/numpy memory is not tracked here: ``tracemalloc`` started or stopped while gloo's threads
release tensors crashes CPython 3.11 (seen as a SIGSEGV in gloo's run loop), so host memory per
refit is measured in the benchmarks instead."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class AllocationTracker(TorchDispatchMode):
    """Records ``max_bytes``: bytes of the largest *new* storage any op produced.

    Outputs sharing storage with an input (views, in-place ops) are not allocations.
    Re-enterable: the maximum accumulates over every ``with`` block.
    """

    def __init__(self):
        super().__init__()
        self.max_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.max_bytes = max(self.max_bytes, t.untyped_storage().nbytes())
        return out
