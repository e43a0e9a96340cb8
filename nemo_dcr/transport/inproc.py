"""In-process transport: one mailbox per rank, for tests and colocated single-process refits."""

from __future__ import annotations

import threading
import time

from .base import Envelope, TransportTimeout


class InProcHub:
    """Mailboxes of ``world`` ranks living in one process (threads)."""

    def __init__(self, world: int):
        self.world = world
        self._boxes: list[list[Envelope]] = [[] for _ in range(world)]
        self._cond = threading.Condition()

    def transport(self, rank: int) -> "InProcTransport":
        """The endpoint of ``rank``."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} outside [0, {self.world})")
        return InProcTransport(self, rank)


class InProcTransport:
    """Endpoint of one rank of an :class:`InProcHub`."""

    def __init__(self, hub: InProcHub, rank: int):
        self.hub = hub
        self.rank = rank
        self.bytes_sent = 0

    def send(self, dst: int, env: Envelope) -> None:
        """Put ``env`` in ``dst``'s mailbox."""
        with self.hub._cond:
            self.hub._boxes[dst].append(env)
            self.hub._cond.notify_all()
        self.bytes_sent += len(env.body)

    def flush(self) -> None:
        """Nothing to wait for: delivery is immediate."""

    def recv(self, src: int | None = None, timeout: float | None = None) -> Envelope:
        """Oldest envelope for this rank (from ``src`` when given)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        box = self.hub._boxes[self.rank]
        with self.hub._cond:
            while True:
                for i, env in enumerate(box):
                    if src is None or env.sender == src:
                        return box.pop(i)
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TransportTimeout(f"rank {self.rank}: nothing from {src} within {timeout}s")
                self.hub._cond.wait(left)
