"""A canonical tensor's elements held by one engine rank, as a 1-D index space inside a live param.

Payload records routed to an engine rank (docs/engines.md, "Routing") index the *view* of each
canonical tensor: ``j = 0 .. n-1`` runs over the held elements in canonical order
(:class:`nemo_dcr.apply.placement.Runs`), so a record never names an element the rank lacks.
The transaction (:mod:`nemo_dcr.apply.transaction`) decodes against :meth:`ShardView.gather`
and scatters through :meth:`ShardView.locate` into the live param's integer view.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from nemo_dcr.kernels.traffic import on_host, to_device
from nemo_dcr.types import int_view

from .placement import Runs

_GATHER_RUNS = 64
"""Up to this many runs a gather copies slices; beyond it, one indexed gather."""

_CHUNK = 1 << 22
"""Elements per indexed copy of :meth:`ShardView.scatter_canonical` (bounds its index arrays)."""


@dataclass(frozen=True)
class ShardView:
    """View ``j`` of a canonical tensor inside ``param`` (contiguous, any device).

    Attributes:
        param: the live engine param.
        runs: canonical -> param-local flat index of the held elements.
    """

    param: torch.Tensor
    runs: Runs

    @property
    def dtype(self) -> torch.dtype:
        return self.param.dtype

    @property
    def shape(self) -> tuple[int]:
        return (self.runs.numel,)

    def flat(self) -> torch.Tensor:
        """The param's flat integer view (writes go here)."""
        return int_view(self.param)

    def locate(self, view_positions: np.ndarray) -> torch.Tensor:
        """Param-local flat indices of view positions, on the param's device."""
        return to_device(np.ascontiguousarray(self.runs.view_to_local(view_positions), np.int64), self.param.device)

    def gather(self) -> torch.Tensor:
        """The held elements in view order (shape ``(n,)``, param dtype), for reading only: a view
        of the param when they are one contiguous run (no copy of a whole tensor per decode), else
        a copy."""
        flat = self.param.detach().reshape(-1)
        r = self.runs
        if r.length.size <= _GATHER_RUNS:
            parts = [flat[int(s):int(s) + (int(n) - 1) * int(k) + 1:int(k)]
                     for s, n, k in zip(r.local, r.length, r.step)]
            if len(parts) == 1 and parts[0].is_contiguous():
                return parts[0]
            return torch.cat(parts) if parts else flat[:0].clone()
        if on_host(flat):
            return flat[torch.from_numpy(r.expand()[1])]
        # on a device the index is expanded there from the runs (start, length, step: 24 B per run
        # cross, not 8 B per element): element k of a run sits at local + k * step
        runs = to_device(np.ascontiguousarray(np.stack([r.local, r.length, r.step]), np.int64), flat.device)
        local, length, step = runs[0], runs[1], runs[2]
        first = torch.repeat_interleave(torch.cumsum(length, 0) - length, length, output_size=r.numel)
        within = torch.arange(r.numel, device=flat.device) - first
        index = torch.repeat_interleave(local, length, output_size=r.numel) + \
            within * torch.repeat_interleave(step, length, output_size=r.numel)
        return flat[index]

    def scatter_canonical(self, out: torch.Tensor) -> None:
        """Write the held elements at their canonical flat indices of ``out`` (a flat host tensor
        of the canonical tensor's length and the param's dtype): run by run (slices, no
        per-element index) up to :data:`_GATHER_RUNS` runs, else by indexes a chunk at a time."""
        flat, r = self.param.detach().reshape(-1), self.runs
        if r.length.size <= _GATHER_RUNS:
            for c, l, n, k in zip(r.canon.tolist(), r.local.tolist(), r.length.tolist(), r.step.tolist()):
                out[c:c + n] = flat[l:l + (n - 1) * k + 1:k].cpu()
            return
        for canon, local in r.pieces(_CHUNK):
            out[torch.from_numpy(canon)] = flat[torch.from_numpy(local).to(flat.device)].cpu()
