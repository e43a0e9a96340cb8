"""Trainer side of a refit (one object per trainer rank): route, encode, send, await, verify,
commit, and resync on refusal, gap or checksum mismatch (docs/refit.md).

Per version ``v`` every trainer rank calls :meth:`RefitSender.refit` with its own remapped
canonical changes (old bits from its capture baseline) and its partial checksums of the
current weights; the call is collective over the trainer group.  It returns whether ``v``
committed; the caller commits its capture baseline on ``committed`` and otherwise keeps it
(changes accumulate).  :meth:`RefitSender.attach` is the first call after a (re)start: it
builds the mirror from the trainer's weights, compares checksums with the engine, and resyncs
only the tensors that differ (trainer resumed from a checkpoint), without any manual reload.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Mapping, Sequence

from nemo_dcr.apply.placement import RankPlacement
from nemo_dcr.codec import Identity
from nemo_dcr.transport import Envelope, MessageKind, Transport, TransportError
from nemo_dcr.types import SparseDelta
from nemo_dcr.verify.checksum import MASK64
from nemo_dcr.verify.report import VerifyPolicy, VerifyReport, compare

from .fanout import Fanout
from .group import TrainerGroup
from .messages import QUERY_FULL, EngineReply
from .mirror import SenderMirror
from .payloads import resync_payload
from .routing import by_owner, merge, pack, unpack

Tamper = Callable[[list[Envelope]], list[Envelope]]
"""Fault injection between encoding and sending (chaos): may drop, duplicate, reorder, corrupt."""


@dataclass(frozen=True)
class RefitConfig:
    """Settings of the refit pipeline.

    Attributes:
        key: HMAC key of payloads (None: unauthenticated).
        encoding: ``dcr``, ``reference`` or ``raw``.
        max_changes_per_part: changed elements per payload part (bounds encode memory).
        reply_timeout: seconds to wait for an engine reply.
        verify: when to compare checksums.
        model: model name carried in payload headers.
        run: run name carried in payload headers.
    """

    key: bytes | None = None
    encoding: str = "dcr"
    max_changes_per_part: int = 1 << 20
    reply_timeout: float = 60.0
    verify: VerifyPolicy = VerifyPolicy()
    model: str = ""
    run: str = ""


@dataclass(frozen=True)
class RefitOutcome:
    """What one refit did.

    Attributes:
        version: the engine's version afterwards.
        committed: the engine holds the trainer's current weights (the caller commits its baseline).
        resynced: a full resync of some tensors was needed.
        detected: problems seen (refusals, mismatches), in order.
        changed: changed elements this rank encoded.
        bytes_sent: payload bytes this rank sent.
        verify: the last verification.
        phases: wall seconds of this rank's phases (``route``, ``encode``, ``send``, ``await``,
            ``verify``) of the sparse refit; empty for attach and recovery.
    """

    version: int
    committed: bool
    resynced: bool = False
    detected: tuple[str, ...] = ()
    changed: int = 0
    bytes_sent: int = 0
    verify: VerifyReport | None = None
    phases: dict[str, float] = field(default_factory=dict)


class PhaseClock:
    """Wall seconds per named phase (``perf_counter``); phases may repeat and accumulate."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - t0


