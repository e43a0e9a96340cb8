"""The refit path (docs/refit.md): :class:`DeltaRefit` on every trainer rank drives the protocol
(route, encode against the mirror, send, await, verify, resync) to :class:`EngineServer` on the
engine side, which drives an :class:`Engine` (the one engine contract, defined in
:mod:`nemo_dcr.apply.contract`); :mod:`.wiring` connects them (``colocated_wiring``
for an engine in a trainer process, ``engine_wiring`` for engines in processes of their own);
:mod:`.source` is what it reads from a trainer."""

from nemo_dcr.apply.contract import Engine

from .delta_refit import DeltaRefit
from .refit_report import RefitReport
from .server import EngineServer
from .source import TrainerSource, register_source, source_for
from .wiring import Wiring, colocated_wiring, engine_wiring

__all__ = ["DeltaRefit", "Engine", "EngineServer", "RefitReport", "TrainerSource", "Wiring", "colocated_wiring",
           "engine_wiring", "register_source", "source_for"]
