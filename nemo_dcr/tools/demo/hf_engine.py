"""The demo's transformers engine, colocated or in a process of its own: how it is built from the
HF folder the starting rank wrote, and how it is compared with an independent dense export.

With ``engine.weights: fp8`` the engine holds the linear layers in FP8
(:class:`~nemo_dcr.integrations.hf.engine.HFEngine` with the plan of ``dcr``), and the comparison
checks its FP8 bytes and scales against an independent re-quantization of the dense export
(:func:`nemo_dcr.verify.fp8_reference.fp8_mismatches`), not against the code under test.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from nemo_dcr.types import host_bits, int_view


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
    return HFEngine(model, torch.bfloat16, key=key, fp8_plan=plan, keep_index=dcr.engine_index)


def load_and_compare(engine, dense: dict[str, torch.Tensor]) -> tuple[float, float, bool]:
    """Load ``dense`` into scratch tensors as the engine would (the last hop of a dense refit; an
    FP8 engine quantizes it), then compare the engine's live tensors with the dense export bit for
    bit: directly, or for an FP8 engine against an independent re-quantization of it.

    Returns:
        ``(seconds of the load, seconds of the comparison, same)``.
    """
    plan, live = engine.fp8_plan, engine.tensors
    t0 = time.perf_counter()
    held = dense if plan is None else plan.quantize_model(dense)[0]
    for name, t in held.items():
        torch.empty_like(live[name]).copy_(t)
    t1 = time.perf_counter()
    if plan is None:
        same = set(dense) == set(live) and all(torch.equal(int_view(live[n]), int_view(t)) for n, t in dense.items())
    else:
        from nemo_dcr.verify.fp8_reference import fp8_mismatches

        fp8 = {n: (plan.scheme.block_for(s), plan.scale_names[n]) for n, s in plan.fp8.items()}
        bits = {n: host_bits(t.contiguous()).reshape(tuple(t.shape)) for n, t in live.items()}
        same = not fp8_mismatches(bits, {n: host_bits(t.contiguous()).reshape(tuple(t.shape))
                                         for n, t in dense.items()}, fp8)
    return t1 - t0, time.perf_counter() - t1, same
