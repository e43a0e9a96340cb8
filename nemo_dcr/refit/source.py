"""What the refit path reads from one trainer rank: a :class:`TrainerSource`.

A source is framework-specific (Megatron-Core chunks in ``nemo_dcr.integrations.megatron``,
canonical tensors handed over by NeMo-RL's export in ``nemo_dcr.integrations.nemo_rl``, a
stand-in in the tests); the refit path only sees this protocol.

Integrations register a *builder* for the model objects they understand, as an entry point of
the group :data:`ENTRY_POINTS` (``pyproject.toml``: ``megatron-core =
"nemo_dcr.integrations.megatron:source_from_model"``) or with :func:`register_source`;
:func:`source_for` turns a user's model into a source, loading the entry points on first use, so
``DeltaRefit.from_config(cfg, model, optimizer)`` works for any installed framework whichever
module the caller imported first, while the core never imports one.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Protocol, runtime_checkable

import torch

from nemo_dcr.types import SparseDelta
from nemo_dcr.verify.sample import Sample


@runtime_checkable
class TrainerSource(Protocol):
    """One trainer rank's view of the model, in the terms of the refit path."""

    params: Mapping[str, torch.Tensor]
    """Capture key -> live local tensor (contiguous; a shard of one or more canonical tensors)."""
    ranges: Mapping[str, tuple[int, int]]
    """Capture key -> flat ``(start, stop)`` slice this rank captures.  Over all ranks the slices
    cover every element that maps to a canonical tensor exactly once."""
    canonical: Mapping[str, tuple[str, tuple[int, ...]]]
    """Every canonical tensor of the whole model: name -> (wire dtype, shape)."""

    def remap(self, delta: SparseDelta) -> list[SparseDelta]:
        """A local delta (capture key, local flat positions) as canonical pieces (cost ∝ changes)."""

    def checksums(self, sample: Sample | None = None) -> dict[str, int]:
        """Partial layout-independent checksums of the elements this rank captures, by a full
        scan of the live params (canonical name -> ``sum h(canonical index, bits)`` mod 2**64),
        or over ``sample``'s slice of them only (:mod:`nemo_dcr.verify.sample`)."""

    def pieces(self) -> list[SparseDelta]:
        """Every element this rank captures, as canonical pieces with zero old bits (first sync)."""

    def captured(self) -> dict[str, int]:
        """Canonical name -> elements of it this rank captures (cheap: the owner choice reads it
        when the refit is built, before any capture)."""


SourceBuilder = Callable[..., "TrainerSource | None"]
_BUILDERS: list[tuple[str, SourceBuilder]] = []
ENTRY_POINTS = "nemo_dcr.sources"
"""Entry-point group of the framework source builders (name: the framework)."""
_loaded_entry_points = False


def _load_entry_points() -> None:
    """Register every builder of the :data:`ENTRY_POINTS` group once (a broken one is named)."""
    global _loaded_entry_points
    if _loaded_entry_points:
        return
    _loaded_entry_points = True
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINTS):
        if ep.name in {f for f, _ in _BUILDERS}:
            continue
        try:
            register_source(ep.name, ep.load())
        except Exception as exc:  # an integration whose framework is missing: say which, go on
            _BROKEN[ep.name] = f"{type(exc).__name__}: {exc}"


_BROKEN: dict[str, str] = {}


def register_source(framework: str, builder: SourceBuilder) -> None:
    """Register ``builder(model, **options)``: a source for models it understands, else None."""
    if framework not in {f for f, _ in _BUILDERS}:
        _BUILDERS.append((framework, builder))


def source_for(model: Any, **options) -> TrainerSource:
    """``model`` itself when it is a :class:`TrainerSource`, else the first registered builder's.

    Raises:
        TypeError: no builder understands ``model``; names the registered frameworks.
    """
    if isinstance(model, TrainerSource):
        return model
    _load_entry_points()
    for _, builder in _BUILDERS:
        source = builder(model, **options)
        if source is not None:
            return source
    known = ", ".join(f for f, _ in _BUILDERS) or "none"
    broken = "".join(f"; {name} did not load ({why})" for name, why in sorted(_BROKEN.items()))
    raise TypeError(f"no trainer source for a {type(model).__name__}: pass a TrainerSource or a model of a "
                    f"registered framework ({known}{broken})")
