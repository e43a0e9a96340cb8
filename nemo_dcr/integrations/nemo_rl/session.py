"""Sessions of the NeMo-RL plugin: who takes part, where their messages live, what is cleaned up.

NeMo-RL hands every checkpoint engine the list of all engines' ``prepare()`` results (policy
workers by rank, then vLLM workers by rollout rank) in ``init_*_process_group``.  Each engine puts
a random *nonce* there (made once per engine object); a **session** is the set of engine objects
of one ``init_communicator``, named by a hash of all nonces, so every party derives the same name
without talking, a restarted policy or rollout worker (a new engine object) starts a new session,
and NeMo-RL re-initialising the same objects (``release_after_refit``) keeps it.  The rollout
workers also publish the canonical table and their placements there (compressed JSON).  The
layout of every entry is written down in docs/wire_format.md section 7.6.

Messages travel over the store transport (:class:`~nemo_dcr.transport.StoreTransport`, HMAC-keyed)
in ``<url>/session-<id>/sync-<n>/``: a folder per sync (:class:`SyncTransport`), numbered by each
side's count of ``send_weights`` / ``receive_weight_batches`` calls in the session (NeMo-RL calls
both once per ``sync_weights``), so leftovers of a failed sync never meet the next one.  A sync
has up to :data:`ATTEMPTS` attempts, the second (``sync-<n>.1``) a resync after the first failed:
whoever fails an attempt sends an ``END`` envelope with a failed :class:`SyncOutcome` to every
other party, and every policy endpoint waiting in that attempt gets it as :class:`SyncAborted`
(:meth:`SyncTransport.recv` watches every sender, so no party waits for a peer that gave up).
The store transport deletes what it consumed; each endpoint deletes its own inboxes of earlier
syncs and policy rank 0 deletes earlier sync folders and other sessions (:func:`remove_stale`).
Large bodies are shared (``StoreTransport(share_bodies=True)``): a payload part a policy worker
sends to several vLLM workers (data-parallel replicas holding the same views get the same bytes)
is written once and hard-linked for each of them; the staged copies are released at the end of
every attempt (:meth:`SyncTransport.release`).
"""

from __future__ import annotations

import hashlib
import json
import re
import time
import uuid
import zlib
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Sequence

from nemo_dcr.apply.placement import TensorPlacement, placement_from_json
from nemo_dcr.transport import Envelope, MessageKind, StoreTransport
from nemo_dcr.transport.base import TransportTimeout

TAG = "nemo_dcr"
"""Key marking metadata produced by this plugin."""

ATTEMPTS = 2
"""Attempts of one sync: the refit, then (after a failure anywhere) a resync through the same path."""

ENTRY_KEYS = {"policy": ("nonce",), "rollout": ("nonce", "table", "table_sha", "placement", "placed")}
"""Keys an entry of each role carries besides :data:`TAG` (NeMo-RL may add its own, e.g. ``rank``)."""


def new_nonce() -> str:
    """A random identity for one engine object."""
    return uuid.uuid4().hex


def pack(obj: Any) -> bytes:
    """Compressed JSON (placements are large and repetitive)."""
    return zlib.compress(json.dumps(obj).encode(), 6)


def unpack(blob: bytes) -> Any:
    """Inverse of :func:`pack`."""
    return json.loads(zlib.decompress(blob))


