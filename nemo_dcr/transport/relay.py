"""Fan-out inside the rollout cluster: one replica of an engine view (the *root*) receives a
version's payload envelopes across the slow link and relays the same bytes to the other replicas
of that view with ``torch.distributed.broadcast`` in the engines' own process group (gloo on CPU;
NCCL takes the same calls with device tensors).  No relay protocol of its own: one broadcast of the
envelope's length, one of its bytes (docs/wire_format.md section 7.1), in the root's order.

:class:`RelayEndpoint` wraps an engine rank's transport endpoint and is what its
:class:`~nemo_dcr.refit.server.EngineServer` reads from:

* on the root, every ``DELTA`` and ``RESYNC`` envelope it receives is broadcast before the server
  sees it (so the replicas collect, validate, apply, verify and acknowledge each version on their
  own, exactly as if the trainers had sent it to them), and a ``STOP`` ends the relay;
* on the other replicas, envelopes arrive from both the relay and the base transport (queries,
  a resync addressed to this replica alone, ``STOP``), merged in one mailbox.

A relay that fails anywhere (a replica's process died, the root's included) is counted in
:attr:`RelayStats.failed` and ends there: the member that saw the failure destroys its handle of
the group, which closes its connections, so the failure reaches every other member at once (gloo's
"Connection closed by peer") instead of leaving a replica waiting on a root that stopped relaying.
The group is then over for good; the trainers send its surviving replicas their parts directly
(:mod:`nemo_dcr.refit.replicas`), and a restarted replica is served over the base transport alone.
"""

from __future__ import annotations

import datetime
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .base import Envelope, MessageKind, Transport, TransportError, TransportTimeout
from .mailbox import take

RELAYED = (MessageKind.DELTA, MessageKind.RESYNC)
"""What the root relays: payload parts (and their end-of-version markers)."""
_CLOSE = -1
_PUMP_S = 0.1


@dataclass
class RelayStats:
    """What a relay moved, measured as it went.

    Attributes:
        envelopes: envelopes broadcast (root) or received from the relay (replica).
        body_bytes: payload bytes of those envelopes (once each).
        link_bytes: payload bytes put on the intra-cluster links: ``body_bytes`` times the other
            replicas of the group on the root (a one-to-all broadcast), 0 on a replica.
        failed: why the relay stopped before its end (empty: it did not).
    """

    envelopes: int = 0
    body_bytes: int = 0
    link_bytes: int = 0
    failed: str = ""
    by_version: dict[int, int] = field(default_factory=dict)
    """Target version -> ``link_bytes`` of its envelopes."""


