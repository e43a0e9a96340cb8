"""Trainer side of the refit protocol (one object per trainer rank): route, encode, send, await,
verify, and resync on refusal, gap or checksum mismatch (docs/refit.md).

Per version ``v`` every trainer rank calls :meth:`RefitSender.refit` with its own remapped
canonical changes (old bits from its capture baseline) and its partial checksums of the current
weights; the call is collective over the trainer group.  The returned report says whether ``v``
committed; the caller commits its capture baseline only then (otherwise changes accumulate).
:meth:`RefitSender.attach` is the first call after a (re)start: it builds the mirror from the
trainer's weights, compares checksums with the engine, and resyncs only the tensors that differ
(trainer resumed from a checkpoint).  :meth:`RefitSender.resync` sends every owned tensor whole
through the same protocol (a delta at 100% density).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping, Sequence

from nemo_dcr.apply.placement import RankPlacement
from nemo_dcr.codec import Identity, encode_deltas
from nemo_dcr.codec.stats import layer_type
from nemo_dcr.config.schema import DcrConfig
from nemo_dcr.telemetry.phases import Phase, PhaseClock
from nemo_dcr.transport import Envelope, MessageKind, Transport, TransportError
from nemo_dcr.types import SparseDelta
from nemo_dcr.verify.checksum import MASK64
from nemo_dcr.verify.compare import ChecksumMismatch, VerifyReport, compare

from .fanout import Fanout
from .fp8_mirror import Fp8Mirror
from .group import TrainerGroup
from .messages import Ask, EngineReply, MessageFormatError, Query
from .mirror import SenderMirror
from .payloads import resync_payload
from .refit_report import RefitReport
from .relay import RelayPlan
from .route_views import Router

Tamper = Callable[[list[Envelope]], list[Envelope]]
"""Fault injection between encoding and sending (chaos): may drop, duplicate, reorder, corrupt."""

RAW_BYTES_PER_CHANGE = 10
"""Bytes of one changed bf16 element before coding (int64 position + bits): sizes payload parts."""


def verify_due(cfg: DcrConfig, refit_index: int) -> tuple[bool, bool]:
    """(compare checksums, with a full scan on both sides) for refit number ``refit_index`` (1-based)."""
    full = bool(cfg.full_verify_interval) and refit_index % cfg.full_verify_interval == 0
    every = bool(cfg.verify_interval) and refit_index % cfg.verify_interval == 0
    return every or full, full


@dataclass
class RefitSender:
    """One trainer rank's side of the protocol.

    With ``routes`` (``(engine rank, shard)`` -> placement, see docs/engines.md "Routing") each
    engine shard receives only the records for the elements it holds, in its view index space, and
    the engines' canonical partial checksums are summed; without, every engine rank gets every part
    (shard 0).  An engine rank may serve several shards (vLLM's tensor-parallel ranks behind one
    driver): its parts carry the shard in the envelope.

    Args:
        cfg: the ``dcr`` settings (encoding, part size, reply timeout, verification cadence).
        key: HMAC key of payloads (None: unauthenticated).
        group: the trainer ranks.
        transport: this trainer rank's endpoint of the refit group.
        engine_ranks: refit-group ranks of the engines.
        owners: canonical tensor -> owning trainer rank.
        mirror: this rank's mirror of what the engine holds of its owned tensors, in the engine's
            format (a :class:`SenderMirror`, or an :class:`~.fp8_mirror.Fp8Mirror`: see refit/fp8_mirror.py).
        router: this rank's routing to the owners (:class:`~.route_views.Router`, the same owners).
        routes: placement per ``(engine rank, shard)`` (None: engines hold canonical tensors whole).
        model: model name carried in payload headers.
        relay: the fan-out (refit/relay.py; None: every engine rank direct).
    """

    cfg: DcrConfig
    key: bytes | None
    group: TrainerGroup
    transport: Transport
    engine_ranks: Sequence[int]
    owners: Mapping[str, int]
    mirror: SenderMirror | Fp8Mirror
    router: Router
    routes: Mapping[tuple[int, int], RankPlacement] | None = None
    model: str = ""
    relay: RelayPlan | None = None
    refits: int = 0
    queries: int = 0
    """Queries sent so far (each query's id; its answer carries it back)."""
    _detected: list[str] = field(default_factory=list)
    _relayed: int = 0
    """Payload bytes the relay roots pass on inside the rollout cluster this refit (what was sent to
    each root times its other replicas)."""

    def __post_init__(self):
        self.relay = self.relay or RelayPlan.direct(self.engine_ranks)
        self.set_routes(self.routes)

    def set_routes(self, routes: Mapping[tuple[int, int], RankPlacement] | None) -> None:
        """Route records per engine shard from now on (placements the engines reported)."""
        if routes is not None and {e for e, _ in routes} != set(self.engine_ranks):
            raise ValueError(f"routes for engine ranks {sorted({e for e, _ in routes})}, "
                             f"engine ranks {list(self.engine_ranks)}")
        if routes is not None and isinstance(self.mirror, Fp8Mirror):
            raise ValueError("FP8 engine weights need engine ranks holding whole tensors; an engine that "
                             "reports placements (routed views, e.g. vLLM) takes bf16 weights only")
        self.routes = routes
        self._fanout = None if routes is None else Fanout(routes, self.mirror)
        if self._fanout is not None:
            self.relay.check_views(lambda e: tuple((s, self._fanout.signature((r, s))) for r, s in sorted(routes)
                                                   if r == e))

    @property
    def max_changes_per_part(self) -> int:
        """Changed elements per payload part, from ``bucket_size_mb`` (bounds encode and transfer memory)."""
        return max(1, int(self.cfg.bucket_size_mb * (1 << 20)) // RAW_BYTES_PER_CHANGE)

    @property
    def owned(self) -> list[str]:
        """Canonical tensors this rank owns, sorted."""
        return sorted(n for n, r in self.owners.items() if r == self.group.rank)

    # -- protocol pieces --------------------------------------------------------------------

    def _encode(self, owned: Sequence[SparseDelta], ident: Identity):
        """Stage ``owned`` and encode what the engine receives for it (its format);
        returns ``(engine changes, parts per (engine rank, shard))``."""
        sent = self.mirror.stage(owned, ident.target_version)
        if self._fanout is None:
            parts = self.mirror.encode(sent, ident, self.cfg.encoding, self.key, self.max_changes_per_part)
            return sent, {(e, 0): parts for e in self.engine_ranks}
        return sent, self._fanout.encode(sent, ident, self.cfg.encoding, self.key, self.max_changes_per_part)

    def _reset(self, names: Sequence[str], version: int) -> None:
        self.mirror.settle(names, version)
        if self.cfg.encoding == "dcr":  # after a (re)sync: the next refit's encode follows its changes
            self.mirror.build_indexes()

    def _route(self, pieces: Sequence[SparseDelta], attach: bool = False) -> list[SparseDelta]:
        """Send each canonical piece to its owner (coded against the sender's view of its tensor,
        refit/route_views.py); merge what this rank owns (refusing overlaps)."""
        return self.router.route(pieces, attach)

    def _ended(self, report: RefitReport) -> RefitReport:
        """The views of this refit's route move with the capture baseline (only when it
        committed); the report gets the routing bytes this rank sent."""
        self.router.end(report.committed)
        return replace(report, route_bytes=self.router.sent.to_others, fanout_bytes=self._relayed)

    def _send(self, kind: MessageKind, version: int, parts: Mapping[tuple[int, int], Sequence[bytes]],
              tamper: Tamper | None, ranks: Sequence[int] | None = None) -> int:
        """Send the engine ranks (``ranks``, default all) their parts (numbered across its shards) and
        an end-of-version marker, through their relay roots (:meth:`RelayPlan.destinations`);
        returns payload bytes put on the transport (after tampering: what really crossed)."""
        sent = 0
        for e, reach in self.relay.destinations(self.engine_ranks if ranks is None else ranks):
            mine = [(s, p) for (rank, s), ps in sorted(parts.items()) if rank == e for p in ps]
            envs = [Envelope(kind, version, self.transport.rank, i, False, p, shard=s) for i, (s, p) in enumerate(mine)]
            envs = tamper(envs) if tamper else envs
            envs.append(Envelope(kind, version, self.transport.rank, len(mine), True))
            for env in envs:
                self.transport.send(e, env)
                sent += len(env.body)
                self._relayed += len(env.body) * (reach - 1)
        self.transport.flush()
        return sent

    def _await(self, version: int, kinds: tuple[MessageKind, ...], query: Query | None = None,
               ranks: Sequence[int] | None = None) -> list[EngineReply]:
        """Every engine rank's (of ``ranks``, default all) reply of one of ``kinds`` about ``version``
        (or answering ``query``); other messages are stale and skipped.  No reply, or a malformed
        one, is a failed reply."""
        replies = []
        for e in self.engine_ranks if ranks is None else ranks:
            while True:
                try:
                    env = self.transport.recv(src=e, timeout=self.cfg.reply_timeout_s)
                    if env.kind not in kinds or (query is None and env.version != version):
                        continue
                    reply = EngineReply.from_bytes(env.body)
                except TransportError as exc:
                    reply = EngineReply(False, -1, reason=f"no reply from engine rank {e}: {exc}")
                except MessageFormatError as exc:
                    reply = EngineReply(False, -1, reason=f"malformed reply from engine rank {e}: {exc}")
                if query is None or reply.query == query or reply.version < 0:
                    replies.append(reply)
                    break
        return replies

    def query(self, ask: Ask = Ask.FULL) -> list[EngineReply]:
        """Ask every engine rank for its state (version and checksums; ``ask`` selects what)."""
        self.queries += 1
        query = Query(ask, self.queries)
        for e in self.engine_ranks:
            self.transport.send(e, Envelope(MessageKind.QUERY, 0, self.transport.rank, body=query.to_bytes()))
        self.transport.flush()
        return self._await(0, (MessageKind.STATE,), query)

    def _verify(self, trainer: Mapping[str, int], replies: Sequence[EngineReply], full: bool,
                current: bool = False) -> VerifyReport:
        """Trainer totals against the engines' (summed) checksums; with routes also every engine
        rank's own views against the mirror (``current``: against the trainer's state, mirror
        plus staged changes), so a replica the sums count once (TP-replicated norms, a second
        DP engine) cannot diverge unseen.  Collective; every rank gets the same report."""
        names = self.mirror.engine_names(sorted(self.owners))  # the engine's tensors, in one order on every rank
        totals = self.group.sum_u64(self.mirror.trainer_side(trainer), names)
        version = max(r.version for r in replies)
        if self._fanout is None:  # every rank holds every tensor whole: each rank's own values
            return _each_rank(totals, self.engine_ranks, replies, version, full)
        engine: dict[str, int] = {}
        for r in replies:  # canonical partial sums of each rank
            for n, c in r.checksums.items():
                engine[n] = (engine.get(n, 0) + c) & MASK64
        report = compare(totals, engine, version, full)
        local, compared = self._fanout.view_mismatches(self.owned, self._reported_views(replies),
                                                       self.mirror.current_bits if current else None)
        local = [(n, e, shard, want, got) for n, (e, shard), want, got in local]
        seen = [json.loads(b) for b in self.group.exchange([json.dumps([compared, local]).encode()] * self.group.size)]
        rows = sorted({tuple(m) for _, ms in seen for m in ms}, key=lambda m: (m[0], m[1], m[2]))
        extra = tuple(ChecksumMismatch(n, want, got, where=f"engine rank {e}" + (f" shard {sh}" if sh else ""),
                                       engine_rank=e) for n, e, sh, want, got in rows)
        return replace(report, checked=report.checked + sum(c for c, _ in seen),
                       mismatches=report.mismatches + extra)

    def _reported_views(self, replies: Sequence[EngineReply]) -> dict[tuple[int, int], dict[str, int] | None]:
        """Route key -> the view checksums its engine shard reported (None: its rank did not answer;
        empty: it answered without that shard's views, so every view it holds differs)."""
        out: dict[tuple[int, int], dict[str, int] | None] = {}
        for e, r in zip(self.engine_ranks, replies):
            for key in (k for k in self.routes if k[0] == e):
                out[key] = r.views.get(key[1], {}) if r.ok else None
        return out

    # -- the three entry points -------------------------------------------------------------

    def _telemetry(self, owned: Sequence[SparseDelta], encodings: Sequence[str]) -> dict[str, int]:
        """Payload bytes of the engine changes ``owned`` in other encodings (measured, not sent;
        before the mirror moves)."""
        out = {}
        for enc in encodings:
            if enc != self.cfg.encoding:
                out[enc] = len(encode_deltas(owned, self.mirror.bits, Identity(), enc, None, self.mirror.checksums))
        return out

    def refit(self, pieces: Sequence[SparseDelta], trainer_checksums: Mapping[str, int], *, full: bool = False,
              verify: bool = True, tamper: Tamper | None = None, base_skew: int = 0,
              telemetry: Sequence[str] = ()) -> RefitReport:
        """Ship this version's changes; collective over the trainer group.

        Args:
            pieces: this rank's canonical changes since its committed baseline.
            trainer_checksums: this rank's partial checksums of its current weights.
            full: compare full scans (the engine rescans; ``trainer_checksums`` must be a full scan too).
            verify: compare checksums after the engine acknowledged.
            tamper: fault injection on the outgoing envelopes.
            base_skew: added to the payload's base version (version-skew fault injection).
            telemetry: further encodings whose payload sizes are measured for the report (not sent).
        """
        return self._ended(self._refit(pieces, trainer_checksums, full, verify, tamper, base_skew, telemetry))

    def _refit(self, pieces, trainer_checksums, full, verify, tamper, base_skew, telemetry) -> RefitReport:
        self.refits += 1
        self._detected, self._relayed = [], 0
        clock = PhaseClock()
        version = self.mirror.version + 1
        with clock(Phase.ROUTE):
            routed = self._route(pieces)
        with clock(Phase.ENCODE):
            owned = self.mirror.changes(routed)
            ident = Identity(self.model, "", self.mirror.version + base_skew, version + base_skew)
            sent_deltas, parts = self._encode(owned, ident)
        with clock(Phase.SEND):
            sent = self._send(MessageKind.DELTA, version, parts, tamper)
        with clock(Phase.AWAIT):
            replies = self._await(version, (MessageKind.ACK, MessageKind.NACK))
            ok = self.group.all_true(all(r.ok for r in replies))
        changed = sum(d.nnz for d in owned)
        with clock(Phase.TELEMETRY):
            sizes = self._telemetry(sent_deltas, telemetry)
            fmt = self.mirror.telemetry(self.cfg.encoding if telemetry else None)
        if not ok:
            self._detected += [r.reason for r in replies if not r.ok] or ["a peer saw a refusal"]
            return self._recover(trainer_checksums, changed, sent, clock)
        with clock(Phase.VERIFY):
            self.mirror.commit(version)
            report = None
            if verify or full:
                report = self._verify(trainer_checksums, self.query() if full else replies, full)
        if report is not None and not report.ok:
            self._detected.append("checksum mismatch: " + report.describe())
            return self._recover(trainer_checksums, changed, sent, clock)
        kinds: dict[str, dict[str, int]] = {}
        for d in owned:
            k = kinds.setdefault(layer_type(d.name), {"changed": 0})
            k["changed"] += d.nnz
        return RefitReport(version, "delta", True, False, tuple(self._detected), changed, payload_bytes=sent,
                           bytes_by_encoding={self.cfg.encoding: sent, **sizes}, by_layer_type=kinds,
                           times=clock.seconds, verify=report, engine_format=fmt)

    def attach(self, pieces: Sequence[SparseDelta], trainer_checksums: Mapping[str, int]) -> RefitReport:
        """(Re)start: ``pieces`` are all nonzero elements (captured against a zero baseline).

        The mirror starts from zeros, so mirror plus ``pieces`` is the trainer's state; the
        engine's full checksums decide which tensors (if any) need a resync.  Each rank sends the
        owners its view of their tensors (refit/route_views.py).
        """
        self._detected, self._relayed = [], 0
        clock = PhaseClock()
        with clock(Phase.ROUTE):
            owned = self.mirror.changes(self._route(pieces, attach=True))
            self.mirror.stage(owned, 1)
        return self._ended(self._recover(trainer_checksums, sum(d.nnz for d in owned), 0, clock, mode="attach"))

    def resync(self, pieces: Sequence[SparseDelta], trainer_checksums: Mapping[str, int]) -> RefitReport:
        """Send every owned tensor whole (this version's changes included) through the protocol."""
        self.refits += 1
        self._detected, self._relayed = [], 0
        clock = PhaseClock()
        with clock(Phase.ROUTE):
            owned = self.mirror.changes(self._route(pieces))
            self.mirror.stage(owned, self.mirror.version + 1)
        state = self.query()
        target = max([r.version for r in state] + [self.mirror.version]) + 1
        return self._ended(self._resync(self.owned, target, trainer_checksums, sum(d.nnz for d in owned), 0, clock,
                                        mode="resync", before=None))

    # -- recovery -----------------------------------------------------------------------------

    def _resync_parts(self, names: Sequence[str], target: int) -> dict[tuple[int, int], list[bytes]]:
        if self._fanout is not None:
            return self._fanout.resync_payloads(names, target, self.key, self.model)
        payload = resync_payload(self.mirror.current(names), target, self.key, model=self.model)
        return {(e, 0): [payload] for e in self.engine_ranks}

    def _recover(self, trainer_checksums, changed: int, sent: int, clock: PhaseClock,
                 mode: str = "delta") -> RefitReport:
        with clock(Phase.VERIFY):
            state = self.query()
            before = self._verify(trainer_checksums, state, full=True, current=True)
        engine_version = max(r.version for r in state)
        if before.ok and engine_version >= 0:
            self._reset(self.owned, engine_version)
            if mode == "attach":
                return RefitReport(engine_version, mode, True, False, (), changed, payload_bytes=sent,
                                   times=clock.seconds, verify=before)
        elif mode == "attach":
            self._detected.append("trainer and engine differ at (re)start: " + before.describe())
        bad = {self.mirror.canonical_name(m.name) for m in before.mismatches}
        target, ranks = max(engine_version, self.mirror.version) + 1, None
        alone = None if before.ok else self._lagging(state, before)
        if alone is not None:
            target, ranks = alone
        names = [n for n in self.owned if n in bad]
        return self._resync(names, target, trainer_checksums, changed, sent, clock, mode, before, ranks)

    def _lagging(self, state: Sequence[EngineReply], before: VerifyReport) -> tuple[int, list[int]] | None:
        """The engine ranks to resync alone and the version they catch up to: the ranks whose own
        checksums differ, when every other rank holds the trainer's state at one version above
        theirs (a replica that failed a version the others committed); None: resync every rank."""
        failing = {m.engine_rank for m in before.mismatches if m.engine_rank is not None}
        version = {e: r.version for e, r in zip(self.engine_ranks, state)}
        good = {version[e] for e in self.engine_ranks if e not in failing}
        if not failing or len(good) != 1 or any(version[e] >= min(good) for e in failing):
            return None
        return good.pop(), [e for e in self.engine_ranks if e in failing]

    def _resync(self, names: Sequence[str], target: int, trainer_checksums, changed: int, sent: int,
                clock: PhaseClock, mode: str, before: VerifyReport | None,
                ranks: Sequence[int] | None = None) -> RefitReport:
        """Send ``names`` whole at version ``target`` to ``ranks`` (default all engine ranks; the
        others hold ``target`` already and go on)."""
        with clock(Phase.ENCODE):
            parts = self._resync_parts(names, target)
        with clock(Phase.SEND):
            sent += self._send(MessageKind.RESYNC, target, parts, None, ranks)
        with clock(Phase.AWAIT):
            replies = self._await(target, (MessageKind.ACK, MessageKind.NACK), ranks=ranks)
            ok = self.group.all_true(all(r.ok for r in replies))
        if not ok:
            self._detected += [r.reason for r in replies if not r.ok] or ["a peer saw a refusal"]
            version = max(r.version for r in replies)
            return RefitReport(version, mode, False, True, tuple(self._detected), changed, payload_bytes=sent,
                               times=clock.seconds, verify=before)
        self._reset(self.owned, target)
        with clock(Phase.VERIFY):
            after = self._verify(trainer_checksums, replies if ranks is None else self.query(Ask.STATE), full=False)
        if not after.ok:
            self._detected.append("checksum mismatch after resync: " + after.describe())
        return RefitReport(target, mode, after.ok, True, tuple(self._detected), changed, payload_bytes=sent,
                           times=clock.seconds, verify=after)


def _each_rank(totals: Mapping[str, int], ranks: Sequence[int], replies: Sequence[EngineReply], version: int,
               full: bool) -> VerifyReport:
    """Trainer totals against every engine rank's own values (engine ranks holding every tensor
    whole, e.g. data-parallel replicas: each is a full copy, so each is compared)."""
    reports = [compare(totals, r.checksums, version, full) for r in replies]
    if len(reports) == 1:
        return replace(reports[0], mismatches=tuple(replace(m, engine_rank=ranks[0]) for m in reports[0].mismatches))
    bad = tuple(replace(m, where=f"engine rank {e}", engine_rank=e) for e, rep in zip(ranks, reports)
                for m in rep.mismatches)
    return VerifyReport(version, full, sum(r.checked for r in reports), bad)
