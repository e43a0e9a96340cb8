"""Where the seconds of a refit go: the phase clock every refit fills.

:class:`PhaseClock` accumulates wall seconds per phase name; the same names appear in
:attr:`nemo_dcr.refit.RefitReport.times`, the JSONL rows of :mod:`.jsonl` and the run report.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator


class PhaseClock:
    """Wall seconds per named phase (``perf_counter``); phases may repeat and accumulate.

    Args:
        seconds: the dict to accumulate into (default: a new one).
    """

    def __init__(self, seconds: dict[str, float] | None = None):
        self.seconds = {} if seconds is None else seconds

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - t0
