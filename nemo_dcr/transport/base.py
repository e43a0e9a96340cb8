"""Messages between trainer ranks and engine ranks, and the transport contract.

Every transport moves :class:`Envelope` values between integer ranks of one refit group
(trainer ranks first, then engine ranks); their bytes are written down in docs/wire_format.md
section 7.1.  Bodies are opaque bytes here: delta payloads are authenticated by the codec's HMAC
(docs/wire_format.md rule 5); transports that cross a trust boundary (files, object stores) also
authenticate the envelope itself (section 7.2).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum
from typing import Protocol


class MessageKind(IntEnum):
    """What an envelope carries."""

    DELTA = 1
    """One part of a sparse refit payload (engine applies all parts of a version at once)."""
    RESYNC = 2
    """One part of a full resync payload (encoded against zeros)."""
    ACK = 3
    """Engine committed ``version``; body: an engine reply (JSON) with checksums."""
    NACK = 4
    """Engine refused or rolled back ``version``; body: an engine reply with the reason."""
    ROUTE = 5
    """Trainer to trainer: one collective's buffer (``version``: its sequence number), e.g. a
    routing pack of canonical sparse changes for tensors the receiver owns."""
    QUERY = 6
    """Ask an engine rank for its state; ``version`` 0, body: a query (JSON: what it asks)."""
    STATE = 7
    """Engine's answer to a QUERY; ``version``: the engine's, body: an engine reply naming the query."""
    STOP = 8
    """Shut the engine loop down."""
    DENSE = 9
    """Whole tensors' raw bytes without the codec: the dense baseline ``benchmarks/refit.py`` measures."""
    END = 10
    """Trainer to engine: this sync (every refit and resync of it) is over; ``version`` is the version
    the engines hold afterwards, the body a JSON outcome (the NeMo-RL plugin's receivers stop on it)."""


class TransportError(RuntimeError):
    """A message could not be sent or received (timeout, closed peer, bad envelope MAC)."""


class TransportTimeout(TransportError):
    """Nothing arrived within the timeout (the transport itself is fine)."""


class TransportUnavailableError(TransportError):
    """The transport needs hardware or a package this process does not have."""


_HEAD = struct.Struct("<4sBqiiBii")
_MAGIC = b"NDCE"


@dataclass(frozen=True)
class Envelope:
    """One message.

    Attributes:
        kind: what the body is.
        version: the target version it is about.
        sender: rank of the sender.
        part: index of this part among the sender's parts of ``version``.
        last: this is the sender's last part of ``version``.
        body: payload bytes (opaque to the transport).
        receiver: rank it is addressed to (set by the sending endpoint; -1: not yet sent).
        shard: which shard of the receiving engine a payload part is for (an engine rank that
            serves several shards, e.g. vLLM's tensor-parallel ranks behind one driver; 0 otherwise).
    """

    kind: MessageKind
    version: int
    sender: int
    part: int = 0
    last: bool = True
    body: bytes = b""
    receiver: int = -1
    shard: int = 0

    def to_bytes(self) -> bytes:
        """Fixed 30-byte head followed by the body."""
        return _HEAD.pack(_MAGIC, int(self.kind), self.version, self.sender, self.part,
                          int(self.last), self.receiver, self.shard) + self.body

    @classmethod
    def from_bytes(cls, data: bytes) -> "Envelope":
        """Inverse of :meth:`to_bytes`; raises :class:`TransportError` on a malformed head."""
        if len(data) < _HEAD.size:
            raise TransportError(f"envelope of {len(data)} bytes is shorter than its {_HEAD.size}-byte head")
        magic, kind, version, sender, part, last, receiver, shard = _HEAD.unpack_from(data)
        checks = (("magic", magic, magic == _MAGIC), ("kind", kind, kind in MessageKind._value2member_map_),
                  ("last flag", last, last <= 1), ("sender", sender, sender >= 0), ("part", part, part >= 0),
                  ("receiver", receiver, receiver >= -1), ("shard", shard, shard >= 0))
        bad = [(what, value) for what, value, ok in checks if not ok]
        if bad:
            raise TransportError(f"malformed envelope head: {bad[0][0]} {bad[0][1]!r} "
                                 f"(head {bytes(data[:_HEAD.size]).hex()})")
        return cls(MessageKind(kind), version, sender, part, bool(last), bytes(data[_HEAD.size:]), receiver, shard)


class Transport(Protocol):
    """Point-to-point delivery of envelopes, in order per (sender, receiver) pair."""

    rank: int

    def send(self, dst: int, env: Envelope) -> None:
        """Deliver ``env`` to ``dst`` (may return before delivery; see ``flush``)."""

    def flush(self) -> None:
        """Wait until every message sent so far left this process."""

    def recv(self, src: int | None = None, timeout: float | None = None) -> Envelope:
        """Next envelope for this rank (from ``src`` only, when given).

        Raises:
            TransportTimeout: nothing arrived within ``timeout`` seconds.
            TransportError: the transport failed (a malformed or unauthenticated message).
        """
