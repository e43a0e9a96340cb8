"""The demo's transformers engine, colocated or in a process of its own: how it is built from the
HF folder the starting rank wrote, and how an FP8 engine is compared with the dense tensors.

With ``engine.weights: fp8`` the engine holds the linear layers in FP8
(:class:`~nemo_dcr.integrations.hf.engine.HFEngine` with the plan of ``dcr``), and the comparison
checks its FP8 bytes and scales against an independent re-quantization of the dense export
(:func:`nemo_dcr.verify.fp8_reference.fp8_mismatches`), not against the code under test.
"""

from __future__ import annotations

from pathlib import Path

import torch

from nemo_dcr.kernels.traffic import host_bits


def build_hf_engine(hf_dir: Path, key: bytes | None, dcr):
    """The transformers engine of the HF folder ``hf_dir``, in the engine format of ``dcr``
    (``fp8``: the plan is built from the model's names and shapes, like the trainer's)."""
    from transformers import AutoModelForCausalLM

    from nemo_dcr.integrations.hf.engine import HFEngine

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    plan = None
    if dcr.engine_format == "fp8":
        from nemo_dcr.refit.fp8_mirror import fp8_plan

        plan = fp8_plan(dcr, {n: tuple(p.shape) for n, p in model.named_parameters()})
    return HFEngine(model, torch.bfloat16, key=key, fp8_plan=plan, keep_index=dcr.engine_index, threads=dcr.threads)


def fp8_same(engine, dense: dict[str, torch.Tensor]) -> bool:
    """An FP8 engine's live FP8 bytes, scales and kept BF16 tensors against an independent
    re-quantization of the dense tensors (:func:`nemo_dcr.verify.fp8_reference.fp8_mismatches`),
    not against the quantizer under test."""
    from nemo_dcr.verify.fp8_reference import fp8_mismatches

    plan = engine.fp8_plan
    fp8 = {n: (plan.scheme.block_for(s), plan.scale_names[n]) for n, s in plan.fp8.items()}
    bits = {n: host_bits(t.contiguous()).reshape(tuple(t.shape)) for n, t in engine.tensors.items()}
    return not fp8_mismatches(bits, {n: host_bits(t.contiguous()).reshape(tuple(t.shape))
                                     for n, t in dense.items()}, fp8)
