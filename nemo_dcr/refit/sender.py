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
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping, Sequence

from nemo_dcr.apply.placement import RankPlacement
from nemo_dcr.codec import Identity, encode_deltas
from nemo_dcr.codec.stats import layer_type
from nemo_dcr.config.schema import DcrConfig
from nemo_dcr.kernels.workers import resolve_threads
from nemo_dcr.telemetry.phases import Phase, PhaseClock
from nemo_dcr.transport import Envelope, MessageKind, Transport, TransportError, TransportTimeout
from nemo_dcr.types import SparseDelta
from nemo_dcr.verify.checksum import MASK64
from nemo_dcr.verify.compare import ChecksumMismatch, VerifyReport, compare
from nemo_dcr.verify.sample import Sample

from .fanout import Fanout
from .fp8_mirror import Fp8Mirror
from .group import TrainerGroup
from .messages import Ask, EngineReply, MessageFormatError, Query
from .mirror import SenderMirror
from .payloads import resync_payload
from .refit_report import RefitReport
from .relay import RelayPlan
from .replicas import Replicas
from .route_views import Router

_VIEWS_COMPARED, _VIEWS_DIFFERING = "\0views compared", "\0views differing"
"""Keys of the engine views' counts that :meth:`RefitSender._verify` sums along with the
checksums (no tensor name starts with a NUL)."""


def _lost(reason: str) -> EngineReply:
    """The failed reply standing for an exchange with ``engine_rank`` the transport lost."""
    return EngineReply(False, -1, reason=reason)


Tamper = Callable[[list[Envelope]], list[Envelope]]
"""Fault injection between encoding and sending (chaos): may drop, duplicate, reorder, corrupt."""

_POLL_S = 0.05
"""While awaiting replies, how long to wait on one engine rank before looking at the next."""

RAW_BYTES_PER_CHANGE = 10
"""Bytes of one changed bf16 element before coding (int64 position + bits): sizes payload parts."""