@dataclass(frozen=True)
class Topology:
    """What NeMo-RL's metadata says about one session.

    Attributes:
        session: name of the session (hash of every engine's nonce, in metadata order).
        folder: the session's folder under the shared ``url``.
        train_world: policy workers (refit-group ranks ``0..T-1``).
        rollout_world: vLLM workers (refit-group ranks ``T..T+R-1``).
        table: canonical tensors the refit carries, name -> (wire dtype, shape): the export's
            tensors (from the vLLM workers' ``state_dict_info``) that some vLLM worker loads.
        unloaded: exported tensors no vLLM worker's ``load_weights`` loads (a tied ``lm_head``):
            NeMo-RL's dense refit hands them to vLLM, which skips them; the refit skips them too.
        nonces: every engine's nonce, in metadata order.
        blobs: each rollout worker's packed ``{"placement": ...}`` (rollout rank order).
    """

    session: str
    folder: str
    train_world: int
    rollout_world: int
    table: dict[str, tuple[str, tuple[int, ...]]]
    unloaded: frozenset[str]
    nonces: tuple[str, ...]
    blobs: tuple[bytes, ...]

    @classmethod
    def from_metadata(cls, url: str, metadata: Sequence[Any], train_world: int, rollout_world: int) -> "Topology":
        """Parse NeMo-RL's ``metadata`` (policy entries, then rollout entries).

        Raises:
            ValueError: an entry is not from this plugin, the counts disagree, or the rollout
                workers disagree on the canonical table.
        """
        if len(metadata) != train_world + rollout_world:
            raise ValueError(f"metadata has {len(metadata)} entries for {train_world} policy + {rollout_world} "
                             "rollout workers")
        bad = [i for i, m in enumerate(metadata) if not (isinstance(m, Mapping) and TAG in m)]
        if bad:
            raise ValueError(f"metadata entries {bad[:8]} are not from nemo_dcr's checkpoint engine: every policy "
                             "and vLLM worker must use the same refit_transport")
        roles = [m[TAG] for m in metadata]
        if roles != ["policy"] * train_world + ["rollout"] * rollout_world:
            raise ValueError(f"metadata roles {roles} are not {train_world} policy then {rollout_world} rollout")
        for i, m in enumerate(metadata):
            _check_entry(i, m)
        nonces = tuple(m["nonce"] for m in metadata)
        session = hashlib.sha256("|".join(nonces).encode()).hexdigest()[:16]
        rollout = metadata[train_world:]
        tables = {m["table_sha"] for m in rollout}
        if len(tables) != 1:
            raise ValueError(f"the rollout workers hold {len(tables)} different canonical tables")
        exported = {n: (d, tuple(s)) for n, (d, s) in unpack(rollout[0]["table"]).items()}
        placed = set().union(*(m["placed"] for m in rollout))
        table = {n: spec for n, spec in exported.items() if n in placed}
        return cls(session, f"{url.rstrip('/')}/session-{session}", train_world, rollout_world, table,
                   frozenset(exported) - placed, nonces, tuple(m["placement"] for m in rollout))

    def placements(self) -> list[dict[str, TensorPlacement]]:
        """Every rollout worker's placement (no primaries), in rollout rank order."""
        return [placement_from_json(unpack(b)) for b in self.blobs]


def _check_entry(i: int, m: Mapping) -> None:
    """Entry ``i`` carries its role's keys, a hex nonce and (rollout) a table that matches its sha.

    Raises:
        ValueError: naming the entry and what is wrong.
    """
    missing = [k for k in ENTRY_KEYS[m[TAG]] if k not in m]
    if missing:
        raise ValueError(f"metadata entry {i} ({m[TAG]}) lacks {missing}")
    if not isinstance(m["nonce"], str) or not m["nonce"] or any(c not in "0123456789abcdef" for c in m["nonce"]):
        raise ValueError(f"metadata entry {i} ({m[TAG]}): nonce {m['nonce']!r} is not lowercase hex")
    if m[TAG] == "rollout" and (not isinstance(m["table"], bytes)
                                or hashlib.sha256(m["table"]).hexdigest() != m["table_sha"]):
        raise ValueError(f"metadata entry {i} (rollout): table_sha is not the sha256 of its table bytes")


def rollout_metadata(nonce: str, table: Mapping, placement_json: Mapping) -> dict:
    """What a vLLM worker's ``prepare()`` returns."""
    table_blob = pack({n: [d, list(s)] for n, (d, s) in sorted(table.items())})
    return {TAG: "rollout", "nonce": nonce, "table": table_blob, "table_sha": hashlib.sha256(table_blob).hexdigest(),
            "placement": pack(placement_json), "placed": sorted(placement_json)}


def policy_metadata(nonce: str) -> dict:
    """What a policy worker's ``prepare()`` returns."""
    return {TAG: "policy", "nonce": nonce}


