"""vLLM worker extension: nemo_dcr payloads applied in place into vLLM's fused, TP-sharded params.

Attached with ``vllm.LLM(..., worker_extension_cls=WORKER_EXTENSION)`` (from
:mod:`nemo_dcr.integrations.vllm`); vLLM mixes
:class:`DcrWorkerExtension` into its worker class in every worker process and the driver calls
the ``dcr_*`` methods through ``collective_rpc`` (:class:`~nemo_dcr.integrations.vllm.engine.VllmEngine`
does it for you).  Importing this module installs the CPU patches of
:mod:`nemo_dcr.integrations.vllm.cpu` (on the CPU platform only), which must happen before the
model loads; vLLM imports the extension class before it builds the model.

* ``dcr_probe`` derives the placement from vLLM's own loaders (docs/engines.md, "vLLM"): the
  model's ``load_weights`` runs with every param's loader replaced by a recorder, then each
  recorded call is replayed with an int64 iota tensor into a -1 probe buffer
  (:mod:`nemo_dcr.apply.placement`).  Live weights are untouched.
* ``dcr_attach`` builds this rank's :class:`~nemo_dcr.apply.TensorEngine` over the live params and
  its placement (with the constants the loaders write, so a resync ends as a fresh load does).
* ``dcr_prepare`` / ``dcr_commit`` / ``dcr_rollback`` apply one version as a transaction that
  spans all TP ranks (:meth:`nemo_dcr.apply.TensorEngine.prepare`): every rank writes and
  verifies, keeps its undo log, and commits only when the driver heard that all ranks verified.
* Prepacked CPU MoE experts are written in their loader layout and the touched experts repacked
  and read back (:class:`~nemo_dcr.integrations.vllm.cpu.PackedExperts`).

Payload parts reach a rank as bytes, or as paths of files holding one part each (vLLM's
multiprocess executor broadcasts ``collective_rpc`` arguments to every rank, so a rank reads
only the files named for it).  Unquantized weights only (the probe refuses loaders that change
values).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import torch

from nemo_dcr.apply import ApplyResult, ApplyVerificationError, EngineChecksums, TensorEngine
from nemo_dcr.apply.placement import placement_from_json, placement_to_json, probe_model, record_loader_calls

from . import cpu

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

    def dcr_probe(self, shapes: Mapping[str, Sequence[int]]) -> dict:
        """This rank's placement of every canonical tensor (JSON; primary not yet assigned).

        Returns:
            ``placement`` (JSON form), ``aliases`` (see :func:`aliases`), ``packed`` (params the
            CPU kernel prepacks; written in their loader layout), ``params`` (name -> shape).
        """
        model = self._dcr_model()
        calls = record_loader_calls(model, shapes.items(), set_loader)
        self.dcr_fills: dict = {}
        placement = placement_to_json(probe_model(model, shapes, calls, get_loader, fills=self.dcr_fills))
        return dict(placement=placement, aliases=aliases(model), packed=sorted(cpu.PackedExperts.find(model)),
                    params={n: list(p.shape) for n, p in model.named_parameters()})

    def dcr_attach(self, placements: Sequence[dict], key: bytes | None = None, version: int = 0,
                   keep_index: bool = True) -> dict:
        """Build the engine over the live params from this rank's entry of ``placements``.

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
        self.dcr_engine = TensorEngine(params, version, key, keep_index, placement=mine, fills=self.dcr_fills)
        return dict(rank=self.rank, tensors=len(mine), version=version)

    def dcr_prepare(self, parts_by_rank: Sequence[Sequence[Part]], resync: bool = False) -> dict:
        """Write and verify this rank's parts of one version, keeping the undo log (never raises).

        Returns:
            ``ok`` and the result (``target``, ``touched``, ...), or ``ok=False`` with the
            exception's ``error`` type and ``message`` (this rank then holds nothing pending).
        """
        t0 = time.perf_counter()
        try:
            result = self.dcr_engine.prepare({0: read_parts(parts_by_rank[self.rank])}, resync)
        except Exception as exc:  # refused or rolled back here; reported to the driver
            return dict(ok=False, rank=self.rank, error=type(exc).__name__, message=str(exc)[:2000])
        try:
            self._dcr_repack(result, verify=True)
        except Exception as exc:
            self._dcr_undo(result)
            return dict(ok=False, rank=self.rank, error=type(exc).__name__, message=str(exc)[:2000])
        return dict(ok=True, rank=self.rank, seconds=time.perf_counter() - t0, **_result_json(result))

    def dcr_commit(self) -> dict:
        """Move to the prepared version; returns it and this rank's checksums (canonical partial
        sums and views)."""
        result = self.dcr_engine.commit()
        return dict(rank=self.rank, version=result.target_version, **_checksums_json(self.dcr_engine.checksums()))

    def dcr_rollback(self) -> dict:
        """Undo the prepared version bit for bit (a no-op when nothing is prepared)."""
        if self.dcr_engine.pending is None:
            return dict(rank=self.rank, rolled_back=False, version=self.dcr_engine.version)
        self._dcr_undo(self.dcr_engine.pending)
        return dict(rank=self.rank, rolled_back=True, version=self.dcr_engine.version)

    def dcr_checksums(self, full: bool = False) -> dict:
        """Version, canonical partial checksums (sum over ranks = the trainer's totals) and views."""
        return dict(rank=self.rank, version=self.dcr_engine.version, **_checksums_json(self.dcr_engine.checksums(full)))

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
            with self._dcr_loader_layout():
                tensors = load_checkpoint(source) if isinstance(source, (str, Path)) else source
                model.load_weights(tensors.items())
            for name, layer in self.dcr_packed.items():
                layer.repack(name)
            loaded.append(time.perf_counter() - t0)

        checksums = _checksums_json(self.dcr_engine.dense_refit(write, version))
        return dict(rank=self.rank, version=version, **checksums, load_seconds=loaded[0],
                    seconds=time.perf_counter() - t0)

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
        """Roll the prepared version back (views and loader constants), then the repacked experts."""
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
