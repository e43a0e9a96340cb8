"""The engine contract: what the refit path's server drives, and every engine implements in full.

An engine holds one version of a model's weights and moves to the next only by whole
transactions.  :class:`Engine` is the one protocol (docs/engines.md, "The contract"); the server
(:class:`nemo_dcr.refit.EngineServer`) uses nothing else, and nothing in it is optional:

* ``version``: the version every tensor holds (never a mix).
* ``placement()``: where the engine holds each canonical element, per shard, in the JSON form of
  :func:`~.placement.placement_to_json`; an empty list when it holds canonical tensors whole.
* ``prepare(parts, resync)``: validate, write and verify one version's parts, ``{shard: [payload,
  ...]}`` (shard 0 for an engine holding canonical tensors whole), keeping the undo log;
  ``commit()`` moves to it, ``rollback()`` restores every bit.  :func:`apply_version` is
  prepare-then-commit, the only place that pairs them.
* ``checksums(full, sample)``: one :class:`EngineChecksums` (the canonical partial sums the
  trainer's totals are compared with, and the checksums of every shard's views): kept from each
  verified apply, by a full scan (``full``), or over one slice recomputed from the live tensors
  (``sample``, :class:`~nemo_dcr.verify.sample.Sample`: then the views are the slice's sums over
  every held element, hashed by canonical index, and the kept values do not change).
* ``digests()``: sha256 of the raw bits of everything it holds (an equality check for tests and
  chaos, independent of the checksums).
* ``serving()``: a context manager holding the current version for one generation.
* ``preflight()``: compare everything the engine holds with its own dense load of the same
  weights (its loader and post-load processing); the differences, empty when bit-identical
  (docs/engines.md, "Engine truth").  An engine without a loader of its own (tensors held
  whole, or views into params it was handed) has nothing to compare and returns none.
* ``settle()``: wait until the work a commit left running behind it is done (the kept ``dcr``
  class indexes' move, which the next version's decode would wait for); the seconds waited.  A
  benchmark calls it before timing anything else on the same cores (the dense refit it compares
  with), so that work is charged to the refit that left it, never to the baseline.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import ContextManager, Mapping, Protocol, Sequence

import torch

from nemo_dcr.types import int_view
from nemo_dcr.verify.sample import Sample

from .errors import IncompletePartsError
from .transaction import ApplyResult

Parts = Mapping[int, Sequence[bytes]]
"""One version's payload parts by engine shard: ``{shard: [payload, ...]}``."""


@dataclass(frozen=True)
class EngineChecksums:
    """What an engine reports of its weights' checksums (docs/refit.md, "Verification").

    Attributes:
        canonical: canonical tensor -> ``Σ h(canonical index, bits)`` over the elements this engine
            is the primary holder of (the whole tensor when it holds canonical tensors whole): the
            engines' values summed mod 2**64 equal the trainer's totals.
        views: shard -> canonical tensor -> checksum of the elements that shard holds, in its view
            index space (replicas included): what the sender's mirror expects of each shard.  Empty
            for an engine holding canonical tensors whole (its views are ``canonical``).
    """

    canonical: dict[str, int]
    views: dict[int, dict[str, int]] = field(default_factory=dict)


class Engine(Protocol):
    """The one engine contract (see the module docstring); implemented by
    :class:`~.engine.TensorEngine`, ``HFEngine``, ``VllmEngine`` and every stand-in."""

    @property
    def version(self) -> int: ...

    def placement(self) -> list[dict]: ...

    def prepare(self, parts: Parts, resync: bool = False) -> ApplyResult: ...

    def commit(self) -> ApplyResult: ...

    def rollback(self) -> ApplyResult: ...

    def checksums(self, full: bool = False, sample: Sample | None = None) -> EngineChecksums: ...

    def digests(self) -> dict[str, str]: ...

    def serving(self) -> ContextManager[int]: ...

    def preflight(self) -> list[str]: ...

    def settle(self) -> float: ...


class ForwardingEngine:
    """An :class:`Engine` that forwards every member to ``inner``: the base of wrappers that watch
    or fault one part of the contract (timing, chaos) and override only that part, so a member the
    contract gains reaches every wrapper at once."""

    def __init__(self, inner: Engine):
        self.inner = inner

    @property
    def version(self) -> int:
        return self.inner.version

    def placement(self) -> list[dict]:
        return self.inner.placement()

    def prepare(self, parts: Parts, resync: bool = False) -> ApplyResult:
        return self.inner.prepare(parts, resync)

    def commit(self) -> ApplyResult:
        return self.inner.commit()

    def rollback(self) -> ApplyResult:
        return self.inner.rollback()

    def checksums(self, full: bool = False, sample: Sample | None = None) -> EngineChecksums:
        return self.inner.checksums(full, sample)

    def digests(self) -> dict[str, str]:
        return self.inner.digests()

    def serving(self) -> ContextManager[int]:
        return self.inner.serving()

    def preflight(self) -> list[str]:
        return self.inner.preflight()

    def settle(self) -> float:
        return self.inner.settle()


def apply_version(engine: Engine, parts: Parts, resync: bool = False) -> ApplyResult:
    """One version as one transaction: ``prepare`` (which rolls back by itself on any failure),
    then ``commit``.

    Raises:
        whatever ``prepare`` raises: the engine keeps its old version, bit for bit.
    """
    engine.prepare(parts, resync)
    return engine.commit()


def shard_parts(parts: Parts, shards: int) -> list[list[bytes]]:
    """The parts of shards ``0 .. shards-1`` in shard order (none for a shard without parts).

    Raises:
        IncompletePartsError: parts for a shard this engine does not have (nothing is written).
    """
    stray = sorted(s for s in parts if not 0 <= s < shards)
    if stray:
        raise IncompletePartsError(f"parts for shards {stray}, but this engine has shards 0..{shards - 1}")
    return [list(parts.get(s, ())) for s in range(shards)]


def tensor_digests(tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """sha256 of each tensor's raw bits, by name."""
    return {n: hashlib.sha256(int_view(t.contiguous()).cpu().numpy().tobytes()).hexdigest()
            for n, t in tensors.items()}