@dataclass(frozen=True)
class SyncOutcome:
    """How one attempt of a sync ended: the body of an ``END`` envelope (docs/wire_format.md 7.6).

    Attributes:
        sync: the sync (1, 2, ... in the session).
        attempt: the attempt (0: the refit, 1: the resync after a failure).
        ok: the attempt succeeded (sent by policy rank 0 to every rollout rank).
        final: no further attempt follows (the sync failed for good when not ``ok``).
        rank: refit-group rank that ended the attempt (policy ``i``: ``i``; rollout ``j``: ``T + j``).
        reason: what failed (empty when ``ok``).
    """

    sync: int
    attempt: int
    ok: bool
    final: bool
    rank: int
    reason: str = ""

    def to_bytes(self) -> bytes:
        """The ``END`` body (JSON)."""
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_bytes(cls, body: bytes) -> SyncOutcome:
        """Parse an ``END`` body.

        Raises:
            ValueError: not a JSON object with exactly the six keys of the right types.
        """
        try:
            obj = json.loads(body)
        except ValueError as exc:
            raise ValueError(f"END body is not JSON: {exc}") from None
        types = {"sync": int, "attempt": int, "ok": bool, "final": bool, "rank": int, "reason": str}
        if not isinstance(obj, dict) or set(obj) != set(types) or any(
                type(obj[k]) is not t for k, t in types.items()):
            raise ValueError(f"END body must be an object with {sorted(types)} of types "
                             f"{[t.__name__ for t in types.values()]}, got {str(obj)[:200]}")
        return cls(**obj)

    def describe(self, train_world: int) -> str:
        """Who failed and why, e.g. ``policy rank 1: OSError: disk full``."""
        who = f"policy rank {self.rank}" if self.rank < train_world else f"rollout rank {self.rank - train_world}"
        return f"{who}: {self.reason}"


class SyncAborted(RuntimeError):
    """Another party ended the current attempt of the sync (:attr:`outcome` says who and why)."""

    def __init__(self, outcome: SyncOutcome):
        super().__init__(f"sync {outcome.sync} attempt {outcome.attempt} ended by rank {outcome.rank}: "
                         f"{outcome.reason}")
        self.outcome = outcome


_SYNC_DIR = re.compile(r"^sync-(\d{6,})(?:\.(\d+))?$")


def attempt_name(sync: int, attempt: int = 0) -> str:
    """``sync-<n, 6 digits>`` for the first attempt, ``sync-<n>.<a>`` for attempt ``a``."""
    return f"sync-{sync:06d}" + (f".{attempt}" if attempt else "")


