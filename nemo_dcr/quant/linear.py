"""A weight-only FP8 linear layer for engines without FP8 kernels (a transformers model on CPU).

:class:`Fp8Linear` holds exactly the FP8 engine tensors, as buffers named like vLLM's
parameters (``weight``: ``float8_e4m3fn``, ``weight_scale_inv``: fp32 block scales), so a model's
``state_dict()`` shows the names and dtypes the FP8 refit writes into. Its forward runs a BF16
matmul on ``dequantize(weight, weight_scale_inv)`` (W8A16 simulation: the weights are the FP8
ones bit for bit, activations are not quantized as vLLM's FP8 GEMM would). The dequantized copy
is cached; the refit writes through integer views torch cannot see, so whoever applies a
payload calls :meth:`Fp8Linear.refresh` on the touched layers (``to_fp8_linears`` returns them).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn
from torch.nn import functional as F

from nemo_dcr.quant.fp8 import Fp8Error, Fp8Scheme, check_scale_shape, dequantize


class Fp8Linear(nn.Module):
    """``y = x @ dequantize(weight, weight_scale_inv).T + bias`` with FP8 weight storage.

    Args:
        weight: ``float8_e4m3fn`` ``(out, in)``.
        scale: fp32 block scales (the scheme's grid).
        bias: optional bias (kept in its dtype).
        scheme: the quantization scheme of ``scale``.
        dtype: compute dtype of the dequantized weight.
    """

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                 scheme: Fp8Scheme = Fp8Scheme(), dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        if weight.dtype != torch.float8_e4m3fn or scale.dtype != torch.float32:
            raise Fp8Error(f"Fp8Linear needs float8_e4m3fn weight and fp32 scales, got {weight.dtype} / {scale.dtype}")
        check_scale_shape(weight.shape, scale.shape, scheme)
        self.scheme, self.dtype = scheme, dtype
        self.register_buffer("weight", weight)
        self.register_buffer(scheme.scale_suffix, scale)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self._dequantized: torch.Tensor | None = None

    @property
    def scale(self) -> torch.Tensor:
        return getattr(self, self.scheme.scale_suffix)

    def refresh(self) -> None:
        """Drop the cached dequantized weight (call after FP8 bytes or scales were written)."""
        self._dequantized = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._dequantized is None:
            self._dequantized = dequantize(self.weight, self.scale, self.scheme, self.dtype)
        return F.linear(x, self._dequantized.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))


def to_fp8_linears(model: nn.Module, plan, engine: Mapping[str, torch.Tensor]) -> dict[str, Fp8Linear]:
    """Replace every ``nn.Linear`` whose ``<prefix>.weight`` the plan holds in FP8, in place.

    Args:
        model: the engine model (canonical parameter names).
        plan: its :class:`~nemo_dcr.quant.fp8_plan.Fp8Plan`.
        engine: FP8 weights and scales by name (``plan.quantize_model``); the new modules use
            these tensors themselves (no copy), so writes into them reach the model.

    Returns:
        ``{weight name: module}`` of the replaced layers.
    """
    replaced = {}
    for prefix, module in list(model.named_modules()):
        name = f"{prefix}.weight"
        if name not in plan.fp8:
            continue
        if not isinstance(module, nn.Linear):
            raise Fp8Error(f"{name}: planned as FP8 but {prefix} is a {type(module).__name__}, not nn.Linear")
        bias = None if module.bias is None else module.bias.detach()
        new = Fp8Linear(engine[name], engine[plan.scale_names[name]], bias, plan.scheme, module.weight.dtype)
        parent, _, child = prefix.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
        replaced[name] = new
    missing = sorted(set(plan.fp8) - set(replaced))
    if missing:
        raise Fp8Error(f"{len(missing)} planned FP8 weights have no nn.Linear in the model, e.g. {missing[:3]}")
    return replaced