def checks_due(cfg: DcrConfig, refit_index: int) -> tuple[bool, Sample | None]:
    """``(full check, sample)`` of refit number ``refit_index`` (1-based) under ``cfg.verify``: a
    full scan on both sides, or the slice of a sampled check (neither: the deltas' checksums only)."""
    if cfg.verify == "full":
        return True, None
    if cfg.verify == "incremental":
        return bool(cfg.verify_steps) and refit_index % cfg.verify_steps == 0, None
    return False, Sample(refit_index, cfg.verify_steps, cfg.verify_block, cfg.verify_seed)


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
    uncertain: bool = False
    """The last exchange with the engines was lost (a send failed, or no reply within
    ``reply_timeout_s``): what they hold is unknown, so the next refit starts with a recovery."""
    sent_version: int = 0
    """The highest version put on the wire: a recovery's target goes past it, so late parts of a
    lost exchange (an engine that stalled, then read them) cannot commit under the recovery's number."""
    _detected: list[str] = field(default_factory=list)
    _relayed: int = 0
    """Payload bytes the relay roots passed on inside the rollout cluster this refit: what was sent
    to each root times its other replicas that answered that version without a direct send."""
    _changed_ranks: tuple[list[int], list[int]] = field(default_factory=lambda: ([], []))
    """Engine ranks detached, and ranks sent a resync, this refit (refit/replicas.py)."""

    def __post_init__(self):
        self.relay = self.relay or RelayPlan.direct(self.engine_ranks)
        self.replicas = Replicas.of(self.relay)
        self.set_routes(self.routes)

    @property
    def live(self) -> list[int]:
        """The engine ranks addressed now: all but the detached ones (refit/replicas.py)."""
        return self.replicas.live(self.engine_ranks)

    def set_mirror(self, mirror: SenderMirror | Fp8Mirror) -> None:
        """Start over from ``mirror`` (a fresh one: the trainer's weights are re-read)."""
        self.mirror = mirror
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
    def threads(self) -> int:
        """Worker threads over a part's records (``dcr.threads``; ``auto``: this host's share of the
        cores among its ``LOCAL_WORLD_SIZE`` trainer processes)."""
        return resolve_threads(self.cfg.threads)

    @property
    def max_changes_per_part(self) -> int:
        """Changed elements per payload part, from ``bucket_size_mb`` (bounds encode and transfer memory)."""
        return max(1, int(self.cfg.bucket_size_mb * (1 << 20)) // RAW_BYTES_PER_CHANGE)

    @property
    def owned(self) -> list[str]:
        """Canonical tensors this rank owns, sorted."""
        return sorted(n for n, r in self.owners.items() if r == self.group.rank)

    def wait(self) -> None:
        """Wait for the work this rank's last refit left behind its report: the kept class
        indexes' moves of the route views and of the mirror, each on a thread of its own."""
        self.router.wait()
        self.mirror.indexes  # noqa: B018 -- the property waits for the move

    # -- protocol pieces --------------------------------------------------------------------

    def _encode(self, owned: Sequence[SparseDelta], ident: Identity):
        """Stage ``owned`` and encode what the engine receives for it (its format);
        returns ``(engine changes, parts per (engine rank, shard))``."""
        sent = self.mirror.stage(owned, ident.target_version)
        if self._fanout is None:
            parts = self.mirror.encode(sent, ident, self.cfg.encoding, self.key, self.max_changes_per_part,
                                       self.threads)
            return sent, {(e, 0): parts for e in self.live}
        return sent, self._fanout.encode(sent, ident, self.cfg.encoding, self.key, self.max_changes_per_part,
                                         self.threads)

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
        detached, resynced = self._changed_ranks
        return replace(report, route_bytes=self.router.sent.to_others, fanout_bytes=self._relayed,
                       detached=tuple(detached), resynced_ranks=tuple(sorted(set(resynced))))

    def _start(self) -> None:
        self._detected, self._relayed, self._changed_ranks = [], 0, ([], [])

    def _send(self, kind: MessageKind, version: int, parts: Mapping[tuple[int, int], Sequence[bytes]],
              tamper: Tamper | None, ranks: Sequence[int]) -> tuple[int, dict[int, EngineReply], list]:
        """Send the engine ranks ``ranks`` their parts (numbered across its shards) and an
        end-of-version marker, through their relay roots (:meth:`RelayPlan.destinations`);
        returns payload bytes put on the transport (after tampering: what really crossed), a
        failed reply for each engine rank a send to failed (the transport's error: a full disk, a
        lost connection), and ``(root, bytes, its other replicas)`` of each send (a rank sent
        its parts directly: no others)."""
        sent, failed, via = 0, {}, []
        self.sent_version = max(self.sent_version, version)
        groups = {g[0]: g[1:] for g in self.relay.groups}
        for e, reach in self.relay.destinations(ranks):
            mine = [(s, p) for (rank, s), ps in sorted(parts.items()) if rank == e for p in ps]
            envs = [Envelope(kind, version, self.transport.rank, i, False, p, shard=s) for i, (s, p) in enumerate(mine)]
            envs = tamper(envs) if tamper else envs
            envs.append(Envelope(kind, version, self.transport.rank, len(mine), True))
            mark = sent
            try:
                for env in envs:
                    self.transport.send(e, env)
                    sent += len(env.body)
                self.transport.flush()
            except TransportError as exc:
                failed[e] = _lost(f"could not send to engine rank {e}: {exc}")
            via.append((e, sent - mark, groups[e] if reach > 1 else ()))
        return sent, failed, via

    def _exchange(self, kind: MessageKind, version: int, parts, tamper: Tamper | None, clock: PhaseClock,
                  ranks: Sequence[int] | None = None) -> tuple[int, list[EngineReply], list[int] | None]:
        """Send ``ranks`` (default: the attached ones) their parts of ``version`` and await their
        replies, in the order of :attr:`live`.  A rank whose process died is detached when another
        replica of its views is attached (refit/replicas.py): the members of its relay group that
        have not answered get the parts again, directly, and it has no reply in the list.  A
        failed send to a rank that cannot be detached returns the failed replies at once.  Also
        returns the replies' flags (:func:`_flags`) summed over the trainer ranks in the
        collective that agrees on detached ranks, for :meth:`_agree`: None, the same on every
        rank, when some trainer rank detached an engine rank there (its flags counted other ranks)."""
        ranks = list(self.live if ranks is None else ranks)
        intact = set(self.relay.groups)  # relay groups whole before this exchange
        direct: set[int] = set()  # sent this version's parts directly (not through a relay)
        got: dict[int, EngineReply] = {}

        def lost(e: int, pending: list[int]) -> bool:
            nonlocal sent
            group = None if self.routes is not None else self.replicas.lose(e)  # routed views: not done
            if group is None:
                return False
            if e not in self._changed_ranks[0]:
                self._changed_ranks[0].append(e)
                self._detected.append(f"engine rank {e} lost (its process died?): detached, its relay group direct")
            self.relay = self.replicas.plan()
            again = [m for m in group if m in ranks and m not in got and m not in direct]
            direct.update(again)
            more, failed, _ = self._send(kind, version, parts, None, again)
            sent += more
            for m in failed:
                if m in pending:
                    pending.remove(m)
                if not lost(m, pending):
                    got[m] = failed[m]
            return True

        with clock(Phase.SEND):
            sent, failed, via = self._send(kind, version, parts, tamper, ranks)
            direct.update(e for e, _, _ in via if e not in failed)
        with clock(Phase.AWAIT):
            if all([lost(e, []) for e in list(failed)]):
                got.update(self._await(version, (MessageKind.ACK, MessageKind.NACK),
                                       ranks=[e for e in ranks if e not in failed], lost=lost))
            else:  # a rank that cannot be detached: the exchange is lost (nothing more awaited)
                got = {**got, **failed}
            now, agreed = self.replicas.agree(self.group, self.engine_ranks,
                                              _flags([got[e] for e in self.live if e in got]))
            self._changed_ranks[0].extend(now)
            self.relay = self.replicas.plan()
        self._relayed += self.replicas.relayed(via, intact, got, direct)
        return sent, [got[e] for e in self.live if e in got], agreed


    def _await(self, version: int, kinds: tuple[MessageKind, ...], query: Query | None = None,
               ranks: Sequence[int] | None = None, lost=None) -> dict[int, EngineReply]:
        """Every engine rank's (of ``ranks``, default the attached ones) reply of one of ``kinds``
        about ``version`` (or answering ``query``), looking at each in turn until none answered for
        ``reply_timeout_s``; other messages are stale and skipped.  No reply, or a malformed one,
        is a failed reply (version -1).  A rank whose connection was lost is first offered to
        ``lost(rank, pending)`` (True: it was detached and has no reply)."""
        pending, got = list(self.live if ranks is None else ranks), {}
        deadline = time.monotonic() + self.cfg.reply_timeout_s
        while pending:
            e = pending.pop(0)
            try:
                env = self.transport.recv(src=e, timeout=max(0.0, min(_POLL_S, deadline - time.monotonic())))
                if env.kind not in kinds or (query is None and env.version != version):
                    pending.insert(0, e)
                    continue
                deadline = time.monotonic() + self.cfg.reply_timeout_s
                reply = EngineReply.from_bytes(env.body)
            except TransportTimeout as exc:
                if time.monotonic() < deadline:
                    pending.append(e)
                    continue
                reply = _lost(f"no reply from engine rank {e} (nor any other) within {self.cfg.reply_timeout_s:g}s: "
                              f"{exc}")
            except TransportError as exc:
                if lost is not None and lost(e, pending):
                    continue
                reply = _lost(f"no reply from engine rank {e}: {exc}")
            except MessageFormatError as exc:
                reply = EngineReply(False, -1, reason=f"malformed reply from engine rank {e}: {exc}")
            if query is None or reply.query == query or reply.version < 0:
                got[e] = reply
            else:
                pending.insert(0, e)
        return got

    def query(self, ask: Ask = Ask.FULL, sample: Sample | None = None) -> list[EngineReply]:
        """Ask every engine rank for its state (version and checksums; ``ask`` selects what, a
        sampled check names its slice); an engine rank the query could not be sent to answers
        with a failed reply (the transport's error)."""
        return self.answers(self.send_query(ask, sample))

    def send_query(self, ask: Ask = Ask.FULL, sample: Sample | None = None) -> tuple[Query, dict[int, EngineReply]]:
        """Send :meth:`query`'s question without awaiting the answers (the engines compute them
        while this rank goes on); returns the query and a failed reply for each engine rank it
        could not be sent to.  :meth:`answers` awaits them; an answer never awaited is dropped
        by the next await (its query id is not the one awaited)."""
        self.queries += 1
        query = Query(ask, self.queries, sample)
        failed: dict[int, EngineReply] = {}
        for e in self.live:
            try:
                self.transport.send(e, Envelope(MessageKind.QUERY, 0, self.transport.rank, body=query.to_bytes()))
                self.transport.flush()
            except TransportError as exc:
                failed[e] = _lost(f"could not send a query to engine rank {e}: {exc}")
        return query, failed

    def answers(self, asked: tuple[Query, dict[int, EngineReply]]) -> list[EngineReply]:
        """The engine ranks' answers to a query :meth:`send_query` sent, in the order of :attr:`live`."""
        query, failed = asked
        got = self._await(0, (MessageKind.STATE,), query, [e for e in self.live if e not in failed])
        return [failed.get(e) or got[e] for e in self.live]

    def _agree(self, replies: Sequence[EngineReply], summed: Sequence[int] | None = None) -> tuple[bool, bool]:
        """(every rank's replies all ok, some rank lost an exchange): collective, the same on
        every rank, unless ``summed`` holds the replies' flags summed already (what
        :meth:`_exchange` returns); a loss leaves the sender :attr:`uncertain`."""
        bad, lost = self.group.sum_ints(_flags(replies)) if summed is None else summed
        self.uncertain = bool(lost)
        return not bad, bool(lost)

    def _verify(self, trainer: Mapping[str, int], replies: Sequence[EngineReply], full: bool,
                current: bool = False, sample: Sample | None = None, live: bool = False) -> VerifyReport:
        """Trainer totals against the engines' (summed) checksums; with routes also every engine
        rank's own views against the mirror (``current``: against the trainer's state, mirror
        plus staged changes; ``sample``: the slice of the committed mirror), so a replica the sums
        count once (TP-replicated norms, a second DP engine) cannot diverge unseen.  Collective;
        every rank gets the same report."""
        names = self.mirror.engine_names(sorted(self.owners))  # the engine's tensors, in one order on every rank
        version = max(r.version for r in replies)
        trainer = self.mirror.trainer_side(trainer, sample)
        if self._fanout is None:  # every rank holds every tensor whole: each rank's own values
            return _each_rank(self.group.sum_u64(trainer, names), self.live, replies, version, full, sample, live)
        local, compared = self._fanout.view_mismatches(self.owned, self._reported_views(replies),
                                                       self.mirror.current_bits if current else None, sample)
        counts = {_VIEWS_COMPARED: compared, _VIEWS_DIFFERING: len(local)}  # summed with the checksums
        totals = self.group.sum_u64({**trainer, **counts}, names + list(counts))
        compared, differing = totals.pop(_VIEWS_COMPARED), totals.pop(_VIEWS_DIFFERING)
        engine: dict[str, int] = {}
        for r in replies:  # canonical partial sums of each rank
            for n, c in r.checksums.items():
                engine[n] = (engine.get(n, 0) + c) & MASK64
        report = compare(totals, engine, version, full, sample, live)
        rows = []
        if differing:  # the rows themselves only when some rank found a view apart
            local = [(n, e, shard, want, got) for n, (e, shard), want, got in local]
            seen = [json.loads(b) for b in self.group.exchange([json.dumps(local).encode()] * self.group.size)]
            rows = sorted({tuple(m) for ms in seen for m in ms}, key=lambda m: (m[0], m[1], m[2]))
        extra = tuple(ChecksumMismatch(n, want, got, where=f"engine rank {e}" + (f" shard {sh}" if sh else ""),
                                       engine_rank=e) for n, e, sh, want, got in rows)
        return replace(report, checked=report.checked + compared, mismatches=report.mismatches + extra)

    def _reported_views(self, replies: Sequence[EngineReply]) -> dict[tuple[int, int], dict[str, int] | None]:
        """Route key -> the view checksums its engine shard reported (None: its rank did not answer;
        empty: it answered without that shard's views, so every view it holds differs)."""
        out: dict[tuple[int, int], dict[str, int] | None] = {}
        for e, r in zip(self.live, replies):
            for key in (k for k in self.routes if k[0] == e):
                out[key] = r.views.get(key[1], {}) if r.ok else None
        return out

    def _live_query(self, full: bool, sample: Sample | None) -> tuple[Query, dict[int, EngineReply]] | None:
        """Send the query of an acknowledged version's live check (``dcr.verify``: a full scan,
        or ``sample``'s slice; None: neither is due), so the engines compute it while this rank
        commits its mirror and compares the deltas' checksums."""
        if full:
            return self.send_query()
        return None if sample is None else self.send_query(Ask.SAMPLED, sample)

    def _check(self, version: int, trainer: Mapping[str, int], replies: Sequence[EngineReply], full: bool,
               sample: Sample | None, live: Mapping[str, int] | None,
               asked: tuple[Query, dict[int, EngineReply]] | None) -> VerifyReport:
        """The comparisons of an acknowledged ``version`` (``dcr.verify``): both sides' full scans
        (``full``), or the checksums the deltas moved and then, with ``sample``, its slice of both
        sides' live tensors (``live``: this rank's partial sums of it); ``asked``: the live
        check's query, sent already (:meth:`_live_query`)."""
        if not full:
            report = self._verify(trainer, replies, full=False)
            if not report.ok or sample is None:
                return report
        state = self.answers(asked)
        if not self._agree(state)[0]:
            why = "; ".join(r.reason for r in state if not r.ok) or "a peer saw a failed answer"
            return VerifyReport(version, full, 0, (ChecksumMismatch(f"(no answer: {why})", None, None),),
                                sample, live=True)
        if full:
            return self._verify(trainer, state, full=True, live=True)
        return self._verify(live or {}, state, full=False, sample=sample, live=True)

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
              sample: Sample | None = None, live: Mapping[str, int] | None = None, tamper: Tamper | None = None,
              base_skew: int = 0, telemetry: Sequence[str] = ()) -> RefitReport:
        """Ship this version's changes; collective over the trainer group.

        After the engines acknowledged, the checksums are compared (:meth:`_check`).  A refusal,
        a gap or a mismatch of the deltas' checksums is recovered at once (resync of what
        differs); a mismatch of a live check is returned uncommitted (its ``verify.live``): the
        caller re-reads its weights (:meth:`DeltaRefit.step <nemo_dcr.refit.DeltaRefit.step>`).
        A lost exchange (a failed send, no reply in time) is returned uncommitted at once and the
        next call recovers first (:attr:`uncertain`).

        Args:
            pieces: this rank's canonical changes since its committed baseline.
            trainer_checksums: this rank's partial checksums of its current weights (a full scan
                with ``full``, else moved by the captured changes).
            full: compare both sides' full scans of their live tensors.
            sample: the slice of a sampled check; ``live`` then holds this rank's partial sums of it.
            tamper: fault injection on the outgoing envelopes.
            base_skew: added to the payload's base version (version-skew fault injection).
            telemetry: further encodings whose payload sizes are measured for the report (not sent).
        """
        if self.uncertain:
            return self.resync(pieces, trainer_checksums, only_differing=True)
        return self._ended(self._refit(pieces, trainer_checksums, full, sample, live, tamper, base_skew, telemetry))

    def _refit(self, pieces, trainer_checksums, full, sample, live, tamper, base_skew, telemetry) -> RefitReport:
        self.refits += 1
        self._start()
        clock = PhaseClock()
        version = self.mirror.version + 1
        with clock(Phase.ROUTE):
            routed = self._route(pieces)
        with clock(Phase.ENCODE):
            owned = self.mirror.changes(routed)
            ident = Identity(self.model, "", self.mirror.version + base_skew, version + base_skew)
            sent_deltas, parts = self._encode(owned, ident)
        sent, replies, agreed = self._exchange(MessageKind.DELTA, version, parts, tamper, clock)
        with clock(Phase.AWAIT):
            ok, lost = self._agree(replies, agreed)
        changed = sum(d.nnz for d in owned)
        with clock(Phase.TELEMETRY):
            sizes = self._telemetry(sent_deltas, telemetry)
            fmt = self.mirror.telemetry(self.cfg.encoding if telemetry else None)
            # Every rank's sizing ends before any rank's verify starts, so no trainer rank's refit
            # phase waits for, or shares the cores with, another rank's telemetry.
            if telemetry:
                self.group.all_true(True)
        if not ok:
            self._detected += [r.reason for r in replies if not r.ok] or ["a peer saw a refusal"]
            if lost:
                return self._failed(version, "delta", changed, sent, clock)
            return self._recover(trainer_checksums, changed, sent, clock)
        with clock(Phase.VERIFY):
            asked = self._live_query(full, sample)
            self.mirror.commit(version, self.threads)
            report = self._check(version, trainer_checksums, replies, full, sample, live, asked)
        if not report.ok:
            self._detected.append("checksum mismatch: " + report.describe())
            if report.live or self.uncertain:
                return self._failed(version, "delta", changed, sent, clock, report)
            return self._recover(trainer_checksums, changed, sent, clock)
        kinds: dict[str, dict[str, int]] = {}
        for d in owned:
            k = kinds.setdefault(layer_type(d.name), {"changed": 0})
            k["changed"] += d.nnz
        return RefitReport(version, "delta", True, False, tuple(self._detected), changed, payload_bytes=sent,
                           bytes_by_encoding={self.cfg.encoding: sent, **sizes}, by_layer_type=kinds,
                           times=clock.seconds, verify=report, engine_format=fmt, engine_seconds=_slowest(replies))

    def _failed(self, version: int, mode: str, changed: int, sent: int, clock: PhaseClock,
                verify: VerifyReport | None = None) -> RefitReport:
        """An uncommitted report of what was detected (nothing recovered in this call)."""
        return RefitReport(version, mode, False, False, tuple(self._detected), changed, payload_bytes=sent,
                           times=clock.seconds, verify=verify)

    def attach(self, pieces: Sequence[SparseDelta], trainer_checksums: Mapping[str, int]) -> RefitReport:
        """(Re)start: ``pieces`` are all nonzero elements (captured against a zero baseline).

        The mirror starts from zeros, so mirror plus ``pieces`` is the trainer's state; the
        engine's full checksums decide which tensors (if any) need a resync.  Each rank sends the
        owners its view of their tensors (refit/route_views.py).
        """
        self._start()
        self.uncertain = False
        clock = PhaseClock()
        with clock(Phase.ROUTE):
            owned = self.mirror.changes(self._route(pieces, attach=True))
            self.mirror.stage(owned, 1)
        return self._ended(self._recover(trainer_checksums, sum(d.nnz for d in owned), 0, clock, mode="attach"))

    def resync(self, pieces: Sequence[SparseDelta], trainer_checksums: Mapping[str, int],
               only_differing: bool = False) -> RefitReport:
        """Send every owned tensor whole (this version's changes included) through the protocol;
        ``only_differing``: the tensors whose checksums differ from the engines' full scan (the
        recovery after a lost exchange)."""
        return self._ended(self._whole(pieces, trainer_checksums, only_differing))

    def _whole(self, pieces: Sequence[SparseDelta], trainer_checksums: Mapping[str, int],
               only_differing: bool) -> RefitReport:
        self.refits += 1
        self._start()
        self._detected = ["recovering after a lost exchange with the engines"] if only_differing else []
        clock = PhaseClock()
        with clock(Phase.ROUTE):
            owned = self.mirror.changes(self._route(pieces))
            self.mirror.stage(owned, self.mirror.version + 1)
        changed = sum(d.nnz for d in owned)
        if only_differing:
            return self._recover(trainer_checksums, changed, 0, clock, mode="resync")
        state = self.query()
        ok, lost = self._agree(state)
        if lost:
            self._detected += [r.reason for r in state if not r.ok]
            return self._failed(self.mirror.version, "resync", changed, 0, clock)
        target = max([r.version for r in state] + [self.mirror.version, self.sent_version]) + 1
        return self._resync(self.owned, target, trainer_checksums, changed, 0, clock, mode="resync", before=None)

    def reattach(self, ranks: Sequence[int], trainer_checksums: Mapping[str, int]) -> RefitReport:
        """Address the detached ``ranks`` again (restarted processes whose connections the
        transport replaced; refit/replicas.py) and bring them to the others' version through the
        recovery: their full checksums decide what they get, resynced to them alone when every
        other rank holds the trainer's state (``trainer_checksums``: the committed weights').
        Collective."""
        self._start()
        self.replicas.reattach(ranks)
        self.relay = self.replicas.plan()
        self._detected.append(f"engine ranks {sorted(ranks)} reattached (restarted)")
        return self._ended(self._recover(trainer_checksums, 0, 0, PhaseClock(), mode="resync"))

    # -- recovery -----------------------------------------------------------------------------

    def _resync_parts(self, names: Sequence[str], target: int) -> dict[tuple[int, int], list[bytes]]:
        if self._fanout is not None:
            return self._fanout.resync_payloads(names, target, self.key, self.model)
        payload = resync_payload(self.mirror.current(names), target, self.key, model=self.model)
        return {(e, 0): [payload] for e in self.live}

    def _recover(self, trainer_checksums, changed: int, sent: int, clock: PhaseClock,
                 mode: str = "delta") -> RefitReport:
        with clock(Phase.VERIFY):
            state = self.query()
            _, lost = self._agree(state)
            if lost:
                self._detected += [r.reason for r in state if not r.ok]
                return self._failed(self.mirror.version, mode, changed, sent, clock)
            before = self._verify(trainer_checksums, state, full=True, current=True)
        engine_version = max(r.version for r in state)
        if before.ok:  # the engines hold the trainer's state already: settle there
            self._reset(self.owned, engine_version)
            return RefitReport(engine_version, mode, True, False, tuple(self._detected), changed,
                               payload_bytes=sent, times=clock.seconds, verify=before)
        if mode == "attach":
            self._detected.append("trainer and engine differ at (re)start: " + before.describe())
        bad = {self.mirror.canonical_name(m.name) for m in before.mismatches}
        target, ranks = max(engine_version, self.mirror.version, self.sent_version) + 1, None
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
        version = {e: r.version for e, r in zip(self.live, state)}
        good = {version[e] for e in self.live if e not in failing}
        if not failing or len(good) != 1 or any(version[e] >= min(good) for e in failing):
            return None
        return good.pop(), [e for e in self.live if e in failing]

    def _resync(self, names: Sequence[str], target: int, trainer_checksums, changed: int, sent: int,
                clock: PhaseClock, mode: str, before: VerifyReport | None,
                ranks: Sequence[int] | None = None) -> RefitReport:
        """Send ``names`` whole at version ``target`` to ``ranks`` (default all engine ranks; the
        others hold ``target`` already and go on)."""
        with clock(Phase.ENCODE):
            parts = self._resync_parts(names, target)
        self._changed_ranks[1].extend(self.live if ranks is None else ranks)
        more, replies, agreed = self._exchange(MessageKind.RESYNC, target, parts, None, clock, ranks)
        sent += more
        with clock(Phase.AWAIT):
            ok, _ = self._agree(replies, agreed)
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
                           times=clock.seconds, verify=after, engine_seconds=_slowest(replies))


