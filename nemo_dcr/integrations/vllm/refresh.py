"""After a version is written into the views: what the engine's own load would also have changed.

A transaction (:meth:`nemo_dcr.apply.TensorEngine.prepare`) writes the elements of the placed
views.  For params that are not in place (:mod:`.kinds`) one more step makes the engine hold what
its own dense load of the same canonical tensors would:

* **transformed** tensors (``A = -exp(A_log)``): the view is the tensor's canonical *shadow*
  (:data:`~nemo_dcr.apply.probe.SHADOW`); each touched one is reloaded from its shadow through
  the engine's own ``load_weights``, under a :class:`~nemo_dcr.apply.write_guard.WriteGuard`
  that lets it write only the params the probe saw it write;
* **derived** tensors: the post-load step of every layer whose inputs were touched is re-run;
* prepacked CPU MoE experts are repacked by the worker (:class:`~.cpu.PackedExperts`).

Each step first saves the bits of what it overwrites (whole params: transformed and derived
tensors are small), so :meth:`Refresh.undo` restores them exactly before the transaction rolls back.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import torch

from nemo_dcr.apply import ApplyResult, ApplyVerificationError
from nemo_dcr.apply.write_guard import Protected, WriteGuard

from .kinds import DerivedGroup, live_views


class Refresh:
    """The after-write steps of one engine rank.

    Args:
        model: the engine's module.
        shadows: transformed canonical name -> its shadow (canonical shape, flattened).
        shapes: canonical shapes of those names.
        reload: transformed canonical name -> the params its load writes.
        derived: derived groups (:class:`~.kinds.DerivedGroup`) and their steps (module -> callable).
        steps: module name -> its post-load step.
    """

    def __init__(self, model: torch.nn.Module, shadows: Mapping[str, torch.Tensor], shapes: Mapping[str, Sequence[int]],
                 reload: Mapping[str, Sequence[str]], derived: Sequence[DerivedGroup],
                 steps: Mapping[str, Callable[[], None]]):
        self.model, self.shadows, self.shapes = model, dict(shadows), dict(shapes)
        self.reload = {n: tuple(p) for n, p in reload.items() if n in self.shadows}
        self.derived, self.steps = list(derived), dict(steps)
        self.sources = {g.module: self._sources(g) for g in self.derived}
        self.saved: dict[str, torch.Tensor] = {}

    def _sources(self, group: DerivedGroup) -> set[str]:
        """Engine params whose change calls for re-running ``group``'s step."""
        return set(group.inputs)

    def apply(self, result: ApplyResult, touched_params: set[str]) -> list[str]:
        """Reload the touched transformed tensors, then re-derive the layers whose inputs changed
        (``touched_params``: engine params the version wrote).  Returns what was refreshed.

        Raises:
            ApplyVerificationError: a reload wrote outside the params the probe saw (nothing is
                left changed by it: the caller undoes).
        """
        done = []
        names = sorted(n for n in result.touched if n in self.reload)
        for name in names:
            self._reload(name)
            touched_params |= set(self.reload[name])
            done.append(name)
        for group in self.derived:
            if self.sources[group.module] & touched_params:
                self._save(group.outputs)
                with torch.no_grad():
                    self.steps[group.module]()
                done.append(group.module)
        return done

    def _reload(self, name: str) -> None:
        params = self.reload[name]
        self._save(params)
        live = live_views(self.model)
        guard = WriteGuard(Protected({n: t for n, t in live.items() if n not in params}))
        with torch.no_grad(), guard:
            guard.label = name
            self.model.load_weights([(name, self.shadows[name].reshape(tuple(self.shapes[name])))])
        if guard.blocked:
            raise ApplyVerificationError(f"reloading {name} through the engine's loader tried to write "
                                         f"{sorted({o for _, o, _ in guard.blocked})}, beyond {list(params)}")

    def _save(self, names: Sequence[str]) -> None:
        live = live_views(self.model)
        for n in names:
            if n not in self.saved:
                self.saved[n] = live[n].clone()

    def undo(self) -> None:
        """Restore every tensor a step overwrote since the last :meth:`drop`."""
        live = live_views(self.model)
        with torch.no_grad():
            for n, t in self.saved.items():
                live[n].copy_(t)
        self.saved = {}

    def drop(self) -> None:
        """The version committed: forget the saved bits."""
        self.saved = {}
