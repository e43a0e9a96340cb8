"""The refit path (docs/refit.md): :class:`DeltaRefit` on every trainer rank drives the protocol
(route, encode against the mirror, send, await, verify, resync) to :class:`EngineServer` on the
engine side; :mod:`.wiring` connects them; :mod:`.source` is what it reads from a trainer."""

from .delta_refit import DeltaRefit
from .report import RefitReport
from .server import EngineServer
from .source import TrainerSource, register_source, source_for
from .wiring import Wiring, colocated_wiring, engine_wiring

__all__ = ["DeltaRefit", "EngineServer", "RefitReport", "TrainerSource", "Wiring", "colocated_wiring",
           "engine_wiring", "register_source", "source_for"]
