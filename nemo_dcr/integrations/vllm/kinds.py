"""What vLLM does to its params after loading, and whether a refit can follow it.

The probe (:mod:`nemo_dcr.apply.probe`) sees what ``load_weights`` does; this module looks at
what happens *after* it, in vLLM's post-load processing, and refines each param's kind:

* **views** of a placed param (MLA's ``W_UV`` / ``W_UK_T`` are views of ``kv_b_proj.weight``
  when it is unquantized and already in the activation dtype; Mamba's ``conv_weights`` buffer is
  a view of ``conv1d.weight``) are in place with it;
* **kernel backends** (``quant_method`` of each module holding placed params): unquantized
  linear layers keep their weight (on CPU because :mod:`.cpu` keeps them unpacked); fused MoE
  experts are in place on the ``TRITON`` / ``BATCHED_TRITON`` backends, *rearranged* with a known
  shuffle on ``CPU`` (prepacked; refits write the loader-layout copy and repack the touched
  experts, :class:`~.cpu.PackedExperts`), and refused on backends that shuffle them
  (FlashInfer TRTLLM / CUTLASS ``w13 -> w31``, ROCm AITER, XPU, MoonEP): the refusal names the
  backend; any other quant method (FP8, MXFP4, AWQ, ...) is refused;
* **derived** params and buffers: for each module vLLM post-processes after loading (attention
  layers' ``process_weights_after_loading``), unwritten tensors that change when the module's
  placed inputs change are derived: found by running the step once on sign-flipped inputs and
  once on the restored ones (which must reproduce the tensors bit for bit, else the module is
  refused); a refit re-runs the step for the layers whose inputs it touched;
* **engine features** that move weights behind the placement: EPLB (experts move between ranks
  at run time) and speculative decoding with a drafter (MTP layers, Eagle heads: loaded by a
  model of their own, which the main model's ``load_weights`` skips without a log line) are
  refused; n-gram speculation has no weights and is fine.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from nemo_dcr.apply.probe import Kind, ParamTruth, Probe
from nemo_dcr.types import int_view

IN_PLACE_METHODS = ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod")
"""Quant methods that keep loaded weights as they are (on CPU because :mod:`.cpu` keeps them unpacked)."""

IN_PLACE_MOE_BACKENDS = ("TRITON", "BATCHED_TRITON")
"""Unquantized fused-MoE backends that keep the loader layout (no post-load shuffle)."""

PACKED_MOE_BACKENDS = ("CPU",)
"""Unquantized fused-MoE backends whose shuffle refits follow (:class:`~.cpu.PackedExperts`)."""


@dataclass(frozen=True)
class DerivedGroup:
    """A module whose post-load step derives ``outputs`` from its placed ``inputs``.

    Attributes:
        module: module name (its ``process_weights_after_loading(dtype)`` is the step).
        inputs: placed params the step reads.
        outputs: params / buffers (``buffer:<name>``) it writes.
    """

    module: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


def live_views(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Params and buffers (``buffer:<name>``) by name, buffers of every module included."""
    out = {n: p.data for n, p in model.named_parameters()}
    out.update({f"buffer:{n}": b for n, b in model.named_buffers()})
    return out


def _inside(t: torch.Tensor, base: torch.Tensor) -> bool:
    """Whether ``t``'s elements live inside ``base``'s storage range."""
    if t.device != base.device or not t.numel() or not base.numel():
        return False
    s, b = t.untyped_storage(), base.untyped_storage()
    if s.data_ptr() != b.data_ptr():
        return False
    return base.storage_offset() <= t.storage_offset() < base.storage_offset() + base.numel()


def mark_views(model: torch.nn.Module, probe: Probe) -> None:
    """Unwritten params and buffers that are views of a placed param: in place with it."""
    tensors = live_views(model)
    placed = {n: tensors[n] for n, t in probe.params.items() if t.kind == Kind.IN_PLACE}
    for name, t in tensors.items():
        truth = probe.params.get(name)
        if truth is not None and truth.kind != Kind.UNWRITTEN:
            continue
        base = next((b for b, bt in placed.items() if b != name and _inside(t, bt)), None)
        if base is not None:
            probe.params[name] = ParamTruth(name, Kind.IN_PLACE, probe.params[base].sources, f"a view of {base}")
        elif truth is None:
            probe.params[name] = ParamTruth(name, Kind.UNWRITTEN, (), "not written by a refit")


def _names(model: torch.nn.Module, module: torch.nn.Module, recurse: bool = True, buffers: bool = True) -> list[str]:
    """Model-level names of ``module``'s params (and buffers) (a tensor two modules share, e.g. an
    expert bias, has the name ``named_parameters`` keeps)."""
    kept = {id(p): n for n, p in model.named_parameters()}
    kept.update({id(b): f"buffer:{n}" for n, b in model.named_buffers()})
    tensors = [p for _, p in module.named_parameters(recurse=recurse)]
    tensors += [b for _, b in module.named_buffers(recurse=recurse)] if buffers else []
    return list(dict.fromkeys(kept[id(t)] for t in tensors if id(t) in kept))