class SyncTransport:
    """A :class:`~nemo_dcr.transport.StoreTransport` whose folder is ``<session>/sync-<n>[.<a>]`` for
    the current sync ``n`` and attempt ``a`` (:meth:`begin`) and whose run identity is
    ``<session>:<that name>`` (every endpoint derives it from NeMo-RL's metadata, so all agree
    without talking, and a frame of another session, sync or attempt is never read); otherwise
    the same ``send`` / ``recv`` / ``flush``.

    :meth:`recv` watches every sender while it waits for one: messages of the others are kept in
    arrival order for later calls, and with ``abort_on_end`` (policy endpoints) an ``END`` of the
    current attempt raises :class:`SyncAborted`.

    Args:
        folder: the session folder.
        rank: this endpoint's refit-group rank.
        key: HMAC key.
        session: the session's name (:attr:`Topology.session`).
        abort_on_end: raise :class:`SyncAborted` on an ``END`` envelope (policy side).
        share_bodies: large bodies written once for every receiver of the same bytes
            (:class:`~nemo_dcr.transport.StoreTransport`; policy side); released by :meth:`release`.
    """

    def __init__(self, folder: str, rank: int, key: bytes, session: str, abort_on_end: bool = False,
                 share_bodies: bool = False):
        self.session_folder, self.rank, self.key, self.session = folder, rank, key, session
        self.abort_on_end, self.share_bodies = abort_on_end, share_bodies
        self.sync, self.attempt = 0, 0
        self._inner: StoreTransport | None = None
        self._held: list[Envelope] = []
        self._written = 0

    @property
    def folder(self) -> str:
        """The current attempt's folder."""
        return f"{self.session_folder}/{attempt_name(self.sync, self.attempt)}"

    def begin(self, sync: int, attempt: int = 0) -> None:
        """Move to attempt ``attempt`` of sync ``sync``; this endpoint's inboxes of earlier syncs are
        deleted."""
        self.release()
        self._written = self.bytes_written
        self.sync, self.attempt, self._held = sync, attempt, []
        name = attempt_name(sync, attempt)
        self._inner = StoreTransport(self.folder, self.rank, self.key, run=f"{self.session}:{name}",
                                     share_bodies=self.share_bodies)
        if attempt == 0:
            remove_stale(self.session_folder, sync, inbox=self.rank)

    @property
    def bytes_written(self) -> int:
        """Bytes this endpoint wrote into the shared folder in the session (every attempt; a body
        shared by several receivers once)."""
        return self._written + (self._inner.bytes_written if self._inner is not None else 0)

    def release(self) -> None:
        """Delete the staged copies of the current attempt's shared bodies (the receivers' links
        stay): called when an attempt's payload is sent."""
        if self._inner is not None:
            self._inner.release()

    def _t(self) -> StoreTransport:
        if self._inner is None:
            raise RuntimeError("SyncTransport used before begin(sync)")
        return self._inner

    def send(self, dst: int, env: Envelope) -> None:
        """Send within the current attempt's folder."""
        self._t().send(dst, env)

    def flush(self) -> None:
        """See :meth:`StoreTransport.flush`."""
        self._t().flush()

    def end(self, dsts: Sequence[int], outcome: SyncOutcome, version: int = -1) -> None:
        """Send ``outcome`` as an ``END`` envelope to every rank of ``dsts`` (best effort when failed:
        a party that cannot be told times out with its own message)."""
        for d in dsts:
            try:
                self.send(d, Envelope(MessageKind.END, version, self.rank, body=outcome.to_bytes()))
            except Exception:  # noqa: BLE001 - see the docstring
                if outcome.ok:
                    raise

    def recv(self, src: int | None = None, timeout: float | None = None) -> Envelope:
        """The next envelope from ``src`` (any sender when None) in the current attempt.

        Raises:
            SyncAborted: (``abort_on_end``) an ``END`` arrived from any sender.
            TransportTimeout: nothing from ``src`` within ``timeout`` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            for i, env in enumerate(self._held):
                if src is None or env.sender == src:
                    return self._held.pop(i)
            left = None if deadline is None else deadline - time.monotonic()
            try:
                if left is not None and left < 0:
                    raise TransportTimeout("deadline passed")
                env = self._t().recv(None, timeout=left)
            except TransportTimeout:
                raise TransportTimeout(f"rank {self.rank}: nothing from {'any sender' if src is None else src} in "
                                       f"{self.folder} within {timeout}s") from None
            if self.abort_on_end and env.kind == MessageKind.END:
                raise SyncAborted(SyncOutcome.from_bytes(env.body))
            if src is None or env.sender == src:
                return env
            self._held.append(env)


def _fs(url: str):
    import fsspec

    return fsspec.core.url_to_fs(url)


def remove_stale(session_folder: str, sync: int, inbox: int | None = None) -> list[str]:
    """Delete what earlier syncs of a session left: this endpoint's ``inbox`` in every earlier
    sync folder (attempts included), or (``inbox=None``) every sync folder older than the
    previous one.  Returns the
    paths deleted (missing ones are skipped: another endpoint may be cleaning at the same time)."""
    fs, root = _fs(session_folder)
    gone = []
    for path in _listing(fs, root):
        m = _SYNC_DIR.match(path.rstrip("/").rsplit("/", 1)[-1])
        if m is None:
            continue
        n = int(m.group(1))
        if inbox is not None:
            target = f"{path}/to-{inbox}" if n < sync else None
        else:
            target = path if n < sync - 1 else None
        if target is not None and _remove(fs, target):
            gone.append(target)
    return gone


def remove_other_sessions(url: str, session: str) -> list[str]:
    """Delete every ``session-*`` folder under ``url`` except ``session-<session>`` (one job per ``url``)."""
    fs, root = _fs(url)
    gone = []
    for path in _listing(fs, root):
        name = path.rstrip("/").rsplit("/", 1)[-1]
        if name.startswith("session-") and name != f"session-{session}" and _remove(fs, path):
            gone.append(path)
    return gone


def _listing(fs, root: str) -> list[str]:
    try:
        return fs.ls(root, detail=False)
    except FileNotFoundError:
        return []


def _remove(fs, path: str) -> bool:
    try:
        fs.rm(path, recursive=True)
        return True
    except FileNotFoundError:
        return False
