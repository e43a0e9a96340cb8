"""vLLM worker extension: nemo_dcr payloads applied in place into vLLM's fused, TP-sharded params.

Attached with ``vllm.LLM(..., worker_extension_cls=WORKER_EXTENSION)`` (from
:mod:`nemo_dcr.integrations.vllm`); vLLM mixes
:class:`DcrWorkerExtension` into its worker class in every worker process and the driver calls
the ``dcr_*`` methods through ``collective_rpc`` (:class:`~nemo_dcr.integrations.vllm.engine.VllmEngine`
does it for you).  Importing this module installs the CPU patches of
:mod:`nemo_dcr.integrations.vllm.cpu` (on the CPU platform only), which must happen before the
model loads; vLLM imports the extension class before it builds the model.

* ``dcr_probe`` derives the placement, and every param's kind, from vLLM's own ``load_weights``
  (:mod:`nemo_dcr.apply.probe`; docs/engines.md, "Engine truth") and what vLLM does after
  loading (:mod:`.kinds`); live weights are untouched.  It reports what cannot be refit, so the
  driver refuses the engine before the first sync.
* ``dcr_attach`` builds this rank's :class:`~nemo_dcr.apply.TensorEngine` over the live params,
  the shadows of transformed tensors and its placement (with the constants the loaders write, so a
  resync ends as a fresh load does), and the after-write steps (:class:`~.refresh.Refresh`).
* ``dcr_prepare`` / ``dcr_commit`` / ``dcr_rollback`` apply one version as a transaction that
  spans all TP ranks (:meth:`nemo_dcr.apply.TensorEngine.prepare`): every rank writes and
  verifies, keeps its undo log, and commits only when the driver heard that all ranks verified.
* After the views are written: transformed tensors are reloaded through the engine's loader,
  derived tensors re-derived (:mod:`.refresh`), prepacked CPU MoE experts repacked and read back
  (:class:`~nemo_dcr.integrations.vllm.cpu.PackedExperts`).
* ``dcr_preflight`` compares everything the rank holds with vLLM's own in-place reload of the
  canonical tensors it holds (:mod:`.preflight`).

Payload parts reach a rank as bytes, or as paths of files holding one part each (vLLM's
multiprocess executor broadcasts ``collective_rpc`` arguments to every rank, so a rank reads
only the files named for it).  Unquantized weights only (quantized layers are refused).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import torch

from nemo_dcr.apply import ApplyResult, ApplyVerificationError, EngineChecksums, TensorEngine
from nemo_dcr.apply.placement import placement_from_json, placement_to_json
from nemo_dcr.apply.probe import SHADOW, Probe, probe_engine
from nemo_dcr.verify.sample import Sample

from . import cpu, kinds, preflight
from .refresh import Refresh

ON_CPU = cpu.install()
"""Whether the CPU patches are active in this process (vLLM's CPU platform)."""

Part = bytes | str
"""A payload part, or the path of a file holding one."""


def _default_loader():
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    return default_weight_loader


def get_loader(param):
    """The loader vLLM would call for ``param``."""
    return getattr(param, "weight_loader", None) or _default_loader()


def set_loader(param, fn):
    """Install ``fn`` as ``param``'s loader; returns the previous one.

    vLLM's parameter classes expose ``weight_loader`` as a read-only property over
    ``_weight_loader``; plain params carry it as an attribute.
    """
    old = get_loader(param)
    if isinstance(getattr(type(param), "weight_loader", None), property):
        param._weight_loader = fn
    else:
        param.weight_loader = fn
    return old


def read_parts(parts: Sequence[Part]) -> list[bytes]:
    """Payload bytes of ``parts`` (files are read; bytes pass as they are)."""
    return [Path(p).read_bytes() if isinstance(p, str) else bytes(p) for p in parts]


def aliases(model: torch.nn.Module) -> dict[str, str]:
    """Param names that are another name of the same tensor (a tied ``lm_head``) -> the name
    ``named_parameters()`` keeps; a write into the kept one is what the alias reads."""
    kept = {id(p): n for n, p in model.named_parameters()}
    return {n: kept[id(p)] for n, p in model.named_parameters(remove_duplicate=False) if kept[id(p)] != n}


def post_load_steps(model: torch.nn.Module, vllm_config) -> dict:
    """Module name -> its post-load step, for the modules vLLM post-processes after loading
    themselves (attention layers); none without vLLM (a stand-in worker)."""
    if vllm_config is None:
        return {}
    from vllm.model_executor.layers.attention import is_deferred_attention_layer

    dtype = vllm_config.model_config.dtype
    return {n: (lambda m=m: m.process_weights_after_loading(dtype))
            for n, m in model.named_modules() if is_deferred_attention_layer(m)}


def probe_vllm(model: torch.nn.Module, shapes: Mapping[str, Sequence[int]], dtypes: Mapping[str, torch.dtype],
               vllm_config=None, device: str | None = None, steps: Mapping | None = None
               ) -> tuple[Probe, list, dict[str, str]]:
    """Probe a vLLM model's loaders and classify every param (:mod:`nemo_dcr.apply.probe`, :mod:`.kinds`).

    Args:
        model, shapes, dtypes: the model and the canonical tensors' shapes and dtypes.
        vllm_config: the engine's config (None: a stand-in without one).
        device: where probe buffers live (default: each param's device).
        steps: the post-load steps (default: :func:`post_load_steps`).

    Returns:
        ``(probe, derived groups, refused)``: the probe (kinds refined), the layers whose
        post-load step derives tensors, and what cannot be refit (what -> why).
    """
    probe = probe_engine(model, shapes, set_loader, dtypes, device)
    kinds.mark_views(model, probe)
    kinds.check_backends(model, probe, set(cpu.PackedExperts.find(model)))
    derived = kinds.find_derived(model, probe, post_load_steps(model, vllm_config) if steps is None else steps)
    refused = kinds.refusals(probe)
    if vllm_config is not None:
        refused.update(kinds.check_engine_features(vllm_config))
    return probe, derived, refused


def _result_json(r: ApplyResult) -> dict:
    return dict(base=r.base_version, target=r.target_version, touched=r.touched, resync=r.resync,
                undo_bytes=r.undo_bytes)


def _checksums_json(c: EngineChecksums) -> dict:
    """This rank's canonical partial sums and its (one shard's) view checksums."""
    return dict(checksums=c.canonical, views=c.views.get(0, {}))


class DcrWorkerExtension:
    """Mixed into vLLM's worker by ``worker_extension_cls``; methods run via ``collective_rpc``."""

    def _dcr_model(self) -> torch.nn.Module:
        return self.model_runner.model

    def dcr_probe(self, shapes: Mapping[str, Sequence[int]], dtypes: Mapping[str, str] | None = None) -> dict:
        """This rank's placement of every canonical tensor and the kind of every param (JSON).

        Args:
            shapes: canonical name -> shape.
            dtypes: canonical name -> torch dtype name (``"bfloat16"``; default bf16).

        Returns:
            ``placement`` (JSON form, primary not yet assigned), ``params`` (engine param or
            buffer -> ``kind``, ``sources``, ``how``, ``refused``), ``skipped`` and ``refused``
            (what -> why), ``stats`` (the probe's cost), ``aliases`` (see :func:`aliases`),
            ``packed`` (params the CPU kernel prepacks) and ``shapes`` (param -> shape).
        """
        model = self._dcr_model()
        torch_dtypes = {n: getattr(torch, d) for n, d in (dtypes or {}).items()}
        probe, self.dcr_derived, refused = probe_vllm(model, shapes, torch_dtypes, getattr(self, "vllm_config", None),
                                                      steps=self._dcr_steps())
        self.dcr_fills, self.dcr_reload, self.dcr_dtypes = probe.fills, probe.reload, torch_dtypes
        params = {n: dict(kind=t.kind.value, sources=list(t.sources), how=t.how, refused=t.refused)
                  for n, t in probe.params.items()}
        return dict(placement=placement_to_json(probe.placement), params=params, skipped=probe.skipped,
                    refused=refused, stats=dict(vars(probe.stats)), aliases=aliases(model),
                    packed=sorted(cpu.PackedExperts.find(model)),
                    shapes={n: list(p.shape) for n, p in model.named_parameters()})

    def _dcr_steps(self) -> dict:
        return post_load_steps(self._dcr_model(), getattr(self, "vllm_config", None))

    def dcr_attach(self, placements: Sequence[dict], key: bytes | None = None, version: int = 0,
                   keep_index: bool = True, threads: int | str = "auto") -> dict:
        """Build the engine over the live params from this rank's entry of ``placements``
        (``threads``: its worker threads, ``dcr.threads``).

        Transformed tensors get a shadow filled with a NaN pattern (what the engine loaded of them
        is not known in canonical form), so the first sync sends them.

        Raises:
            ApplyVerificationError: a prepacked expert is not the packing of its loader-layout copy.
        """
        model = self._dcr_model()
        self.dcr_packed = cpu.PackedExperts.find(model)
        for name, layer in self.dcr_packed.items():
            bad = layer.mismatched(name)
            if bad:
                raise ApplyVerificationError(f"{name}: experts {bad} are not vLLM's packing of their unpacked copy")
        params = {n: p.data for n, p in model.named_parameters()}
        params.update({n: layer.unpacked[n] for n, layer in self.dcr_packed.items()})
        mine = placement_from_json(placements[self.rank])
        shadows = {n[len(SHADOW):]: preflight.unknown(tp.param_shape, self.dcr_dtypes.get(tp.name, torch.bfloat16))
                   for n, tp in ((tp.param, tp) for tp in mine.values()) if n.startswith(SHADOW)}
        params.update({SHADOW + n: t for n, t in shadows.items()})
        self.dcr_refresh = Refresh(model, shadows, {n: mine[n].shape for n in shadows}, self.dcr_reload,
                                   self.dcr_derived, self._dcr_steps())
        self.dcr_engine = TensorEngine(params, version, key, keep_index, placement=mine, fills=self.dcr_fills,
                                       threads=threads)
        return dict(rank=self.rank, tensors=len(mine), version=version, shadows=sorted(shadows))

    def dcr_prepare(self, parts_by_rank: Sequence[Sequence[Part]], resync: bool = False) -> dict:
        """Write and verify this rank's parts of one version, then the after-write steps (reload
        transformed tensors, re-derive, repack experts), keeping the undo state (never raises).

        Returns:
            ``ok`` and the result (``target``, ``touched``, ``refreshed``, ...), or ``ok=False`` with
            the exception's ``error`` type and ``message`` (this rank then holds nothing pending).
        """
        t0 = time.perf_counter()
        try:
            result = self.dcr_engine.prepare({0: read_parts(parts_by_rank[self.rank])}, resync)
        except Exception as exc:  # refused or rolled back here; reported to the driver
            return dict(ok=False, rank=self.rank, error=type(exc).__name__, message=str(exc)[:2000])
        try:
            touched = {self.dcr_engine.placed[n].param for n in result.touched}
            refreshed = self.dcr_refresh.apply(result, touched)
            self._dcr_repack(result, verify=True)
        except Exception as exc:
            self._dcr_undo(result)
            return dict(ok=False, rank=self.rank, error=type(exc).__name__, message=str(exc)[:2000])
        return dict(ok=True, rank=self.rank, seconds=time.perf_counter() - t0, refreshed=refreshed,
                    **_result_json(result))

    def dcr_commit(self) -> dict:
        """Move to the prepared version; returns it and this rank's checksums (canonical partial
        sums and views)."""
        result = self.dcr_engine.commit()
        self.dcr_refresh.drop()
        return dict(rank=self.rank, version=result.target_version, **_checksums_json(self.dcr_engine.checksums()))

    def dcr_settle(self) -> float:
        """Wait for this rank's kept indexes' move (the contract's ``settle``); the seconds waited."""
        return self.dcr_engine.settle()

    def dcr_rollback(self) -> dict:
        """Undo the prepared version bit for bit (a no-op when nothing is prepared)."""
        if self.dcr_engine.pending is None:
            return dict(rank=self.rank, rolled_back=False, version=self.dcr_engine.version)
        self._dcr_undo(self.dcr_engine.pending)
        return dict(rank=self.rank, rolled_back=True, version=self.dcr_engine.version)

    def dcr_checksums(self, full: bool = False, sample: dict | None = None) -> dict:
        """Version, canonical partial checksums (sum over ranks = the trainer's totals) and views
        (kept, by a full scan, or of a sample's slice: :meth:`~nemo_dcr.apply.TensorEngine.checksums`)."""
        ck = self.dcr_engine.checksums(full, None if sample is None else Sample.from_json(sample))
        return dict(rank=self.rank, version=self.dcr_engine.version, **_checksums_json(ck))

    def dcr_digests(self) -> dict[str, str]:
        """sha256 of every param this rank's engine writes into."""
        return self.dcr_engine.digests()

    def dcr_load_weights(self, source, version: int) -> dict:
        """Dense refit through the model's own ``load_weights``, from a safetensors checkpoint
        (``source``: its path) or from canonical HF tensors (``source``: name -> tensor).

        Prepacked experts are loaded into their loader-layout copies and repacked.  Returns the
        version, this rank's canonical partial checksums (full rescan), the seconds of reading and
        loading (``load_seconds``) and in all (``seconds``, with the rescan).
        """
        from nemo_dcr.checkpoint import load_checkpoint

        model = self._dcr_model()
        t0 = time.perf_counter()
        loaded = []

        def write(params) -> None:
            tensors = load_checkpoint(source) if isinstance(source, (str, Path)) else source
            with self._dcr_loader_layout():
                model.load_weights(tensors.items())
            for name, shadow in self.dcr_refresh.shadows.items():  # transformed: their canonical copies
                shadow.copy_(tensors[name].reshape(-1))
            for name, layer in self.dcr_packed.items():
                layer.repack(name)
            loaded.append(time.perf_counter() - t0)

        checksums = _checksums_json(self.dcr_engine.dense_refit(write, version))
        return dict(rank=self.rank, version=version, **checksums, load_seconds=loaded[0],
                    seconds=time.perf_counter() - t0)

    def dcr_preflight(self) -> list[str]:
        """Every param, buffer and tensor attribute of this rank against vLLM's own in-place reload
        of the canonical tensors it holds (:func:`.preflight.check`); returns the differences."""
        return preflight.check(self)

    def dcr_compare(self, path: str) -> list[str]:
        """Canonical tensors whose bits on this rank differ from the checkpoint at ``path``.

        Gathers each placed view and compares it with the same canonical elements of the file:
        after a plain load this finds any param vLLM rearranged after loading.
        """
        from nemo_dcr.checkpoint import load_checkpoint
        from nemo_dcr.types import int_view

        ref = load_checkpoint(path, self.dcr_engine.placed)
        out = []
        for name, tp in self.dcr_engine.placed.items():
            canon, _ = tp.runs.expand()
            want = int_view(ref[name].contiguous()).reshape(-1)[torch.from_numpy(canon)]
            if not torch.equal(int_view(self.dcr_engine.tensors[name].gather()), want):
                out.append(name)
        return out

    def _dcr_undo(self, result: ApplyResult) -> None:
        """Roll the prepared version back: what the after-write steps overwrote, the views and loader
        constants, then the repacked experts."""
        self.dcr_refresh.undo()
        self.dcr_engine.rollback()
        self._dcr_repack(result, verify=False)

    def _dcr_loader_layout(self):
        """Context in which prepacked params hold their loader-layout copies (for ``load_weights``)."""
        from contextlib import ExitStack

        params = dict(self._dcr_model().named_parameters())
        stack = ExitStack()
        for name, layer in self.dcr_packed.items():
            p, live = params[name], params[name].data
            p.data = layer.unpacked[name]
            stack.callback(setattr, p, "data", live)
        return stack

    def _dcr_repack(self, result: ApplyResult, verify: bool) -> None:
        """Repack the experts ``result`` wrote (all of a resynced param); read them back if ``verify``."""
        for name, experts in self._dcr_touched_experts(result).items():
            layer = self.dcr_packed[name]
            layer.repack(name, experts)
            bad = layer.mismatched(name, experts) if verify else []
            if bad:
                raise ApplyVerificationError(f"{name}: experts {bad} read back differ from their packing")

    def _dcr_touched_experts(self, result: ApplyResult) -> dict[str, np.ndarray | None]:
        """Prepacked param -> expert ids ``result`` wrote (None: all, after a resync)."""
        placement = self.dcr_engine.placed
        if result.resync:
            return {placement[n].param: None for n in result.touched if placement[n].param in self.dcr_packed}
        out: dict[str, list[np.ndarray]] = {}
        for d in result.deltas:
            tp = placement[d.name]
            if tp.param in self.dcr_packed and d.nnz:
                per_expert = int(np.prod(tp.param_shape[1:]))
                out.setdefault(tp.param, []).append(tp.runs.view_to_local(d.positions) // per_expert)
        return {p: np.unique(np.concatenate(e)) for p, e in out.items()}
