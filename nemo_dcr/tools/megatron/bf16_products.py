"""bf16 matrix products on a CPU without native bf16 arithmetic, computed in fp32.

On an AVX2-only CPU, torch's bf16 ``mm``/``bmm`` kernels emulate bf16 and run about 50x slower
than fp32 (measured on an AMD EPYC: 1.2 against 67 GFLOP/s for one 440x576 @ 576x1536 product on
one core).  :func:`bf16_products_in_fp32` computes each bf16 matrix product of its block in fp32
and rounds the result to bf16 (round to nearest even), the arithmetic a GPU's bf16 tensor-core
GEMM does (fp32 accumulation, bf16 output); only the order of the sums can differ.  Parameters,
activations and gradients stay bf16, so the weights a step produces are still bf16 values.  The
mode works below autograd (a dispatch mode), so the backward's products take the same path.  On a
CPU with native bf16 (AVX512-BF16 or AMX) and on GPUs the block runs unchanged.

Used by the demo's and the checks' CPU training and by the transformers engine's sampling.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
_PRODUCTS = frozenset({_aten.mm.default, _aten.bmm.default, _aten.addmm.default, _aten.baddbmm.default})


def _native_bf16_cpu() -> bool:
    cpu = torch.cpu
    return any(getattr(cpu, name, lambda: False)() for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))


class _Fp32Products(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _PRODUCTS and args[0].dtype == torch.bfloat16 and args[0].is_cpu:
            up = [a.float() if isinstance(a, torch.Tensor) else a for a in args]
            return func(*up, **kwargs).to(torch.bfloat16)
        return func(*args, **kwargs)


def bf16_products_in_fp32(device: torch.device | str) -> contextlib.AbstractContextManager:
    """A context in which bf16 matrix products on ``device`` are computed in fp32 and rounded to
    bf16, where ``device`` is a CPU without native bf16; elsewhere a context that does nothing."""
    if torch.device(device).type != "cpu" or _native_bf16_cpu():
        return contextlib.nullcontext()
    return _Fp32Products()
