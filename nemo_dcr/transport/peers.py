"""One connection per peer: a refit-group endpoint whose peers can be replaced one at a time.

A process group (gloo, NCCL) is fixed at its creation: a member whose process died cannot be
replaced by a restarted one without every member building a new group.  :class:`Peers` gives a
rank of the refit group one connection per peer instead, each an ordinary transport of two ranks
(e.g. a :class:`~nemo_dcr.transport.DistTransport` over a two-rank ``ProcessGroupGloo`` made from
a prefix of the job's store), and numbers envelopes by refit-group rank.  When a peer's process
died, its connection alone is lost (the transport says so at once, as for any dead peer); a
restarted process opens a fresh connection and :meth:`Peers.replace` puts it in the dead one's
place, the other connections untouched.

Inside a connection this side is rank ``0`` or ``1`` and the peer the other; the envelopes keep
their refit-group ``sender`` (set by the caller) and ``receiver`` (set here), so a connection
only carries them.
"""

from __future__ import annotations

import time
from dataclasses import replace as with_fields
from typing import Mapping

from .base import Envelope, Transport, TransportError, TransportTimeout

_POLL_S = 0.01


class Peers:
    """A refit-group endpoint over one two-rank connection per peer.

    Args:
        rank: this endpoint's refit-group rank.
        connections: peer refit-group rank -> ``(connection, the peer's rank in it)``.
    """

    def __init__(self, rank: int, connections: Mapping[int, tuple[Transport, int]]):
        self.rank = rank
        self._conns = dict(connections)
        self._rr = 0

    @property
    def peers(self) -> list[int]:
        """Refit-group ranks of the peers, sorted."""
        return sorted(self._conns)

    def replace(self, peer: int, connection: Transport, far: int) -> None:
        """Talk to ``peer`` over ``connection`` (where it is rank ``far``) from now on: its
        restarted process; the old connection (lost with the process) is dropped unread."""
        if peer not in self._conns:
            raise KeyError(f"rank {self.rank}: {peer} is not a peer of this endpoint (peers {self.peers})")
        self._conns[peer] = (connection, far)

    def _conn(self, peer: int) -> tuple[Transport, int]:
        try:
            return self._conns[peer]
        except KeyError:
            raise TransportError(f"rank {self.rank}: no connection to rank {peer} (peers {self.peers})") from None

    def send(self, dst: int, env: Envelope) -> None:
        """Send ``env`` to ``dst`` over its connection (addressed with refit-group ranks)."""
        conn, far = self._conn(dst)
        conn.send(far, env if env.receiver >= 0 else with_fields(env, receiver=dst))

    def flush(self) -> None:
        """Flush every connection; the first error is raised after all were flushed."""
        failed = None
        for conn, _ in list(self._conns.values()):
            try:
                conn.flush()
            except TransportError as exc:
                failed = failed or exc
        if failed is not None:
            raise failed

    def recv(self, src: int | None = None, timeout: float | None = None) -> Envelope:
        """Next envelope from ``src`` (any peer when None: the connections in turn).

        Raises:
            TransportTimeout: nothing arrived within ``timeout``.
            TransportError: ``src``'s connection failed (with ``src`` None: any peer's).
        """
        if src is not None or len(self._conns) == 1:  # one connection: its own wait, no polling
            return self._conn(self.peers[0] if src is None else src)[0].recv(None, timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            peers = self.peers
            for i in range(len(peers)):
                p = peers[(self._rr + i) % len(peers)]
                try:
                    env = self._conns[p][0].recv(None, 0.0)
                except TransportTimeout:
                    continue
                self._rr = (self._rr + i + 1) % len(peers)
                return env
            if deadline is not None and time.monotonic() >= deadline:
                raise TransportTimeout(f"rank {self.rank}: nothing from any peer within {timeout}s")
            time.sleep(_POLL_S)

    def close(self, timeout: float = 60.0) -> None:
        """Close every connection that has a ``close`` (each a handshake with its peer)."""
        deadline = time.monotonic() + timeout
        for conn, _ in list(self._conns.values()):
            if hasattr(conn, "close"):
                conn.close(max(0.0, deadline - time.monotonic()))
