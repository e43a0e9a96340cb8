"""vLLM worker extension: nemo_dcr payloads applied in place into vLLM's fused, TP-sharded params.

Usage (driver side)::

    llm = vllm.LLM(model=..., worker_extension_cls="nemo_dcr.integrations.vllm.worker.DcrWorkerExtension")
    probed = llm.collective_rpc("dcr_probe", args=(canonical_shapes,))      # one per TP rank
    ranks = [placement_to_json(p) for p in
             assign_primary([placement_from_json(x) for x in probed])]
    llm.collective_rpc("dcr_attach", args=(ranks, key, version))
    llm.collective_rpc("dcr_apply", args=(parts_by_rank,))                  # each rank takes its own

``dcr_probe`` derives the placement from vLLM's own loaders (docs/engines.md, "vLLM"): the
model's ``load_weights`` runs with every param's loader replaced by a recorder (so the shard ids
and expert ids are the ones vLLM's ``stacked_params_mapping`` / expert mapping pass), then each
recorded call is replayed with an int64 iota tensor into a -1 probe buffer
(:mod:`nemo_dcr.apply.placement`).  Live weights are untouched: only ``param.data`` is swapped
for the probe buffer during a call.  Applying goes through :class:`nemo_dcr.apply.routed.RoutedEngine`
(transactional, undo log, verified checksums).  vllm is imported lazily; unquantized weights only
(a loader that changes values is refused by the probe).
"""

from __future__ import annotations

from typing import Mapping, Sequence

from nemo_dcr.apply.placement import placement_from_json, placement_to_json, probe_model, record_loader_calls


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


class DcrWorkerExtension:
    """Mixed into vLLM's worker by ``worker_extension_cls``; methods run via ``collective_rpc``."""

    def _dcr_model(self):
        return self.model_runner.model

    def dcr_probe(self, shapes: Mapping[str, Sequence[int]]) -> dict:
        """This rank's placement of every canonical tensor (JSON form; primary not yet assigned)."""
        model = self._dcr_model()
        calls = record_loader_calls(model, shapes.items(), set_loader)
        return placement_to_json(probe_model(model, shapes, calls, get_loader))

    def dcr_attach(self, placements: Sequence[dict], key: bytes | None = None, version: int = 0) -> int:
        """Build the engine over the live params from this rank's entry of ``placements``."""
        from nemo_dcr.apply.routed import RoutedEngine

        params = {n: p.data for n, p in self._dcr_model().named_parameters()}
        mine = placement_from_json(placements[self.rank])
        self.dcr_engine = RoutedEngine(params, mine, version, key)
        return self.rank

    def dcr_apply(self, parts_by_rank: Sequence[Sequence[bytes]]) -> dict:
        """Apply this rank's parts of one version (transactional); returns touched counts."""
        result = self.dcr_engine.apply(list(parts_by_rank[self.rank]))
        return dict(version=result.target_version, touched=result.touched)

    def dcr_resync(self, parts_by_rank: Sequence[Sequence[bytes]]) -> dict:
        """Full resync of this rank's views (transactional)."""
        result = self.dcr_engine.resync(list(parts_by_rank[self.rank]))
        return dict(version=result.target_version, touched=result.touched)

    def dcr_checksums(self, full: bool = False) -> dict:
        """Version and canonical partial checksums (sum over ranks = the trainer's totals)."""
        return dict(version=self.dcr_engine.version, checksums=self.dcr_engine.checksums(full))
