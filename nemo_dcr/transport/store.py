"""Files and object stores through fsspec URLs (``file://``, ``memory://``, ``s3://``, ...).

Layout: every message is one object ``<url>/to-<dst>/run-<R>/from-<src>/<seq>.env`` (``seq``:
16 digits, counting from 0 per sender and receiver), written under ``.tmp-<random>`` in the
same folder and renamed into place (atomic on POSIX filesystems; object stores publish a PUT
atomically), so a reader never sees half a message.

The object is an authenticated frame: magic, run id, sender, receiver and sequence number, the
envelope bytes, then HMAC-SHA256 over all of it with the refit key. Names only say where to
look: a receiver reads exactly the next name it expects from each sender and checks the frame
against it. So a store shared across clusters cannot inject or alter messages (the MAC; such an
object raises :class:`TransportError`), re-address them to another sender or receiver, replay
consumed ones, or deliver leftovers of an earlier run that used the same URL and key (the run
id: random per transport group, agreed by all its endpoints); those objects are dropped with a
:class:`StoreWarning` and counted in :attr:`StoreTransport.stats`. Order is by sequence number,
never by clock. A receive costs one listing of the run folder (one entry per sender) and one
read, whatever the backlog; while idle a receiver sweeps its folders at most every ``sweep_s``:
it warns once about stray files and other runs' folders (never read), removes replayed objects
and temp files abandoned for ``tmp_stale_s``, and skips past messages removed from the store.

**Shared bodies** (``share_bodies``, local filesystems): a body of at least ``share_min_bytes``
travels beside its frame as ``<seq>.body``, and the frame (version 2) carries the body's length
and SHA-256 instead of the body, under the same MAC; the receiver checks both before the
envelope is returned.  The sender writes each distinct body once into its *staging* folder
(``<url>/staged-<sender>/run-<R>/``) and hard-links it as the ``<seq>.body`` of every receiver it
is sent to, so receivers that get the same bytes (data-parallel engine replicas) share one copy
on disk; each receiver deletes its frame and its link when it consumes them, and the sender's
:meth:`StoreTransport.release` deletes the staged names (the data is freed when the last link
goes).  Where a hard link cannot be made, the body is written again for that receiver (one
warning).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import struct
import time
import uuid
import warnings
from dataclasses import replace

from .base import Envelope, TransportError, TransportTimeout

MAC_BYTES = 32
MIN_KEY_BYTES = 16
"""The key rule of docs/wire_format.md rule 5 (``nemo_dcr.codec.auth.MIN_KEY_BYTES``; a test keeps them equal)."""
_FRAME = struct.Struct("<4sB16siiQ")  # magic, frame version, run id, sender, receiver, sequence
_BODY = struct.Struct("<Q32s")  # frame version 2: body length, SHA-256 of the body (after the envelope head)
_MAGIC = b"NDCS"
_SEQ = re.compile(r"^(\d{16})\.env$")
_BODY_NAME = re.compile(r"^(\d{16})\.body$")
SHARE_MIN_BYTES = 1 << 12
"""Default smallest body that travels as a shared ``<seq>.body`` (``share_bodies``)."""
_FROM = re.compile(r"^from-(\d{1,9})$")


class StoreWarning(UserWarning):
    """An object in the store was ignored or removed (stray, replayed, re-addressed, another run)."""


def new_run_id() -> str:
    """A fresh random run identity (share it with every endpoint of the transport group)."""
    return secrets.token_hex(16)


class StoreTransport:
    """Envelope transport over a directory-like fsspec URL.

    Args:
        url: base URL shared by all ranks.
        rank: this endpoint's rank.
        key: HMAC key (raw bytes, at least 16) shared by all ranks.
        run: identity of this transport group's run, the same for all its endpoints (any text;
            default: a fresh random one, for endpoints created together in one process).
        poll_s: interval between looks while waiting.
        share_bodies: write each distinct body of at least ``share_min_bytes`` once and hard-link
            it for every receiver it is sent to (module docstring); the caller calls
            :meth:`release` once the sends that may repeat a body are done.
        share_min_bytes: see ``share_bodies``.

    Attributes:
        bytes_sent: envelope body bytes sent (every receiver counted).
        bytes_written: bytes this endpoint wrote into the store (frames and bodies; a shared
            body once).
    """

    sweep_s = 1.0
    """While idle, sweep this endpoint's folders at most this often (seconds)."""
    tmp_stale_s = 300.0
    """A temp file seen for this long (receiver's clock) belongs to a writer that died: removed."""

    def __init__(self, url: str, rank: int, key: bytes, run: str | None = None, poll_s: float = 0.01,
                 share_bodies: bool = False, share_min_bytes: int = SHARE_MIN_BYTES):
        import fsspec

        if len(key) < MIN_KEY_BYTES:
            raise ValueError(f"the store transport needs an HMAC key of at least {MIN_KEY_BYTES} bytes, got {len(key)}")
        self.fs, self.root = fsspec.core.url_to_fs(url)
        self.root = self.root.rstrip("/")
        self.rank, self.key, self.poll_s = rank, key, poll_s
        self.run = new_run_id() if run is None else str(run)
        self._run_id = hashlib.sha256(self.run.encode()).digest()[:16]
        self.bytes_sent = 0
        self.bytes_written = 0
        self.stats = {"replays": 0, "other_run": 0, "misaddressed": 0, "strays": 0, "tmp_removed": 0, "lost": 0,
                      "unremoved": 0, "shared": 0}
        self.share_bodies = bool(share_bodies) and hasattr(self.fs, "link")
        self.share_min_bytes = int(share_min_bytes)
        self._staged: dict[bytes, str] = {}
        self._send_seq: dict[int, int] = {}
        self._next: dict[int, int] = {}
        self._rr = 0
        self._last_sweep = float("-inf")
        self._noted: set[str] = set()
        self._tmp_seen: dict[str, float] = {}
        self.fs.makedirs(self._run_dir(rank), exist_ok=True)

    def _run_dir(self, dst: int) -> str:
        return f"{self.root}/to-{dst}/run-{self._run_id.hex()}"

    def _mac(self, frame: bytes) -> bytes:
        return hmac.new(self.key, frame, hashlib.sha256).digest()

    def send(self, dst: int, env: Envelope) -> None:
        """Write the authenticated frame atomically as ``dst``'s next message from this rank (with
        ``share_bodies``, a large body first, as a link to its staged copy).

        Raises:
            TransportError: the store refused the write (a full disk, a read-only folder, a lost
                connection: the OS error named); nothing was published, the temp file and the
                body written for it are removed (as far as the store allows) and the next send
                tries the same sequence number.
        """
        env = env if env.receiver >= 0 else replace(env, receiver=dst)
        seq = self._send_seq.get(dst, 0)
        folder = f"{self._run_dir(dst)}/from-{self.rank}"
        shared = self.share_bodies and len(env.body) >= self.share_min_bytes
        head = _FRAME.pack(_MAGIC, 2 if shared else 1, self._run_id, self.rank, dst, seq)
        if shared:
            digest = hashlib.sha256(env.body).digest()
            frame = head + replace(env, body=b"").to_bytes() + _BODY.pack(len(env.body), digest)
        else:
            frame = head + env.to_bytes()
        body_path = f"{folder}/{seq:016d}.body"
        made: list[str] = []
        try:
            self.fs.makedirs(folder, exist_ok=True)
            if shared:
                self._place_body(env.body, digest, body_path, made)
            self._write(f"{folder}/{seq:016d}.env", frame + self._mac(frame), made)
        except OSError as exc:
            self._undo(made)
            raise TransportError(f"rank {self.rank}: could not write message #{seq} for rank {dst} under {folder}: "
                                 f"{exc}") from exc
        except BaseException:
            self._undo(made)
            raise
        self._send_seq[dst] = seq + 1
        self.bytes_sent += len(env.body)

    def _write(self, path: str, data: bytes, made: list[str]) -> None:
        """Write ``data`` under a temp name in ``path``'s folder and rename it into place; ``made``
        gets what exists once this returns or raises (for :meth:`_undo`)."""
        tmp = f"{path.rsplit('/', 1)[0]}/.tmp-{uuid.uuid4().hex}"
        made.append(tmp)
        with self.fs.open(tmp, "wb") as f:
            f.write(data)
        self.fs.mv(tmp, path)
        made[made.index(tmp)] = path
        self.bytes_written += len(data)

    def _place_body(self, body: bytes, digest: bytes, path: str, made: list[str], again: bool = True) -> None:
        """``path`` holds ``body``: a hard link to its staged copy (staged now if it is new)."""
        staged = self._staged.get(digest)
        if staged is None:
            staged = f"{self.root}/staged-{self.rank}/run-{self._run_id.hex()}/{digest.hex()}.body"
            self.fs.makedirs(staged.rsplit("/", 1)[0], exist_ok=True)
            self._write(staged, body, made)
            made.remove(staged)  # kept for the next receiver until release(), even when this send fails
            self._staged[digest] = staged
        else:
            self.stats["shared"] += 1
        try:
            self.fs.link(staged, path)
            made.append(path)
        except FileNotFoundError:  # the staged copy was removed behind this endpoint's back: stage it again
            del self._staged[digest]
            if not again:
                raise
            self._place_body(body, digest, path, made, again=False)
        except OSError as exc:  # no hard links on this filesystem: a copy per receiver from now on
            self.share_bodies = False
            warnings.warn(f"{path}: cannot hard-link bodies here ({exc}); each receiver gets its own copy",
                          StoreWarning, stacklevel=4)
            self._write(path, body, made)

    def _undo(self, made: list[str]) -> None:
        for path in made:
            self._remove(path, quiet=True)

    def release(self) -> list[str]:
        """Delete the staged bodies (``share_bodies``): links already made stay readable; a body sent
        again is staged again.  Returns the names deleted."""
        gone = [p for p in self._staged.values() if self._remove(p, quiet=True)]
        self._staged = {}
        return gone

    def flush(self) -> None:
        """Writes are synchronous."""

    def recv(self, src: int | None = None, timeout: float | None = None) -> Envelope:
        """The next authenticated envelope from ``src`` (any sender when None).

        Raises:
            TransportTimeout: nothing arrived within ``timeout`` seconds.
            TransportError: an object at an expected name fails its MAC (removed).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            env = self._poll(src)
            if env is not None:
                return env
            if time.monotonic() - self._last_sweep >= self.sweep_s:
                self._sweep()
            if deadline is not None and time.monotonic() > deadline:
                raise TransportTimeout(f"rank {self.rank}: nothing from {'any sender' if src is None else src} "
                                       f"in {self._run_dir(self.rank)} within {timeout}s")
            time.sleep(self.poll_s)

    def _poll(self, src: int | None) -> Envelope | None:
        senders = [src] if src is not None else self._senders()
        for i in range(len(senders)):
            s = senders[(self._rr + i) % len(senders)]
            env = self._take(s)
            if env is not None:
                self._rr = (self._rr + i + 1) % len(senders)
                return env
        return None

    def _senders(self) -> list[int]:
        """Senders that have a folder in this run (one listing: an entry per sender)."""
        out = []
        for path in self._ls(self._run_dir(self.rank)):
            name = path.rsplit("/", 1)[-1]
            m = _FROM.match(name)
            if m:
                out.append(int(m.group(1)))
            elif self._note(path):
                self.stats["strays"] += 1
                warnings.warn(f"{path}: stray object in a run folder, ignored", StoreWarning, stacklevel=4)
        return sorted(out)

    def _take(self, src: int) -> Envelope | None:
        seq = self._next.get(src, 0)
        path = f"{self._run_dir(self.rank)}/from-{src}/{seq:016d}.env"
        try:
            raw = self.fs.cat_file(path)
        except FileNotFoundError:
            return None
        self._remove(path, quiet=True)  # consumed or refused: read once (by sequence number, if it cannot go)
        body_path = path[:-len(".env")] + ".body"
        try:
            head = self._open(path, raw)
            problem = self._check(head, src, seq)
            if problem:
                warnings.warn(f"{path}: {problem[1]}; dropped", StoreWarning, stacklevel=4)
                self.stats[problem[0]] += 1
                return None
            self._next[src] = seq + 1
            if head[1] == 1:
                return Envelope.from_bytes(raw[_FRAME.size:-MAC_BYTES])
            return self._with_body(body_path, raw[_FRAME.size:-MAC_BYTES])
        finally:
            if raw[4:5] == b"\x02":
                self._remove(body_path, quiet=True)

    def _with_body(self, path: str, section: bytes) -> Envelope:
        """The envelope of an authenticated version-2 frame with its body read from ``path``.

        Raises:
            TransportError: the body is missing, or its length or SHA-256 is not the frame's.
        """
        if len(section) < _BODY.size:
            raise TransportError(f"{path}: version-2 frame too short for its body reference")
        size, digest = _BODY.unpack(section[-_BODY.size:])
        try:
            body = self.fs.cat_file(path)
        except FileNotFoundError:
            raise TransportError(f"{path}: the body of an authenticated frame is missing from the store") from None
        if len(body) != size or not hmac.compare_digest(hashlib.sha256(body).digest(), digest):
            raise TransportError(f"{path}: body of {len(body)} bytes does not match its frame's length {size} and "
                                 "SHA-256 (altered or truncated)")
        return replace(Envelope.from_bytes(section[:-_BODY.size]), body=body)

    def _open(self, path: str, raw: bytes) -> tuple:
        frame = raw[:-MAC_BYTES]
        if len(raw) < _FRAME.size + MAC_BYTES or not hmac.compare_digest(raw[-MAC_BYTES:], self._mac(frame)):
            raise TransportError(f"{path}: envelope MAC does not match (tampered, truncated or another key)")
        head = _FRAME.unpack_from(raw)
        if head[0] != _MAGIC or head[1] not in (1, 2):
            raise TransportError(f"{path}: authenticated object is not a version-1 or 2 store frame")
        return head

    def _check(self, head: tuple, src: int, seq: int) -> tuple[str, str] | None:
        _, _, run, sender, receiver, got_seq = head
        if run != self._run_id:
            return "other_run", "message of another run (a leftover with the same URL and key)"
        if sender != src or receiver != self.rank:
            return "misaddressed", f"message from {sender} to {receiver} found where {src} -> {self.rank} belongs"
        if got_seq != seq:
            return "replays", f"message #{got_seq} found where #{seq} belongs (a replay)"
        return None

    def _sweep(self) -> None:
        """Warn about strays and other runs, remove replays and abandoned temp files, skip lost messages."""
        self._last_sweep = time.monotonic()
        mine = self._run_dir(self.rank)
        for path in self._ls(mine.rsplit("/", 1)[0]):
            if path != mine and self._note(path):
                self.stats["strays"] += 1
                warnings.warn(f"{path}: not this run's folder (another run's leftovers, or a stray); never read",
                              StoreWarning, stacklevel=4)
        for src in self._senders():
            self._sweep_sender(src, f"{mine}/from-{src}")

    def _sweep_sender(self, src: int, folder: str) -> None:
        expected, ahead = self._next.get(src, 0), []
        for path in self._ls(folder):
            name = path.rsplit("/", 1)[-1]
            m = _SEQ.match(name)
            b = _BODY_NAME.match(name)
            if b:  # a frame's body: read with its frame; one left behind a consumed frame is removed
                if int(b.group(1)) < expected:
                    self._remove(path, quiet=True)
            elif name.startswith(".tmp-"):
                first = self._tmp_seen.setdefault(path, time.monotonic())
                if time.monotonic() - first >= self.tmp_stale_s and self._remove(path, quiet=True):
                    self._tmp_seen.pop(path, None)
                    self.stats["tmp_removed"] += 1
            elif m and int(m.group(1)) < expected:
                if self._remove(path, quiet=True):
                    self.stats["replays"] += 1
                    warnings.warn(f"{path}: message #{int(m.group(1))} was already received (a replay); removed",
                                  StoreWarning, stacklevel=5)
            elif m:
                ahead.append(int(m.group(1)))
            elif self._note(path):
                self.stats["strays"] += 1
                warnings.warn(f"{path}: stray object, ignored", StoreWarning, stacklevel=5)
        if ahead and expected not in ahead:  # senders publish in order: the ones before are gone
            self.stats["lost"] += min(ahead) - expected
            warnings.warn(f"{folder}: messages #{expected}..#{min(ahead) - 1} from rank {src} are missing from the "
                          f"store; continuing at #{min(ahead)}", StoreWarning, stacklevel=5)
            self._next[src] = min(ahead)

    def _ls(self, folder: str) -> list[str]:
        try:
            return [p.rstrip("/") for p in self.fs.ls(folder, detail=False)]
        except FileNotFoundError:
            return []

    def _note(self, path: str) -> bool:
        """True the first time ``path`` is seen (warn once per object)."""
        if path in self._noted:
            return False
        self._noted.add(path)
        return True

    def _remove(self, path: str, quiet: bool = False) -> bool:
        """Remove ``path`` (True: it is gone); with ``quiet`` a store that refuses (a read-only
        folder) is warned about once and counted (``unremoved``), not raised: the object is never
        read again by its name, and a later sweep retries."""
        try:
            self.fs.rm(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            if not quiet:
                raise
            if self._note(f"unremoved:{path}"):
                self.stats["unremoved"] += 1
                warnings.warn(f"{path}: could not remove it ({exc}); never read again", StoreWarning, stacklevel=4)
            return False
        return True
