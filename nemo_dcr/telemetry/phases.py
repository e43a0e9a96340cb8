"""Where the seconds of a refit go: the one phase vocabulary and the clock every refit fills.

:class:`Phase` names every phase a refit records; :class:`PhaseClock` accumulates wall seconds
per phase and accepts only :class:`Phase` members.  The same names (the members' values) are the
keys of :attr:`nemo_dcr.refit.RefitReport.times`, of ``times`` in the JSONL rows of :mod:`.jsonl`
and of the columns and bars of ``nemo-dcr report``.

Besides the phases, ``times`` holds two totals, which are not phases:

* :data:`TOTAL`: wall seconds of the refit call on this rank (``DeltaRefit.attach`` or
  ``DeltaRefit.step``) minus the phases outside the total (:attr:`Phase.in_total` false:
  ``telemetry``; ``export`` happens before the call).  The phases inside the total are disjoint
  spans of that call, so they sum to at most :data:`TOTAL`; the rest (bookkeeping between
  phases, the sender's version query before a resync) is time in no phase, which the report
  draws as ``other``.
* :data:`TOTAL_SLOWEST_RANK`: the largest :data:`TOTAL` over the trainer ranks.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from enum import Enum
from typing import ContextManager, Iterator, Mapping


class Phase(str, Enum):
    """One phase of a refit, in the order a refit runs them (the report's order too).

    A ``str`` enum: a member equals (and hashes as) its value, so ``times[Phase.SEND]`` reads a
    dict keyed by ``"send"`` and JSON keys stay plain strings.
    """

    EXPORT = "export"
    """NeMo-RL plugin, policy side: draining NeMo-RL's weight export, keeping CPU copies of the
    owned tensors (before the refit call: not in the total)."""
    PLACEMENT = "placement"
    """``DeltaRefit.attach``: asking the engines where they hold each canonical element and
    setting the routes (in the total)."""
    CAPTURE = "capture"
    """``DeltaRefit``: scanning this rank's slice against its baseline (attach: registering the
    baseline and taking every nonzero element) (in the total)."""
    REMAP = "remap"
    """``DeltaRefit.step``: mapping the captured changes to canonical indices (in the total)."""
    CHECKSUM = "checksum"
    """``DeltaRefit``: this rank's partial checksums of its current weights (in the total)."""
    ROUTE = "route"
    """``RefitSender``: pieces to the owner of each canonical tensor, merged into its mirror's
    changes (in the total)."""
    ENCODE = "encode"
    """``RefitSender``: encoding the payload parts against the mirror (delta, or whole tensors for
    a resync) (in the total)."""
    SEND = "send"
    """``RefitSender``: payload parts onto the transport (in the total)."""
    AWAIT = "await"
    """``RefitSender``: waiting for every engine rank's ACK / NACK, i.e. the engine's decode,
    apply and reply, and agreeing on the outcome over the trainer group (in the total)."""
    TELEMETRY = "telemetry"
    """``RefitSender.refit``: sizing the payload in ``telemetry_encodings`` and the engine
    format's counts (measured only, not sent: not in the total)."""
    VERIFY = "verify"
    """``RefitSender``: committing the mirror after the engines acknowledged and comparing trainer
    and engine checksums (also the recovery's checksum query) (in the total)."""
    PREFLIGHT = "preflight"
    """``DeltaRefit.attach`` with ``dcr.preflight``: every engine compares what it holds with its
    own dense load of the same weights (in the total)."""
    COMMIT = "commit"
    """``DeltaRefit``: moving the capture baseline to the committed version (in the total)."""

    def __str__(self) -> str:
        return self.value

    @property
    def in_total(self) -> bool:
        """The phase's seconds are part of :data:`TOTAL`."""
        return self not in _OUTSIDE_TOTAL


_OUTSIDE_TOTAL = frozenset({Phase.EXPORT, Phase.TELEMETRY})

TOTAL = "total"
"""``times`` key: this rank's wall seconds of the refit call, phases outside the total excluded."""
TOTAL_SLOWEST_RANK = "total_slowest_rank"
"""``times`` key: the largest :data:`TOTAL` over the trainer ranks."""
TOTALS = (TOTAL, TOTAL_SLOWEST_RANK)
"""The ``times`` keys that are totals, not phases."""


def total_seconds(elapsed: float, seconds: Mapping[str, float]) -> float:
    """:data:`TOTAL` of a refit call that took ``elapsed`` wall seconds and recorded ``seconds``."""
    return elapsed - sum(seconds.get(p, 0.0) for p in _OUTSIDE_TOTAL)


class PhaseClock:
    """Wall seconds per :class:`Phase` (``perf_counter``); phases may repeat and accumulate.

    Args:
        seconds: the dict to accumulate into, keyed by the phases' values (default: a new one).
    """

    def __init__(self, seconds: dict[str, float] | None = None):
        self.seconds = {} if seconds is None else seconds

    def __call__(self, phase: Phase) -> ContextManager[None]:
        """Time the ``with`` block as ``phase``.

        Raises:
            TypeError: ``phase`` is not a :class:`Phase` member (a plain string is refused, so a
                misspelt or unreported phase cannot be recorded).
        """
        if not isinstance(phase, Phase):
            raise TypeError(f"PhaseClock takes a Phase member, got {phase!r}; phases: "
                            f"{', '.join(p.value for p in Phase)}")
        return self._timed(phase.value)

    @contextmanager
    def _timed(self, key: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - t0
