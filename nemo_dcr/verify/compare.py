"""Comparing the trainer's and the engine's per-tensor checksums (docs/refit.md, "Verification").

Both sides sum ``h(canonical index, bits)`` over the elements they hold
(:mod:`nemo_dcr.verify.checksum`): trainer ranks over their capture ranges, engine ranks over
their shards; the per-tensor totals must agree.  :class:`ShardChecksums` adds up one rank's
partial sums piece by piece (a delta moves them with :func:`~.checksum.checksums_after`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from .checksum import MASK64, hash_sum
from .sample import Sample


@dataclass(frozen=True)
class ChecksumMismatch:
    """One tensor whose two sides disagree."""

    name: str
    trainer: int | None
    engine: int | None
    where: str = ""
    """Which engine rank, when one rank's copy was compared (empty: the sum over ranks)."""
    engine_rank: int | None = None
    """That engine rank (None: the sum over ranks)."""

    def __str__(self) -> str:
        def fmt(x):
            return "missing" if x is None else f"{x:016x}"

        at = f" ({self.where})" if self.where else ""
        return f"{self.name}{at}: trainer {fmt(self.trainer)}, engine {fmt(self.engine)}"


@dataclass(frozen=True)
class VerifyReport:
    """Result of one verification.

    Attributes:
        version: the version verified.
        full: the engine side came from a full scan (else incremental values, or a sample).
        checked: tensors compared.
        mismatches: disagreeing tensors, by name.
        sample: the slice both sides recomputed from their live tensors (a sampled check).
        live: both sides read their live tensors (a ``full`` or ``sampled`` check of
            ``dcr.verify``), so neither side's values come from the deltas.
    """

    version: int
    full: bool
    checked: int
    mismatches: tuple[ChecksumMismatch, ...] = ()
    sample: Sample | None = None
    live: bool = False

    @property
    def ok(self) -> bool:
        """Both sides agree on every tensor."""
        return not self.mismatches

    def describe(self, limit: int = 8) -> str:
        """Human-readable summary naming the first ``limit`` mismatching tensors."""
        how = "full scan" if self.full else f"sampled, {self.sample.describe()}" if self.sample else "incremental"
        head = f"v{self.version} ({how}): "
        if self.ok:
            return head + f"{self.checked} tensors agree"
        names = "; ".join(str(m) for m in self.mismatches[:limit])
        return head + f"{len(self.mismatches)} of {self.checked} tensors differ: {names}"


def compare(trainer: Mapping[str, int], engine: Mapping[str, int], version: int, full: bool,
            sample: Sample | None = None, live: bool = False) -> VerifyReport:
    """Compare per-tensor checksums of both sides (names on one side only are mismatches)."""
    names = sorted(set(trainer) | set(engine))
    bad = tuple(ChecksumMismatch(n, trainer.get(n), engine.get(n)) for n in names
                if trainer.get(n) != engine.get(n))
    return VerifyReport(version, full, len(names), bad, sample, live)


@dataclass
class ShardChecksums:
    """One rank's partial checksum of each canonical tensor (its own elements only)."""

    sums: dict[str, int] = field(default_factory=dict)

    def add(self, name: str, canonical_index: np.ndarray, bits: np.ndarray) -> None:
        """Add elements held by this rank (a full scan of a shard, piece by piece)."""
        self.sums[name] = (self.sums.get(name, 0) + hash_sum(canonical_index, bits)) & MASK64
