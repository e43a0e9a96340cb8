"""Typed bodies of engine replies (JSON on the wire)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass(frozen=True)
class EngineReply:
    """ACK, NACK or STATE from an engine rank.

    Attributes:
        ok: committed (ACK) or answered (STATE); False for a NACK.
        version: the engine's version after handling the message.
        reason: why it refused (NACK), with the exception type.
        checksums: per-tensor checksums (incremental, or full when asked).
        digests: sha256 of each tensor's bits (only when asked: independent of the checksum).
        touched: elements written per tensor (ACK).
        placement: the engine rank's placement (answer to ``QUERY_PLACEMENT``).
        views: per-tensor checksums of the elements this engine rank holds, in its view index
            space (engines holding shards; replicas included, unlike ``checksums``).
    """

    ok: bool
    version: int
    reason: str = ""
    checksums: dict[str, int] = field(default_factory=dict)
    digests: dict[str, str] = field(default_factory=dict)
    touched: dict[str, int] = field(default_factory=dict)
    placement: dict = field(default_factory=dict)
    views: dict[str, int] = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        """JSON (checksums as 16 hex digits)."""
        return json.dumps(dict(ok=self.ok, version=self.version, reason=self.reason,
                               checksums={k: f"{v:016x}" for k, v in self.checksums.items()},
                               digests=self.digests, touched=self.touched, placement=self.placement,
                               views={k: f"{v:016x}" for k, v in self.views.items()})).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> "EngineReply":
        """Inverse of :meth:`to_bytes`."""
        o = json.loads(data)
        return cls(o["ok"], o["version"], o["reason"], {k: int(v, 16) for k, v in o["checksums"].items()},
                   o["digests"], o["touched"], o.get("placement", {}),
                   {k: int(v, 16) for k, v in o.get("views", {}).items()})


QUERY_INCREMENTAL = 0
"""Version and the incremental checksums."""
QUERY_FULL = 1
"""Version and checksums by a full scan."""
QUERY_DIGESTS = 2
"""Also sha256 digests of every tensor (tests and chaos: an equality check independent of checksums)."""
QUERY_PLACEMENT = 3
"""Version and the engine's placement (JSON form of :mod:`nemo_dcr.apply.placement`; empty: the
engine holds canonical tensors whole)."""