@dataclass
class RefitSender:
    """One trainer rank's side of the pipeline.

    With ``routes`` (engine rank -> placement, see docs/engines.md "Routing") each engine rank
    receives only the records for the elements it holds, in its view index space, and the
    engines' canonical partial checksums are summed; without, every engine rank gets every part.
    """

    config: RefitConfig
    group: TrainerGroup
    transport: Transport
    engine_ranks: Sequence[int]
    owners: Mapping[str, int]
    mirror: SenderMirror
    refits: int = 0
    routes: Mapping[int, RankPlacement] | None = None
    _detected: list[str] = field(default_factory=list)

    def __post_init__(self):
        self._fanout = None if self.routes is None else Fanout(self.routes, self.mirror)
        if self.routes is not None and set(self.routes) != set(self.engine_ranks):
            raise ValueError(f"routes for ranks {sorted(self.routes)}, engine ranks {list(self.engine_ranks)}")

    def _encode(self, owned: Sequence[SparseDelta], ident: Identity) -> dict[int, list[bytes]]:
        c = self.config
        if self._fanout is None:
            parts = self.mirror.encode(owned, ident, c.encoding, c.key, c.max_changes_per_part)
            return {e: parts for e in self.engine_ranks}
        self.mirror.stage(owned, ident.target_version)
        return self._fanout.encode(owned, ident, c.encoding, c.key, c.max_changes_per_part)

    def _commit(self, version: int) -> None:
        self.mirror.commit(version)
        if self._fanout is not None:
            self._fanout.commit(version)

    def _reset(self, names: Sequence[str], version: int) -> None:
        self.mirror.reset(self.mirror.current(names), version)
        if self._fanout is not None:
            self._fanout.reset()

    def _owned(self, pieces: Sequence[SparseDelta]) -> list[SparseDelta]:
        out = [pack(b) for b in by_owner(pieces, self.owners, self.group.size)]
        return merge([d for blob in self.group.exchange(out) if blob for d in unpack(blob)])

    def _send(self, kind: MessageKind, version: int, parts: Mapping[int, Sequence[bytes]],
              tamper: Tamper | None) -> int:
        for e in self.engine_ranks:
            envs = [Envelope(kind, version, self.transport.rank, i, False, p) for i, p in enumerate(parts[e])]
            envs = tamper(envs) if tamper else envs
            envs.append(Envelope(kind, version, self.transport.rank, len(parts[e]), True))
            for env in envs:
                self.transport.send(e, env)
        self.transport.flush()
        unique = {id(ps): ps for ps in parts.values()}  # unrouted: one list shared by every rank
        return sum(len(p) for ps in unique.values() for p in ps)

    def _await(self, version: int, kinds: tuple[MessageKind, ...]) -> list[EngineReply]:
        replies = []
        for e in self.engine_ranks:
            while True:
                try:
                    env = self.transport.recv(src=e, timeout=self.config.reply_timeout)
                except TransportError as exc:
                    replies.append(EngineReply(False, -1, reason=f"no reply: {exc}"))
                    break
                if env.kind in kinds and env.version == version:
                    replies.append(EngineReply.from_bytes(env.body))
                    break
        return replies

    def _query(self) -> list[EngineReply]:
        for e in self.engine_ranks:
            self.transport.send(e, Envelope(MessageKind.QUERY, QUERY_FULL, self.transport.rank))
        self.transport.flush()
        return self._await(QUERY_FULL, (MessageKind.STATE,))

    def _verify(self, trainer: Mapping[str, int], replies: Sequence[EngineReply], full: bool) -> VerifyReport:
        engine: dict[str, int] = {}
        for r in replies:  # routed: canonical partial sums of each rank; else every rank's full values
            for n, c in r.checksums.items():
                engine[n] = (engine.get(n, 0) + c) & MASK64 if self._fanout is not None else c
        names = sorted(set(self.owners))
        totals = self.group.sum_u64(trainer, names)
        return compare(totals, engine, max(r.version for r in replies), full)

    def refit(self, pieces: Sequence[SparseDelta], trainer_checksums: Mapping[str, int],
              tamper: Tamper | None = None, base_skew: int = 0) -> RefitOutcome:
        """Ship this version's changes; collective over the trainer group.

        Args:
            pieces: this rank's canonical changes since its committed baseline.
            trainer_checksums: this rank's partial checksums of its current weights.
            tamper: fault injection on the outgoing envelopes.
            base_skew: added to the payload's base version (version-skew fault injection).
        """
        self.refits += 1
        self._detected = []
        clock = PhaseClock()
        version = self.mirror.version + 1
        with clock("route"):
            routed = self._owned(pieces)
        with clock("encode"):
            owned = self.mirror.changes(routed)
            ident = Identity(self.config.model, self.config.run, self.mirror.version + base_skew,
                             version + base_skew)
            parts = self._encode(owned, ident)
        with clock("send"):
            sent = self._send(MessageKind.DELTA, version, parts, tamper)
        with clock("await"):
            replies = self._await(version, (MessageKind.ACK, MessageKind.NACK))
            ok = self.group.all_true(all(r.ok for r in replies))
        changed = sum(d.nnz for d in owned)
        if not ok:
            self._detected += [r.reason for r in replies if not r.ok] or ["a peer saw a refusal"]
            return self._recover(trainer_checksums, changed, sent)
        with clock("verify"):
            self._commit(version)
            full = self.config.verify.full_due(self.refits)
            report = None
            if self.config.verify.every_refit or full:
                report = self._verify(trainer_checksums, self._query() if full else replies, full)
        if report is not None and not report.ok:
            self._detected.append("checksum mismatch: " + report.describe())
            return self._recover(trainer_checksums, changed, sent)
        return RefitOutcome(version, True, False, tuple(self._detected), changed, sent, report, clock.seconds)

    def attach(self, pieces: Sequence[SparseDelta], trainer_checksums: Mapping[str, int]) -> RefitOutcome:
        """(Re)start: ``pieces`` are all nonzero elements (captured against a zero baseline).

        The mirror starts from zeros, so mirror plus ``pieces`` is the trainer's state; the
        engine's full checksums decide which tensors (if any) need a resync.
        """
        self._detected = []
        owned = self.mirror.changes(self._owned(pieces))
        self.mirror.encode(owned, Identity(base_version=0, target_version=1), "raw", None, 1 << 62)
        return self._recover(trainer_checksums, sum(d.nnz for d in owned), 0, attach=True)

    def _resync_parts(self, names: Sequence[str], target: int) -> dict[int, list[bytes]]:
        c = self.config
        if self._fanout is not None:
            return self._fanout.resync_payloads(names, target, c.key, c.model, c.run)
        payload = resync_payload(self.mirror.current(names), target, c.key, model=c.model, run=c.run)
        return {e: [payload] for e in self.engine_ranks}

    def _recover(self, trainer_checksums, changed: int, sent: int, attach: bool = False) -> RefitOutcome:
        state = self._query()
        before = self._verify(trainer_checksums, state, full=True)
        engine_version = max(r.version for r in state)
        owned = [n for n in sorted(self.owners) if self.owners[n] == self.group.rank]
        if before.ok and engine_version >= 0:
            self._reset(owned, engine_version)
            if attach:
                return RefitOutcome(engine_version, True, False, (), changed, sent, before)
        elif attach:
            self._detected.append("trainer and engine differ at (re)start: " + before.describe())
        bad = {m.name for m in before.mismatches}
        target = max(engine_version, self.mirror.version) + 1
        parts = self._resync_parts([n for n in owned if n in bad], target)
        sent += self._send(MessageKind.RESYNC, target, parts, None)
        replies = self._await(target, (MessageKind.ACK, MessageKind.NACK))
        ok = self.group.all_true(all(r.ok for r in replies))
        if not ok:
            self._detected += [r.reason for r in replies if not r.ok]
            return RefitOutcome(engine_version, False, True, tuple(self._detected), changed, sent, before)
        self._reset(owned, target)
        after = self._verify(trainer_checksums, replies, full=False)
        return RefitOutcome(target, after.ok, True, tuple(self._detected), changed, sent, after)
