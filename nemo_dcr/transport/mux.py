"""Several ranks of the refit group in one process, over one process-level transport.

A colocated engine lives in a trainer process (the demo's transformers engine on trainer rank 0):
the refit group still has a rank for it (trainer ranks ``0..T-1``, engine ranks after them), but
no process of its own.  :class:`Mux` gives every rank hosted by this process an endpoint; a
message to a rank in this process goes to a local mailbox, any other through the base
transport (addressed to the process that hosts the rank), and whatever the base transport
delivers is filed by its ``receiver``.  Endpoints may be used from different threads (the engine
server thread and the trainer's main thread): one of them at a time pumps the base transport.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from typing import Mapping

from .base import Envelope, Transport, TransportError, TransportTimeout

_PUMP_S = 0.05


class Mux:
    """Endpoints for the ranks this process hosts.

    Args:
        base: this process's endpoint of a transport whose ranks are processes.
        host: refit-group rank -> rank of the process (in ``base``) that hosts it.
    """

    def __init__(self, base: Transport, host: Mapping[int, int]):
        self.base = base
        self.host = dict(host)
        self.local = sorted(r for r, h in self.host.items() if h == base.rank)
        self._boxes: dict[int, list[Envelope]] = {r: [] for r in self.local}
        self._cond = threading.Condition()
        self._pumping = False

    def endpoint(self, rank: int) -> "MuxEndpoint":
        """The endpoint of a rank hosted by this process."""
        if rank not in self._boxes:
            raise ValueError(f"rank {rank} is not hosted by process {self.base.rank} (hosts {self.local})")
        return MuxEndpoint(self, rank)

    def _deliver(self, env: Envelope) -> None:
        with self._cond:
            if env.receiver not in self._boxes:
                raise TransportError(f"process {self.base.rank} got a message for rank {env.receiver}, "
                                     f"which it does not host ({self.local})")
            self._boxes[env.receiver].append(env)
            self._cond.notify_all()

    def send(self, src: int, dst: int, env: Envelope) -> None:
        env = replace(env, receiver=dst)
        if dst not in self.host:
            raise TransportError(f"rank {src} sends to unknown rank {dst}; known {sorted(self.host)}")
        if self.host[dst] == self.base.rank:
            self._deliver(env)
        else:
            self.base.send(self.host[dst], env)

    def _take(self, rank: int, src: int | None) -> Envelope | None:
        box = self._boxes[rank]
        for i, env in enumerate(box):
            if src is None or env.sender == src:
                return box.pop(i)
        return None

    def recv(self, rank: int, src: int | None, timeout: float | None) -> Envelope:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._cond:
                while True:
                    env = self._take(rank, src)
                    if env is not None:
                        return env
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise TransportTimeout(f"rank {rank}: nothing from {src} within {timeout}s")
                    if not self._pumping:
                        self._pumping = True
                        break
                    self._cond.wait(_PUMP_S if left is None else min(left, _PUMP_S))
            self._pump(deadline)

    def _pump(self, deadline: float | None) -> None:
        try:
            left = _PUMP_S if deadline is None else max(0.0, min(_PUMP_S, deadline - time.monotonic()))
            env = self.base.recv(timeout=left)
        except TransportTimeout:
            env = None
        finally:
            with self._cond:
                self._pumping = False
                self._cond.notify_all()
        if env is not None:
            self._deliver(env)


class MuxEndpoint:
    """The transport endpoint of one hosted rank (see :class:`Mux`)."""

    def __init__(self, mux: Mux, rank: int):
        self.mux = mux
        self.rank = rank
        self.bytes_sent = 0

    def send(self, dst: int, env: Envelope) -> None:
        """Deliver ``env`` to refit-group rank ``dst`` (locally or through the base transport)."""
        self.mux.send(self.rank, dst, env)
        self.bytes_sent += len(env.body)

    def flush(self) -> None:
        """Wait until everything sent so far left this process."""
        self.mux.base.flush()

    def recv(self, src: int | None = None, timeout: float | None = None) -> Envelope:
        """Next envelope for this rank (from ``src`` when given)."""
        return self.mux.recv(self.rank, src, timeout)
