"""A readers-writer lock between generation (readers) and apply (the single writer).

Generation holds the read side for a whole ``generate`` call, apply holds the write side for
the whole transaction (validate, write, verify, commit or roll back), so no generation ever
reads a mix of two versions.  The guard also *measures* that property: every read records the
version it started and finished with, and whether a write was in flight; any difference is
counted in :attr:`VersionGuard.mixed_version_served` (0 by construction, checked by chaos).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator


class VersionGuard:
    """Writer-preferring readers-writer lock with a version counter.

    Args:
        version: the version the engine holds at start.
    """

    def __init__(self, version: int = 0):
        self.version = version
        self.mixed_version_served = 0
        self.reads_served = 0
        self._cond = threading.Condition()
        self._readers = 0
        self._writing = False
        self._writers_waiting = 0

    @contextmanager
    def read(self) -> Iterator[int]:
        """Hold the engine at one version; yields that version."""
        with self._cond:
            while self._writing or self._writers_waiting:
                self._cond.wait()
            self._readers += 1
            start = self.version
        try:
            yield start
        finally:
            with self._cond:
                if self._writing or self.version != start:
                    self.mixed_version_served += 1
                self.reads_served += 1
                self._readers -= 1
                self._cond.notify_all()

    @contextmanager
    def write(self) -> Iterator[None]:
        """Exclusive access for one transaction; readers wait until it commits or rolls back."""
        with self._cond:
            self._writers_waiting += 1
            while self._writing or self._readers:
                self._cond.wait()
            self._writers_waiting -= 1
            self._writing = True
        try:
            yield
        finally:
            with self._cond:
                self._writing = False
                self._cond.notify_all()