def check_backends(model: torch.nn.Module, probe: Probe, packed: set[str]) -> None:
    """Refine or refuse the params of every module whose kernel backend post-processes them."""
    for prefix, module in model.named_modules():
        qm = getattr(module, "quant_method", None)
        if qm is None:
            continue
        cls = type(qm).__name__
        mine = [p for p in _names(model, module, False, False) if p in probe.params and probe.params[p].sources]
        if cls in IN_PLACE_METHODS or cls.endswith("KVCacheMethod"):
            continue
        if not mine and cls != "UnquantizedFusedMoEMethod":  # e.g. a quantized layer load_weights cannot reach
            probe.refusals.setdefault(prefix, f"quantized by {cls}: only unquantized weights are refit in place")
            continue
        if cls == "UnquantizedFusedMoEMethod":
            backend = getattr(getattr(qm, "unquantized_backend", None), "name", "?")
            for p in mine:
                _moe_kind(probe, p, backend, p in packed)
            continue
        for p in mine:
            probe.params[p] = replace(probe.params[p], refused=f"quantized by {cls}: only unquantized weights "
                                                              "are refit in place")


def _moe_kind(probe: Probe, p: str, backend: str, packed: bool) -> None:
    truth = probe.params[p]
    if backend in IN_PLACE_MOE_BACKENDS:
        return
    if backend in PACKED_MOE_BACKENDS:
        if packed:
            probe.params[p] = replace(truth, kind=Kind.REARRANGED, how="written in the loader layout, touched experts "
                                      "repacked with vLLM's cpu_prepack_moe_weight and read back")
        return  # the CPU kernel packs the expert weights only (biases stay as loaded)
    probe.params[p] = replace(truth, kind=Kind.REARRANGED,
                              refused=f"the {backend} fused-MoE backend rearranges expert weights after load; "
                                      f"in-place refits need one of {list(IN_PLACE_MOE_BACKENDS)} (moe_backend=triton)")


def find_derived(model: torch.nn.Module, probe: Probe, steps: dict[str, object]) -> list[DerivedGroup]:
    """Derived tensors of every module in ``steps`` (module name -> its post-load step, a
    callable), found by perturbing the module's placed inputs; refuses a step that does not
    reproduce its outputs.  Live weights end bit-identical."""
    groups = []
    for prefix, step in steps.items():
        names = _names(model, model.get_submodule(prefix) if prefix else model)
        inputs = [n for n in names if probe.params[n].kind == Kind.IN_PLACE and not probe.params[n].how.startswith("a view")]
        outputs = [n for n in names if probe.params[n].kind == Kind.UNWRITTEN]
        if not inputs or not outputs:
            continue
        derived, reproducible = _perturb(model, step, inputs, outputs)
        if not reproducible:
            for n in outputs:
                probe.params[n] = replace(probe.params[n], refused=f"{prefix}'s post-load step does not reproduce it")
            continue
        if derived:
            sources = tuple(sorted({s for n in inputs for s in probe.params[n].sources}))
            for n in derived:
                probe.params[n] = ParamTruth(n, Kind.DERIVED, sources, f"re-derived by {prefix}'s post-load step")
            groups.append(DerivedGroup(prefix, tuple(inputs), tuple(derived)))
    return groups


def _perturb(model: torch.nn.Module, step, inputs: list[str], outputs: list[str]) -> tuple[list[str], bool]:
    """Run ``step`` on sign-flipped ``inputs``, then on the restored ones; returns the outputs that
    changed and whether the second run reproduced every output bit for bit."""
    def read(n: str) -> torch.Tensor:
        return live_views(model)[n]

    saved_in = {n: read(n).clone() for n in inputs}
    saved_out = {n: read(n).clone() for n in outputs}
    try:
        with torch.no_grad():
            for n in inputs:
                flat = int_view(read(n))
                flat.copy_(flat ^ torch.tensor(-(1 << (8 * read(n).element_size() - 1)), dtype=flat.dtype))
            step()
            changed = [n for n in outputs if not torch.equal(int_view(read(n)), int_view(saved_out[n]))]
            for n in inputs:
                read(n).copy_(saved_in[n])
            step()
            same = all(torch.equal(int_view(read(n)), int_view(saved_out[n])) for n in outputs)
    finally:
        with torch.no_grad():
            for n, t in {**saved_in, **saved_out}.items():
                read(n).copy_(t)
    return changed, same


def check_engine_features(vllm_config) -> dict[str, str]:
    """Engine features that move weights behind a probed placement (what -> why)."""
    out = {}
    if getattr(vllm_config.parallel_config, "enable_eplb", False):
        out["parallel_config.enable_eplb"] = ("EPLB moves experts between ranks at run time, after the placement "
                                              "was probed")
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is not None and getattr(spec, "draft_model_config", None) is not None:
        out["speculative_config"] = (f"speculative decoding with a drafter ({spec.method}): its weights (MTP "
                                     "layers, an Eagle head) are loaded by a model of its own that refits do not reach")
    return out


def refusals(probe: Probe) -> dict[str, str]:
    """Everything the probe and the checks refused: what -> why."""
    out = dict(probe.refusals)
    out.update({n: t.refused for n, t in probe.params.items() if t.refused})
    return out
