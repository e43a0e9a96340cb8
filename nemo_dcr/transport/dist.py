"""torch.distributed point-to-point transport over gloo (host tensors; also on GPU clusters).

Each envelope goes as a 2-element int64 head ``(nbytes, chunk_bytes)`` followed by
``ceil(nbytes / chunk_bytes)`` uint8 chunks, so neither side ever stages more than
``chunk_bytes * max_inflight`` extra bytes.  Sends are asynchronous (``isend``-style works on
the process group, at most ``max_inflight`` chunks in flight): the caller encodes the next bucket
while the previous one is on the wire, and calls :meth:`DistTransport.flush` at the end of a
version.  Receiving runs in one daemon thread per peer that blocks in a receive from that peer and
files whole envelopes into a mailbox; :meth:`DistTransport.recv` waits on the mailbox with a
timeout (a gloo wait that times out would close the connection), so no message is lost or split.

A peer that dies (its process killed) closes its connections: the receive from it raises at once
(gloo's "Connection closed by peer"; a receive from *any* peer would wait forever), and so does
every later send to it.  The transport then holds that peer as *lost*: :meth:`DistTransport.recv`
and :meth:`DistTransport.send` raise a :class:`TransportError` naming it (after the messages it
sent before dying were taken), so a refit sees the death as a clear error instead of a timeout.

Shutdown is a handshake: :meth:`DistTransport.close` sends a close head ``(-1, 0)`` to every other
rank of the group and waits until the receiver has taken one from each of them, so no receive is
left posted when the process exits.  (A receive still posted when a peer disconnects makes gloo
raise on a thread the finalizing interpreter can no longer serve, and the process aborts with
"terminate called without an active exception".)  Every rank of the group must call ``close``.

The process group is passed as a value (``torch.distributed.ProcessGroupGloo(store, rank,
size)`` or the default group), so a refit group of trainer and engine ranks can live next to
the trainer's own Megatron world.

It needs a gloo group: NCCL has no ``recv_anysource`` and takes device tensors only, which is why
``dcr.transport: nccl`` is refused by config validation (deltas are small; gloo carries them on
GPU clusters too).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import replace

import torch

from .base import Envelope, TransportError
from .mailbox import take

DEFAULT_CHUNK = 4 << 20
_TAG = 0
_CLOSE = -1


class DistTransport:
    """Envelope transport over a ``torch.distributed`` process group object.

    Args:
        pg: process group (ranks of the refit group); ``pg.send/recv/recv_anysource`` are used.
        rank: this process's rank in ``pg``.
        chunk_bytes: chunk size on the wire.
        max_inflight: chunks in flight per sender before ``send`` waits for the oldest.
    """

    def __init__(self, pg, rank: int, chunk_bytes: int = DEFAULT_CHUNK, max_inflight: int = 4):
        self.pg = pg
        self.rank = rank
        self.chunk_bytes = chunk_bytes
        self.max_inflight = max_inflight
        self.bytes_sent = 0
        self._inflight: deque = deque()
        self._send_lock = threading.Lock()  # sends may come from several threads (a hosted engine's server)
        self._box: list = []
        self._cond = threading.Condition()
        self._receivers: list[threading.Thread] = []
        self._closed_by: set[int] = set()
        self.lost: dict[int, TransportError] = {}
        """Peers whose connection broke (their process died), with the error naming them."""
        self._sized = hasattr(pg, "size")
        self._peers = {r for r in range(pg.size()) if r != rank} if self._sized else set()

    def _broken(self, peer: int, what: str, exc: Exception) -> TransportError:
        """Hold ``peer`` as lost (its connection broke); returns the error naming it."""
        with self._cond:
            if peer not in self.lost:
                self.lost[peer] = TransportError(f"rank {self.rank}: the connection to rank {peer} was lost while "
                                                 f"{what} (its process died?): {str(exc)[:300]}")
            self._cond.notify_all()
            return self.lost[peer]

    def _wait(self, work, dst: int) -> None:
        try:
            work.wait()
        except RuntimeError as exc:  # gloo: the peer's connection is closed
            raise self._broken(dst, "sending to it", exc) from None

    def _post(self, tensor: torch.Tensor, dst: int) -> None:
        while len(self._inflight) >= self.max_inflight:
            self._wait(*self._inflight.popleft()[::2])
        try:
            work = self.pg.send([tensor], dst, _TAG)
        except RuntimeError as exc:  # gloo refuses to post on a connection that already closed
            raise self._broken(dst, "sending to it", exc) from None
        self._inflight.append((work, tensor, dst))

    def send(self, dst: int, env: Envelope) -> None:
        """Queue ``env`` for ``dst``; returns once its last chunk is posted (thread-safe: the
        chunks of one envelope are never interleaved with another's).

        Raises:
            TransportError: ``dst`` (or a peer a pending send goes to) was lost.
        """
        if dst in self.lost:
            raise self.lost[dst]
        data = (env if env.receiver >= 0 else replace(env, receiver=dst)).to_bytes()
        with self._send_lock:
            self._post(torch.tensor([len(data), self.chunk_bytes], dtype=torch.int64), dst)
            for s in range(0, len(data), self.chunk_bytes):
                chunk = torch.frombuffer(bytearray(data[s:s + self.chunk_bytes]), dtype=torch.uint8)
                self._post(chunk, dst)
            self.bytes_sent += len(env.body)

    def flush(self) -> None:
        """Wait for every posted send.

        Raises:
            TransportError: a peer a pending send goes to was lost (the other sends are waited for).
        """
        failed = None
        with self._send_lock:
            while self._inflight:
                try:
                    self._wait(*self._inflight.popleft()[::2])
                except TransportError as exc:
                    failed = failed or exc
        if failed is not None:
            raise failed

    def _receive_loop(self, peer: int | None) -> None:
        """Envelopes from ``peer`` (from any peer when None: a group without ``size()``) into the
        mailbox until it closes or its connection breaks."""
        while peer is not None or not self._peers or not self._peers <= self._closed_by:
            head = torch.zeros(2, dtype=torch.int64)
            try:
                src = self._recv_head(head, peer)
                nbytes, chunk = int(head[0]), int(head[1])
                if nbytes == _CLOSE:
                    with self._cond:
                        self._closed_by.add(src)
                        self._cond.notify_all()
                    if peer is not None:
                        return
                    continue
                buf = bytearray(nbytes)
                for s in range(0, nbytes, chunk):
                    part = torch.empty(min(chunk, nbytes - s), dtype=torch.uint8)
                    self.pg.recv([part], src, _TAG).wait()
                    buf[s:s + part.numel()] = part.cpu().numpy().tobytes()
            except RuntimeError as exc:  # gloo: the peer's process died (only a receive from it says so)
                self._broken(peer, "receiving from it", exc)
                return
            try:
                env = Envelope.from_bytes(bytes(buf))
            except TransportError as exc:  # keep the loop alive; the caller sees the error
                env = exc
            with self._cond:
                self._box.append(env)
                self._cond.notify_all()

    def _recv_head(self, head: torch.Tensor, peer: int | None) -> int:
        if peer is not None:
            self.pg.recv([head], peer, _TAG).wait()
            return peer
        work = self.pg.recv_anysource([head], _TAG)
        work.wait()
        return work._source_rank()

    def _start_receiver(self) -> None:
        if not self._receivers:
            for peer in sorted(self._peers) if self._sized else [None]:
                th = threading.Thread(target=self._receive_loop, args=(peer,), daemon=True,
                                      name=f"refit-recv-{self.rank}-from-{'any' if peer is None else peer}")
                th.start()
                self._receivers.append(th)

    def close(self, timeout: float = 60.0) -> None:
        """Shut down cleanly: flush, tell every other rank, and wait for theirs (see module doc);
        lost peers are not waited for.

        Raises :class:`TransportError` naming the ranks that have not closed within ``timeout``;
        messages still unread in the mailbox are dropped.
        """
        if not self._sized:
            raise TransportError(f"rank {self.rank}: close needs a process group with size()")
        if not self._peers:
            return
        deadline = time.monotonic() + timeout
        try:
            self.flush()
        except TransportError:
            pass  # a lost peer: the others still get their close
        with self._cond:
            self._start_receiver()
        live = sorted(self._peers - set(self.lost))
        heads = [(self.pg.send([torch.tensor([_CLOSE, 0], dtype=torch.int64)], p, _TAG), p) for p in live]
        # a gloo send completes only once the peer has posted its receive: wait off this thread
        sent = threading.Thread(target=lambda: [self._closing(w, p) for w, p in heads], daemon=True,
                                name=f"refit-close-{self.rank}")
        sent.start()
        for th in [sent] + self._receivers:
            th.join(max(0.0, deadline - time.monotonic()))
        if sent.is_alive() or any(th.is_alive() for th in self._receivers):
            missing = sorted(self._peers - self._closed_by - set(self.lost))
            raise TransportError(f"rank {self.rank}: ranks {missing} did not close within {timeout}s")

    def _closing(self, work, peer: int) -> None:
        try:
            self._wait(work, peer)
        except TransportError:
            pass  # it died meanwhile: nothing to close

    def recv(self, src: int | None = None, timeout: float | None = None) -> Envelope:
        """Next envelope (from ``src`` when given).

        Raises:
            TransportTimeout: nothing arrived within ``timeout`` seconds.
            TransportError: a malformed envelope arrived, or ``src`` (with ``src`` None: any peer)
                was lost and every message it sent before was taken.
        """
        with self._cond:
            self._start_receiver()
            return take(self._box, self._cond, self.rank, src, timeout, self.lost)
