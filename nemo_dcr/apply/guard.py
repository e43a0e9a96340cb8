"""A readers-writer lock between generation (readers) and apply (the single writer).

Generation holds the read side for a whole ``generate`` call, apply holds the write side for
the whole transaction (validate, write, verify, commit or roll back), so no generation ever
reads a mix of two versions.  The guard also *measures* that property: every read records the
version it started and finished with, and whether a write was in flight; any difference is
counted in :attr:`VersionGuard.mixed_version_served` (0 by construction, checked by chaos).

:class:`PendingSlot` is the one version an engine has prepared but not yet committed or rolled
back, with the write side held meanwhile (an engine spread over ranks prepares every rank first).
"""

from __future__ import annotations

import threading
from contextlib import ExitStack, contextmanager
from typing import Generic, Iterator, TypeVar

from .errors import PendingVersionError

T = TypeVar("T")


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


class PendingSlot(Generic[T]):
    """What an engine keeps of its one prepared version until commit or rollback, with the write
    side of ``guard`` held meanwhile (readers wait; a second prepare is refused, not deadlocked).

    Args:
        guard: the engine's guard.
    """

    def __init__(self, guard: VersionGuard):
        self.guard = guard
        self._held: tuple[T, int, ExitStack] | None = None

    @property
    def item(self) -> T | None:
        """What was kept of the prepared version (None when none is prepared)."""
        return None if self._held is None else self._held[0]

    def refuse(self, what: str) -> None:
        """Raise instead of waiting on our own write side while a version is prepared.

        Raises:
            PendingVersionError: naming ``what`` and the prepared version.
        """
        if self._held is not None:
            raise PendingVersionError(f"{what} while version {self._held[1]} is prepared: commit or roll back first")

    def open(self) -> ExitStack:
        """The write side, held for a prepare (close it if the prepare fails; else :meth:`keep` it)."""
        self.refuse("another prepare")
        hold = ExitStack()
        hold.enter_context(self.guard.write())
        return hold

    def keep(self, item: T, target: int, hold: ExitStack) -> None:
        """Keep a prepared version (``target``) and its held write side."""
        self._held = (item, target, hold)

    def take(self, verb: str) -> tuple[T, ExitStack]:
        """The prepared version and its write side (the caller closes it after commit or rollback).

        Raises:
            PendingVersionError: nothing to ``verb``.
        """
        if self._held is None:
            raise PendingVersionError(f"nothing to {verb}: no version is prepared (engine at v{self.guard.version})")
        (item, _, hold), self._held = self._held, None
        return item, hold