class RelayEndpoint:
    """An engine rank's endpoint inside a relay group (see the module docstring).

    Args:
        base: this engine rank's endpoint of the refit group's transport.
        group: the ``torch.distributed`` process group of the view's replicas (this rank included).
        root: global rank (in the default process group) of the group's root.
        device: device of the broadcast buffers (``cpu`` for gloo, ``cuda`` for NCCL).
    """

    def __init__(self, base: Transport, group, root: int, device: str = "cpu"):
        self.base = base
        self.rank = base.rank
        self.group = group
        self.root = root
        self.device = device
        self.is_root = dist.get_rank() == root
        self.size = dist.get_world_size(group)
        self.stats = RelayStats()
        self._ended = False
        self._closed = False
        self._box: list = []
        self._cond = threading.Condition()
        self._threads: list[threading.Thread] = []
        if not self.is_root:
            for target, name in ((self._relay_loop, "relay"), (self._pump_loop, "pump")):
                th = threading.Thread(target=target, daemon=True, name=f"refit-{name}-{self.rank}")
                th.start()
                self._threads.append(th)

    # -- root -----------------------------------------------------------------------------------

    def _broadcast(self, data: bytes | None) -> None:
        head = torch.tensor([_CLOSE if data is None else len(data)], dtype=torch.int64, device=self.device)
        dist.broadcast(head, self.root, group=self.group)
        if data:
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
            dist.broadcast(buf, self.root, group=self.group)

    def _relay(self, env: Envelope) -> None:
        if self._ended or self.size == 1:
            return
        try:
            self._broadcast(env.to_bytes())
        except Exception as exc:  # a replica is gone: the group is over (the trainers go direct)
            self._ended = True
            self._fail(exc)
            return
        self.stats.envelopes += 1
        self.stats.body_bytes += len(env.body)
        moved = len(env.body) * (self.size - 1)
        self.stats.link_bytes += moved
        self.stats.by_version[env.version] = self.stats.by_version.get(env.version, 0) + moved

    def _fail(self, exc: Exception) -> None:
        """Record why the relay failed and close this member's connections of the group, so every
        other member's pending broadcast fails too (see the module docstring)."""
        self.stats.failed = f"{type(exc).__name__}: {str(exc)[:300]}"
        try:
            dist.destroy_process_group(self.group)
        except Exception as gone:  # already torn down (the default group went first): nothing left open
            self.stats.failed += f"; destroying the group: {type(gone).__name__}: {str(gone)[:200]}"

    def _end_relay(self) -> None:
        if self.is_root and not self._ended:
            self._ended = True
            if self.size > 1:
                self._broadcast(None)

    # -- replica --------------------------------------------------------------------------------

    def _file(self, item) -> None:
        with self._cond:
            self._box.append(item)
            self._cond.notify_all()

    def _relay_loop(self) -> None:
        try:
            while True:
                head = torch.zeros(1, dtype=torch.int64, device=self.device)
                dist.broadcast(head, self.root, group=self.group)
                n = int(head[0])
                if n == _CLOSE:
                    return
                buf = torch.empty(n, dtype=torch.uint8, device=self.device)
                dist.broadcast(buf, self.root, group=self.group)
                env = Envelope.from_bytes(buf.cpu().numpy().tobytes())
                self.stats.envelopes += 1
                self.stats.body_bytes += len(env.body)
                self._file(env)
        except Exception as exc:  # the root or a replica is gone: what it would have relayed never comes
            self._fail(exc)
        finally:
            self._ended = True

    def _pump_loop(self) -> None:
        while not self._closed:
            try:
                self._file(self.base.recv(timeout=_PUMP_S))
            except TransportTimeout:
                continue
            except TransportError as exc:  # the caller sees it on its next recv
                self._file(exc)

    # -- the transport contract -----------------------------------------------------------------

    def send(self, dst: int, env: Envelope) -> None:
        """Through the base transport (replies go straight to the trainers)."""
        self.base.send(dst, env)

    def flush(self) -> None:
        """Wait until the base transport's sends left."""
        self.base.flush()

    def recv(self, src: int | None = None, timeout: float | None = None) -> Envelope:
        """Next envelope for this rank; the root relays payload envelopes before returning them."""
        if self.is_root:
            env = self.base.recv(src, timeout)
            if env.kind in RELAYED:
                self._relay(env)
            elif env.kind == MessageKind.STOP:
                self._end_relay()
            return env
        with self._cond:
            return take(self._box, self._cond, self.rank, src, timeout)

    def close(self, timeout: float = 60.0) -> None:
        """End the relay (root: tell the replicas; replica: wait for the root's end), then close
        the base transport when it has a ``close``."""
        self._end_relay()
        deadline = time.monotonic() + timeout
        if not self.is_root:
            self._threads[0].join(max(0.0, deadline - time.monotonic()))
            self._closed = True
            self._threads[1].join(max(0.0, deadline - time.monotonic()))
            if self._threads[0].is_alive():
                raise TransportError(f"rank {self.rank}: the relay root did not end the relay within {timeout}s")
        if hasattr(self.base, "close"):
            self.base.close(max(0.0, deadline - time.monotonic()))


def relay_endpoint(base: Transport, groups: list[list[int]], world_rank: dict[int, int], device: str = "cpu",
                   timeout_s: float = 86400.0) -> Transport:
    """This engine rank's endpoint given the relay groups (refit-group ranks, root first; the same
    list on every engine process): a process group per group of two or more, made collectively by
    every engine process of the default process group in list order.

    Args:
        base: this engine rank's endpoint.
        groups: relay groups of engine ranks (root first), e.g. ``nemo_dcr.refit.relay.relay_groups``.
        world_rank: engine rank -> its rank in the engines' default process group.
        timeout_s: how long a replica may wait for the next relayed envelope (the gap between refits).

    Returns:
        a :class:`RelayEndpoint`, or ``base`` itself where this rank's group has no other replica.
    """
    mine = None
    for g in groups:
        if len(g) < 2:
            continue
        pg = dist.new_group([world_rank[e] for e in g], timeout=datetime.timedelta(seconds=timeout_s),
                            backend="gloo" if device == "cpu" else None)
        if base.rank in g:
            mine = RelayEndpoint(base, pg, world_rank[g[0]], device)
    return base if mine is None else mine
