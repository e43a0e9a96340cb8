"""torch.distributed point-to-point transport over gloo (host tensors; also on GPU clusters).

Each envelope goes as a 2-element int64 head ``(nbytes, chunk_bytes)`` followed by
``ceil(nbytes / chunk_bytes)`` uint8 chunks, so neither side ever stages more than
``chunk_bytes * max_inflight`` extra bytes.  Sends are asynchronous (``isend``-style works on
the process group, at most ``max_inflight`` chunks in flight): the caller encodes the next bucket
while the previous one is on the wire, and calls :meth:`DistTransport.flush` at the end of a
version.  Receiving runs in one daemon thread per transport that blocks in ``recv_anysource`` and
files whole envelopes into a mailbox; :meth:`DistTransport.recv` waits on the mailbox with a
timeout (a gloo wait that times out would close the connection), so no message is lost or split.

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

from .base import Envelope, TransportError, TransportTimeout

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
        self._receiver: threading.Thread | None = None
        self._closed_by: set[int] = set()
        self._sized = hasattr(pg, "size")
        self._peers = {r for r in range(pg.size()) if r != rank} if self._sized else set()

    def _post(self, tensor: torch.Tensor, dst: int) -> None:
        while len(self._inflight) >= self.max_inflight:
            self._inflight.popleft()[0].wait()
        self._inflight.append((self.pg.send([tensor], dst, _TAG), tensor))

    def send(self, dst: int, env: Envelope) -> None:
        """Queue ``env`` for ``dst``; returns once its last chunk is posted (thread-safe: the
        chunks of one envelope are never interleaved with another's)."""
        data = (env if env.receiver >= 0 else replace(env, receiver=dst)).to_bytes()
        with self._send_lock:
            self._post(torch.tensor([len(data), self.chunk_bytes], dtype=torch.int64), dst)
            for s in range(0, len(data), self.chunk_bytes):
                chunk = torch.frombuffer(bytearray(data[s:s + self.chunk_bytes]), dtype=torch.uint8)
                self._post(chunk, dst)
            self.bytes_sent += len(env.body)

    def flush(self) -> None:
        """Wait for every posted send."""
        with self._send_lock:
            while self._inflight:
                self._inflight.popleft()[0].wait()

    def _receive_loop(self) -> None:
        while not self._peers or not self._peers <= self._closed_by:
            head = torch.zeros(2, dtype=torch.int64)
            work = self.pg.recv_anysource([head], _TAG)
            work.wait()
            peer = work._source_rank()
            nbytes, chunk = int(head[0]), int(head[1])
            if nbytes == _CLOSE:
                with self._cond:
                    self._closed_by.add(peer)
                    self._cond.notify_all()
                continue
            buf = bytearray(nbytes)
            for s in range(0, nbytes, chunk):
                part = torch.empty(min(chunk, nbytes - s), dtype=torch.uint8)
                self.pg.recv([part], peer, _TAG).wait()
                buf[s:s + part.numel()] = part.cpu().numpy().tobytes()
            try:
                env = Envelope.from_bytes(bytes(buf))
            except TransportError as exc:  # keep the loop alive; the caller sees the error
                env = exc
            with self._cond:
                self._box.append(env)
                self._cond.notify_all()

    def _start_receiver(self) -> None:
        if self._receiver is None:
            self._receiver = threading.Thread(target=self._receive_loop, daemon=True,
                                              name=f"refit-recv-{self.rank}")
            self._receiver.start()

    def close(self, timeout: float = 60.0) -> None:
        """Shut down cleanly: flush, tell every other rank, and wait for theirs (see module doc).

        Raises :class:`TransportError` naming the ranks that have not closed within ``timeout``;
        messages still unread in the mailbox are dropped.
        """
        if not self._sized:
            raise TransportError(f"rank {self.rank}: close needs a process group with size()")
        if not self._peers:
            return
        deadline = time.monotonic() + timeout
        self.flush()
        with self._cond:
            self._start_receiver()
        heads = [self.pg.send([torch.tensor([_CLOSE, 0], dtype=torch.int64)], p, _TAG) for p in sorted(self._peers)]
        # a gloo send completes only once the peer has posted its receive: wait off this thread
        sent = threading.Thread(target=lambda: [w.wait() for w in heads], daemon=True,
                                name=f"refit-close-{self.rank}")
        sent.start()
        for th in (sent, self._receiver):
            th.join(max(0.0, deadline - time.monotonic()))
        if sent.is_alive() or self._receiver.is_alive():
            missing = sorted(self._peers - self._closed_by)
            raise TransportError(f"rank {self.rank}: ranks {missing} did not close within {timeout}s")

    def recv(self, src: int | None = None, timeout: float | None = None) -> Envelope:
        """Next envelope (from ``src`` when given); raises :class:`TransportError` on timeout."""
        with self._cond:
            self._start_receiver()
            deadline = None if timeout is None else time.monotonic() + timeout
            while True:
                for i, env in enumerate(self._box):
                    if isinstance(env, TransportError) or src is None or env.sender == src:
                        got = self._box.pop(i)
                        if isinstance(got, TransportError):
                            raise got
                        return got
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TransportTimeout(f"rank {self.rank}: nothing from {src} within {timeout}s")
                self._cond.wait(left)