def _flags(replies: Sequence[EngineReply]) -> list[int]:
    """``[some reply failed, some exchange was lost]`` of one trainer rank's replies (summed by
    :meth:`RefitSender._agree`)."""
    return [int(not all(r.ok for r in replies)), int(any(r.version < 0 for r in replies))]


def _slowest(replies: Sequence[EngineReply]) -> dict[str, float]:
    """The largest of each ``seconds`` key over the engine ranks' replies."""
    out: dict[str, float] = {}
    for r in replies:
        for k, v in r.seconds.items():
            out[k] = max(out.get(k, 0.0), v)
    return out


def _each_rank(totals: Mapping[str, int], ranks: Sequence[int], replies: Sequence[EngineReply], version: int,
               full: bool, sample: Sample | None = None, live: bool = False) -> VerifyReport:
    """Trainer totals against every engine rank's own values (engine ranks holding every tensor
    whole, e.g. data-parallel replicas: each is a full copy, so each is compared)."""
    reports = [compare(totals, r.checksums, version, full, sample, live) for r in replies]
    if len(reports) == 1:
        return replace(reports[0], mismatches=tuple(replace(m, engine_rank=ranks[0]) for m in reports[0].mismatches))
    bad = tuple(replace(m, where=f"engine rank {e}", engine_rank=e) for e, rep in zip(ranks, reports)
                for m in rep.mismatches)
    return VerifyReport(version, full, sum(r.checked for r in reports), bad, sample, live)
