"""Engine side of the refit protocol: collect every sender's parts of a version, apply them as one
transaction, reply to every sender.

A version is complete when each sender's last part (an empty end-of-version marker) arrived
and its part indices are contiguous; a missing part is answered with a NACK (nothing applied),
duplicate parts are ignored, parts may arrive in any order, and parts for versions the engine
already moved past are dropped (replays).  Every refusal and rollback leaves the engine at its
old version, bit for bit (:mod:`nemo_dcr.apply.transaction`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Sequence

from nemo_dcr.apply import Engine, apply_version
from nemo_dcr.transport import Envelope, MessageKind, Transport, TransportError

from .messages import Ask, EngineReply, MessageFormatError, Query


@dataclass
class ServerStats:
    """What the engine saw, counted as it happened: commits, refusals by exception type, parts
    dropped as replays or duplicates, parts put back in order; ``events`` keeps each of them with
    its version (``(version, what, detail)``) so a harness can tell which refit saw what."""

    committed: int = 0
    resyncs: int = 0
    refused: dict[str, int] = field(default_factory=dict)
    answers_shared: int = 0
    """Queries answered with the answer computed for another sender's same query at the same
    version (one computation per round of the trainer ranks' queries)."""
    replays_dropped: int = 0
    duplicates_dropped: int = 0
    reordered: int = 0
    """Parts that arrived after a later part of the same sender and version (put back in order)."""
    events: list[tuple[int, str, str]] = field(default_factory=list)

    def note(self, version: int, what: str, detail: str = "") -> None:
        """Record one event of ``version``."""
        self.events.append((version, what, detail))


SHARED_ANSWER_S = 10.0
"""Seconds an engine rank's answer to a query is given to the other trainer ranks asking the
same (:meth:`EngineServer._answer`); later, the same query is computed anew."""


class EngineServer:
    """Serves one engine over a transport, through the members of the engine contract
    (:class:`nemo_dcr.apply.Engine`) only.

    Args:
        engine: the engine.
        transport: this engine rank's endpoint.
        senders: trainer ranks that send parts of every version.
    """

    def __init__(self, engine: Engine, transport: Transport, senders: Sequence[int]):
        self.engine = engine
        self.transport = transport
        self.senders = list(senders)
        self.stats = ServerStats()
        self._parts: dict[tuple[int, int], dict[int, dict[int, Envelope]]] = {}
        self._first: dict[tuple[int, int], float] = {}  # when a version's first part arrived
        self._shared: tuple[tuple, EngineReply, set[int], float] | None = None  # key, answer, senders, when

    def serve(self, timeout: float | None = None) -> None:
        """Handle messages until a STOP arrives."""
        while self.handle(self.transport.recv(timeout=timeout)):
            pass

    def handle(self, env: Envelope) -> bool:
        """Handle one message; False on STOP."""
        if env.kind == MessageKind.STOP:
            return False
        if env.kind == MessageKind.QUERY:
            self._reply(MessageKind.STATE, self.engine.version, [env.sender], self._answer(env))
        elif env.kind in (MessageKind.DELTA, MessageKind.RESYNC):
            self._shared = None
            self._collect(env)
        return True

    def _answer(self, env: Envelope) -> EngineReply:
        """The answer to a QUERY envelope; a malformed query or a failing engine member is answered
        with a refusal naming why (the server keeps serving).

        Every trainer rank asks the same query in a check (the sender sums their answers), so the
        engine computes an answer once per round: a sender that has not had the last answer yet,
        asking the same (ask, slice) at the same version, gets it again with its own query id
        (``stats.answers_shared``).  A sender's second such query starts a new round and is
        computed anew, as is every query after a DELTA or RESYNC part arrived or more than
        :data:`SHARED_ANSWER_S` after the answer was computed."""
        try:
            if env.version != 0:
                raise MessageFormatError(f"a QUERY envelope carries version 0, got {env.version} (a query says "
                                         "what it asks in its body)")
            query = Query.from_bytes(env.body)
        except MessageFormatError as exc:
            self.stats.note(self.engine.version, "bad-query", f"from {env.sender}: {exc}")
            return EngineReply(False, self.engine.version, reason=f"MessageFormatError: {exc}")
        key, now = (query.ask, query.sample, self.engine.version), time.monotonic()
        if (self._shared is not None and self._shared[0] == key and env.sender not in self._shared[2]
                and now - self._shared[3] < SHARED_ANSWER_S):
            self._shared[2].add(env.sender)
            self.stats.answers_shared += 1
            return replace(self._shared[1], query=query)
        try:
            reply = self._state(query)
        except Exception as exc:  # e.g. a full scan while a version is prepared
            return EngineReply(False, self.engine.version, reason=f"{type(exc).__name__}: {str(exc)[:500]}",
                               query=query)
        self._shared = (key, reply, {env.sender}, now)
        return reply

    def _state(self, query: Query) -> EngineReply:
        if query.ask == Ask.PLACEMENT:
            return EngineReply(True, self.engine.version, placement=self.engine.placement(), query=query)
        if query.ask == Ask.PREFLIGHT:
            diffs = self.engine.preflight()
            reason = f"PreflightError: {len(diffs)} differ: " + "; ".join(diffs)[:1500] if diffs else ""
            return EngineReply(not diffs, self.engine.version, reason=reason, query=query)
        ck = self.engine.checksums(full=query.ask in (Ask.FULL, Ask.DIGESTS), sample=query.sample)
        dg = self.engine.digests() if query.ask == Ask.DIGESTS else {}
        return EngineReply(True, self.engine.version, checksums=ck.canonical, digests=dg, views=ck.views, query=query)

    def _collect(self, env: Envelope) -> None:
        if env.version <= self.engine.version:
            self.stats.replays_dropped += 1
            self.stats.note(env.version, "replay", f"part {env.part} from {env.sender}")
            return
        self._first.setdefault((int(env.kind), env.version), time.perf_counter())
        per_sender = self._parts.setdefault((int(env.kind), env.version), {})
        got = per_sender.setdefault(env.sender, {})
        if env.part in got:
            self.stats.duplicates_dropped += 1
            self.stats.note(env.version, "duplicate", f"part {env.part} from {env.sender}")
            return
        if got and env.part < max(got):
            self.stats.reordered += 1
            self.stats.note(env.version, "reordered", f"part {env.part} from {env.sender} after {max(got)}")
        got[env.part] = env
        if all(s in per_sender and _finished(per_sender[s]) for s in self.senders):
            del self._parts[(int(env.kind), env.version)]
            first = self._first.pop((int(env.kind), env.version))
            self._complete(env.kind, env.version, per_sender, {"parts": time.perf_counter() - first})

    def _complete(self, kind: MessageKind, version: int, per_sender, seconds: dict[str, float]) -> None:
        """Apply a version whose parts all arrived and answer every sender; ``seconds`` (the parts'
        arrival) gets the apply's and the checksums' wall seconds (the reply's ``seconds``)."""
        missing = [s for s in self.senders if len(per_sender[s]) != _last(per_sender[s]) + 1]
        if missing:
            self._refuse(version, "MissingPartError", f"parts missing from senders {missing}", seconds)
            return
        t0 = time.perf_counter()
        try:
            result = apply_version(self.engine, self._parts_by_shard(per_sender), resync=kind == MessageKind.RESYNC)
        except Exception as exc:  # refused or rolled back: the engine holds its old version
            seconds["apply"] = time.perf_counter() - t0
            self._refuse(version, type(exc).__name__, str(exc)[:500], seconds)
            return
        t1 = time.perf_counter()
        self.stats.committed += 1
        self.stats.resyncs += int(result.resync)
        self.stats.note(version, "committed", "resync" if result.resync else "delta")
        ck = self.engine.checksums()
        seconds.update(apply=t1 - t0, checksums=time.perf_counter() - t1)
        reply = EngineReply(True, self.engine.version, checksums=ck.canonical, touched=result.touched, views=ck.views,
                            seconds=seconds)
        self._reply(MessageKind.ACK, version, self.senders, reply)
        for key in [k for k in self._parts if k[1] <= self.engine.version]:
            del self._parts[key]
            self._first.pop(key, None)

    def _parts_by_shard(self, per_sender) -> dict[int, list[bytes]]:
        """Every sender's bodies in part order, by the shard each envelope names."""
        by_shard: dict[int, list[bytes]] = {}
        for s in self.senders:
            for _, e in sorted(per_sender[s].items()):
                if e.body:
                    by_shard.setdefault(e.shard, []).append(e.body)
        return by_shard

    def _refuse(self, version: int, kind: str, message: str, seconds: dict[str, float] | None = None) -> None:
        self.stats.refused[kind] = self.stats.refused.get(kind, 0) + 1
        self.stats.note(version, "refused", f"{kind}: {message}")
        reply = EngineReply(False, self.engine.version, reason=f"{kind}: {message}", seconds=seconds or {})
        self._reply(MessageKind.NACK, version, self.senders, reply)

    def _reply(self, kind: MessageKind, version: int, dsts, reply: EngineReply) -> None:
        """Send ``reply`` to each of ``dsts``; one the transport cannot deliver (a full disk, a
        sender that died) is recorded as a ``reply-lost`` event and the server keeps serving
        (that sender times out and recovers)."""
        for d in dsts:
            try:
                self.transport.send(d, Envelope(kind, version, self.transport.rank, body=reply.to_bytes()))
            except TransportError as exc:
                self.stats.note(version, "reply-lost", f"to {d}: {str(exc)[:300]}")
        try:
            self.transport.flush()
        except TransportError as exc:
            self.stats.note(version, "reply-lost", str(exc)[:300])


def _last(parts: dict[int, Envelope]) -> int:
    return max(i for i, e in parts.items() if e.last)


def _finished(parts: dict[int, Envelope]) -> bool:
    return any(e.last for e in parts.values())
