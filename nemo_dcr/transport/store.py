"""Files and object stores through fsspec URLs (``file://``, ``memory://``, ``s3://``, ...).

Every envelope becomes one object ``<url>/to-<dst>/<seq>-<sender>.env``, written under a
temporary name and renamed into place (atomic on POSIX filesystems; object stores publish a
PUT atomically), so a reader never sees half a message.  The object is the envelope bytes
followed by an HMAC-SHA256 over them (the refit key), so a store that is shared across
clusters cannot inject, alter or re-address messages; delta bodies additionally carry the
codec's own MAC.  Readers delete what they consumed.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import time
import uuid

from .base import Envelope, TransportError, TransportTimeout

MAC_BYTES = 32


class StoreTransport:
    """Envelope transport over a directory-like fsspec URL.

    Args:
        url: base URL shared by all ranks.
        rank: this process's rank.
        key: HMAC key (at least 16 bytes) shared by all ranks.
        poll_s: listing interval while waiting.
    """

    def __init__(self, url: str, rank: int, key: bytes, poll_s: float = 0.01):
        import fsspec

        if len(key) < 16:
            raise ValueError("the store transport needs an HMAC key of at least 16 bytes")
        self.fs, self.root = fsspec.core.url_to_fs(url)
        self.rank = rank
        self.key = key
        self.poll_s = poll_s
        self.bytes_sent = 0
        self._seq = itertools.count()
        self.fs.makedirs(self._box(rank), exist_ok=True)

    def _box(self, rank: int) -> str:
        return f"{self.root.rstrip('/')}/to-{rank}"

    def _mac(self, dst: int, data: bytes) -> bytes:
        return hmac.new(self.key, dst.to_bytes(4, "little") + data, hashlib.sha256).digest()

    def send(self, dst: int, env: Envelope) -> None:
        """Write the authenticated envelope atomically into ``dst``'s folder."""
        data = env.to_bytes()
        box = self._box(dst)
        self.fs.makedirs(box, exist_ok=True)
        name = f"{time.time_ns():020d}-{next(self._seq):08d}-{self.rank:05d}.env"
        tmp = f"{box}/.tmp-{uuid.uuid4().hex}"
        with self.fs.open(tmp, "wb") as f:
            f.write(data + self._mac(dst, data))
        self.fs.mv(tmp, f"{box}/{name}")
        self.bytes_sent += len(data)

    def flush(self) -> None:
        """Writes are synchronous."""

    def _next(self, src: int | None) -> str | None:
        for path in sorted(self.fs.ls(self._box(self.rank), detail=False)):
            base = path.rsplit("/", 1)[-1]
            if base.startswith(".tmp-") or not base.endswith(".env"):
                continue
            if src is None or int(base[:-4].rsplit("-", 1)[1]) == src:
                return path
        return None

    def recv(self, src: int | None = None, timeout: float | None = None) -> Envelope:
        """Oldest authenticated envelope for this rank; a bad MAC raises and is deleted."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while (path := self._next(src)) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise TransportTimeout(f"rank {self.rank}: nothing in {self._box(self.rank)} within {timeout}s")
            time.sleep(self.poll_s)
        with self.fs.open(path, "rb") as f:
            raw = f.read()
        self.fs.rm(path)
        data, mac = raw[:-MAC_BYTES], raw[-MAC_BYTES:]
        if len(raw) < MAC_BYTES or not hmac.compare_digest(mac, self._mac(self.rank, data)):
            raise TransportError(f"{path}: envelope MAC does not match (tampered, re-addressed or wrong key)")
        return Envelope.from_bytes(data)
