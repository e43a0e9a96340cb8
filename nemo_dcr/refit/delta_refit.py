"""The post-optimizer-step refit: the one path every entry point drives (docs/refit.md).

Algorithm-agnostic: GRPO, PPO, distillation or any loop calls :meth:`DeltaRefit.step` right
after ``optimizer.step()`` (or lets :meth:`DeltaRefit.attach_to` do it)::

    refit = DeltaRefit.from_config(cfg.dcr, model, optimizer, engine=engine)  # collective
    refit.attach()                   # first sync: checksums decide what (if anything) to send
    for batch in data:
        loss.backward(); optimizer.step()      # the hook runs refit.step() here
    refit.close()

Every trainer rank calls :meth:`step` (it is collective).  Per step each rank:

1. **captures** the changed elements of its own slice of its own shard against its baseline of
   what the engine holds (integer views);
2. **remaps** them to canonical (HF) names and indices by pure index arithmetic;
3. **routes** each canonical piece to the trainer rank that owns that tensor (the rank capturing
   most of it; coded with ``dcr`` against the sender's view of the tensor, which both keep), which
   merges the pieces and **encodes** them against its mirror of the engine's bits, so encoding is
   split over all trainer ranks;
4. **sends** payload bytes over the configured transport to the engine rank(s), where an
   :class:`~nemo_dcr.refit.server.EngineServer` applies all parts of the version as one
   transaction (validate, write with an undo log, verify, commit or roll back);
5. **verifies** after the acknowledgement: the trainer ranks' partial checksums of their live
   params, summed over ranks, must equal the engine's; a refusal, a gap or a mismatch triggers a
   resync of the tensors that differ through the same path;
6. **commits** its capture baseline only when the engine holds the new version (otherwise the
   changes accumulate into the next refit).

A resync (first sync of an empty engine, ``full_resync_interval``, ``enabled: false``, recovery)
is the same protocol at 100% density, in the same kind of transaction.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from typing import Any, Sequence

from nemo_dcr.apply import Engine, PreflightError
from nemo_dcr.apply.placement import placement_from_json
from nemo_dcr.capture import BaselineStore, capture
from nemo_dcr.codec.auth import read_key_file
from nemo_dcr.codec.stats import layer_type
from nemo_dcr.config.schema import DcrConfig
from nemo_dcr.kernels.traffic import HostDeviceBytes, measure
from nemo_dcr.transport import Envelope, MessageKind
from nemo_dcr.types import SparseDelta
from nemo_dcr.telemetry.phases import TOTAL, TOTAL_SLOWEST_RANK, Phase, PhaseClock, total_seconds
from nemo_dcr.verify.checksum import checksums_after

from .fp8_mirror import sender_mirror
from .group import TrainerGroup
from .messages import ENGINE_SECONDS, Ask
from .refit_report import RefitReport
from .route_views import Router
from .routing import assign_owners, gather_captured
from .relay import relay_plan
from .sender import RefitSender, Tamper, checks_due
from .server import EngineServer
from .source import TrainerSource, source_for
from .wiring import Wiring, colocated_wiring


class DeltaRefit:
    """Bit-exact delta refit of an engine from a sharded trainer; see the module docstring.

    Args:
        cfg: the ``dcr`` config block.
        source: this rank's :class:`~nemo_dcr.refit.source.TrainerSource`.
        wiring: this rank's transport endpoint, the engines' ranks and the trainer group
            (see :mod:`nemo_dcr.refit.wiring`).
        engine: an engine this process hosts (colocated); its server runs in a thread.
        key: HMAC key of the payloads (default: read from ``cfg.key_file``).
        model: model name carried in payload headers.
    """

    def __init__(self, cfg: DcrConfig, source: TrainerSource, wiring: Wiring, engine: Engine | None = None,
                 key: bytes | None = None, model: str = ""):
        cfg.validate()
        self.cfg = cfg
        self.source = source
        self.wiring = wiring
        self.group: TrainerGroup = wiring.group
        self.key = key if key is not None else (read_key_file(cfg.key_file) if cfg.key_file else None)
        self.refits = 0
        self.closed = False
        sizes = {n: _numel(s) for n, (_, s) in source.canonical.items()}
        members = gather_captured(self.group, source.captured(), sorted(sizes))  # collective
        self.hosts = members.hosts
        owners = assign_owners(sizes, self.group.size, members.shares)
        mirror = sender_mirror(cfg, source.canonical, [n for n, r in owners.items() if r == self.group.rank])
        router = Router(self.group, owners, source.canonical, self.key, members.hosts)
        self.sender = RefitSender(cfg, self.key, self.group, wiring.transport, wiring.engine_ranks, owners,
                                  mirror, router, model=model,
                                  relay=relay_plan(cfg, wiring.engine_ranks, wiring.relay))
        self.store = self._new_store()
        self._checksums: dict[str, int] = {}
        self._server: EngineServer | None = None
        self._thread: threading.Thread | None = None
        if engine is not None:
            self._host(engine)

    @classmethod
    def from_config(cls, cfg: DcrConfig, model: Any, optimizer=None, engine: Engine | None = None, *,
                    engine_rank: int = 0, wiring: Wiring | None = None, key: bytes | None = None,
                    **source_options) -> DeltaRefit:
        """Build the refit of a model (collective over the trainer ranks).

        Args:
            cfg: the ``dcr`` block.
            model: a :class:`TrainerSource`, or a model of a registered framework (megatron-core
                model chunks: the description is derived from the model itself).
            optimizer: when given, :meth:`attach_to` runs :meth:`step` after each ``step()``.
            engine: the engine, on the trainer rank ``engine_rank`` that hosts it (colocated).
            engine_rank: trainer rank hosting ``engine`` (with the default wiring).
            wiring: transport and engine ranks (default: :func:`colocated_wiring` of ``cfg``).
            key: HMAC key (default: ``cfg.key_file``).
            **source_options: passed to the framework's source builder (e.g. ``vocab_size``).
        """
        source = source_for(model, **source_options)
        if wiring is None:
            wiring = colocated_wiring(cfg, engine_rank, key if key is not None else _key(cfg))
        hosted = engine if wiring.hosts_engine else None
        if engine is not None and hosted is None:
            raise ValueError(f"an engine was passed on trainer rank {wiring.group.rank}, but the wiring hosts "
                             f"the engine on rank {engine_rank}")
        refit = cls(cfg, source, wiring, hosted, key, model=getattr(source, "name", ""))
        if optimizer is not None:
            refit.attach_to(optimizer)
        return refit

    # -- hosting a colocated engine -------------------------------------------------------------

    def _host(self, engine: Engine) -> None:
        if self.wiring.engine_transport is None:
            raise ValueError("this rank hosts an engine but the wiring gives it no engine endpoint")
        self._server = EngineServer(engine, self.wiring.engine_transport, self.wiring.trainer_ranks)
        self._thread = threading.Thread(target=self._server.serve, name="nemo-dcr-engine", daemon=True)
        self._thread.start()

    @property
    def server(self) -> EngineServer | None:
        """The engine server this rank hosts (None elsewhere)."""
        return self._server

    # -- the refit --------------------------------------------------------------------------------

    def _new_store(self) -> BaselineStore:
        d = self.cfg.baseline_dir and f"{self.cfg.baseline_dir}/rank{self.group.rank}"
        return BaselineStore(self.cfg.baseline, d)

    def attach(self) -> RefitReport:
        """First sync of this trainer with the engine (collective; call once before training).

        Every captured element goes to its owner's mirror; full checksums of both sides decide
        which tensors (if any) are sent: an engine loaded from the same weights costs no
        transfer, an empty engine gets everything, a resumed trainer sends what moved.

        With ``dcr.preflight`` every engine then compares what it holds with its own dense load of
        the same weights (:meth:`nemo_dcr.apply.Engine.preflight`).

        Raises:
            RuntimeError: the engine refused the first sync (its reason is in the message).
            PreflightError: an engine differs from its own load of the attach weights.
        """
        t0 = time.perf_counter()
        report = self._read_weights()
        if not report.committed:
            raise RuntimeError(f"the engine refused the first sync: {'; '.join(report.detected)}")
        if self.cfg.preflight:
            clock = PhaseClock()
            with clock(Phase.PREFLIGHT):
                self._preflight()
            report = replace(report, times={**report.times, **clock.seconds})
        return self._finish(report, None, t0)

    def _read_weights(self) -> RefitReport:
        """Read the trainer's weights afresh (a new capture baseline, mirror and checksums from
        the live params) and bring the engines to them: the first sync, and the answer to a
        live check that found trainer and engine apart (a missed capture, a stray write)."""
        clock = PhaseClock()
        with clock(Phase.PLACEMENT):
            self._route_by_placement()
        with clock(Phase.CAPTURE):
            self.store = self._new_store()
            for k, p in self.source.params.items():
                self.store.register(k, p)
            pieces = self.source.pieces()
        with clock(Phase.CHECKSUM):
            self._checksums = self.source.checksums()
        report = self.sender.attach(pieces, self._checksums)
        return replace(report, times={**clock.seconds, **report.times})

    def reattach(self, ranks: Sequence[int]) -> RefitReport:
        """Engine ranks detached after their process died (:attr:`RefitReport.detached`) are
        back, restarted, their connections replaced in the transport: bring them to the others'
        version, each resynced alone (:meth:`RefitSender.reattach`; collective)."""
        t0 = time.perf_counter()
        return self._finish(self.sender.reattach(ranks, self._checksums), None, t0)

    def _preflight(self) -> None:
        """Every engine against its own dense load of what it now holds (``dcr.preflight``).

        Raises:
            PreflightError: naming what differs, on which engine rank.
        """
        failed = [f"engine rank {e}: {r.reason}" for e, r in zip(self.sender.live, self.sender.query(Ask.PREFLIGHT))
                  if not r.ok]
        if failed:
            raise PreflightError(failed)

    def _route_by_placement(self) -> None:
        """Ask the engines where they hold each canonical element; route records per engine rank
        when they hold shards (an engine holding canonical tensors whole reports nothing)."""
        replies = self.sender.query(Ask.PLACEMENT)
        failed = [r.reason for r in replies if not r.ok]
        if failed:
            raise RuntimeError(f"engines did not answer the placement query: {failed}")
        if any(r.placement for r in replies):
            missing = [e for e, r in zip(self.sender.live, replies) if not r.placement]
            if missing:
                raise RuntimeError(f"engine ranks {missing} hold canonical tensors whole while others hold shards")
            routes = {(e, s): placement_from_json(p) for e, r in zip(self.sender.live, replies)
                      for s, p in enumerate(r.placement)}
            self.sender.set_routes(routes)

    def step(self, tamper: Tamper | None = None, base_skew: int = 0) -> RefitReport:
        """Refit the engine to the trainer's current weights (collective; call after the step).

        Args:
            tamper: fault injection on outgoing payload envelopes (chaos).
            base_skew: added to the payload's base version (chaos: version skew).
        """
        if self.closed:
            raise RuntimeError("DeltaRefit.step after close()")
        with measure() as crossed:  # this rank's host <-> device copies (an in-process engine counts its own)
            return self._step(tamper, base_skew, crossed)

    def _step(self, tamper: Tamper | None, base_skew: int, crossed: HostDeviceBytes) -> RefitReport:
        t0 = time.perf_counter()
        self.refits += 1
        version = self.refits
        clock = PhaseClock()
        pieces = self._capture_pieces(version, clock)
        full, sample = checks_due(self.cfg, self.refits)
        with clock(Phase.CHECKSUM):
            current = self.source.checksums() if full else checksums_after(self._checksums, pieces)
            live = None if sample is None else self.source.checksums(sample)
        every = self.cfg.full_resync_interval
        if not self.cfg.enabled or (every and self.refits % every == 0):
            report = self.sender.resync(pieces, current)
        else:
            report = self.sender.refit(pieces, current, full=full, sample=sample, live=live, tamper=tamper,
                                       base_skew=base_skew, telemetry=self.cfg.telemetry_encodings)
        if report.committed:
            self._checksums = current
        elif report.verify is not None and report.verify.live and not self.sender.uncertain:
            found = self._read_weights()  # a live check found them apart: re-read, resync what differs
            report = replace(found, mode="resync", detected=report.detected + found.detected,
                             payload_bytes=report.payload_bytes + found.payload_bytes,
                             times=_added(report.times, found.times))
            version = None  # the new baseline holds the live weights already
        report = replace(report, times=_added(clock.seconds, report.times))
        return self._finish(report, version, t0, crossed)

    def _capture_pieces(self, version: int, clock: PhaseClock) -> list[SparseDelta]:
        with clock(Phase.CAPTURE):
            deltas = capture(self.source.params, self.store, self.source.ranges, version=version,
                             threads=self.sender.threads)
        with clock(Phase.REMAP):
            return [p for d in deltas for p in self.source.remap(d)]

    def _finish(self, report: RefitReport, version: int | None, t0: float,
                crossed: HostDeviceBytes | None = None) -> RefitReport:
        times = dict(report.times)
        with PhaseClock(times)(Phase.COMMIT):
            if report.committed and version is not None:
                self.store.commit(version)
        times[TOTAL] = total_seconds(time.perf_counter() - t0, times)
        crossed = crossed or HostDeviceBytes()
        return self._totals(replace(report, times=times, host_device_bytes={
            "to_host": crossed.to_host, "to_device": crossed.to_device}))

    def _totals(self, report: RefitReport) -> RefitReport:
        """Sum this refit's counts over the trainer ranks (every rank gets the same report)."""
        kinds = sorted({layer_type(n) for n in self.source.canonical})
        encs = sorted(set(self.cfg.telemetry_encodings) | {self.cfg.encoding})
        fmt = sorted(report.engine_format)  # the same keys on every rank (same format, same outcome)
        local = [report.changed, report.payload_bytes, self.sender.mirror.dense_bytes()]
        local += [report.by_layer_type.get(k, {}).get("changed", 0) for k in kinds]
        local += [report.bytes_by_encoding.get(e, 0) for e in encs]
        local += [report.engine_format.get(k, 0) for k in fmt] + [report.fanout_bytes]
        sides = sorted(report.host_device_bytes)
        local += [report.host_device_bytes[k] for k in sides]
        hosts, links = self._host_links(report)
        summed = self.group.sum_ints(local + links)
        summed, links = summed[:len(local)], summed[len(local):]
        slowest, *engine = self.group.max_floats([report.times.get(TOTAL, 0.0)] +  # every key on every rank
                                                 [report.engine_seconds.get(k, -1.0) for k in ENGINE_SECONDS])
        numel = {k: 0 for k in kinds}
        for n, (dtype, shape) in self.source.canonical.items():
            numel[layer_type(n)] += _numel(shape)
        by_kind = {k: {"changed": summed[3 + i], "numel": numel[k]} for i, k in enumerate(kinds)}
        sizes = {e: summed[3 + len(kinds) + i] for i, e in enumerate(encs)} if report.mode == "delta" else {}
        at = 3 + len(kinds) + len(encs)
        counts = dict(zip(fmt, summed[at:at + len(fmt)]))
        fanout = summed[at + len(fmt)]
        crossed = dict(zip(sides, summed[at + len(fmt) + 1:]))
        by_host = {h: dict(zip(HOST_LINKS, links[3 * i:3 * i + 3])) for i, h in enumerate(hosts)}
        return replace(report, changed=summed[0], payload_bytes=summed[1], numel=sum(numel.values()),
                       dense_bytes=summed[2], by_layer_type=by_kind, bytes_by_encoding=sizes, engine_format=counts,
                       route_bytes=sum(v["trainer_to_trainer"] for v in by_host.values()), bytes_by_host=by_host,
                       fanout_bytes=fanout, host_device_bytes=crossed,
                       engine_seconds={k: v for k, v in zip(ENGINE_SECONDS, engine) if v >= 0},
                       times={**report.times, TOTAL_SLOWEST_RANK: slowest})

    def _host_links(self, report: RefitReport) -> tuple[list[str], list[int]]:
        """The hosts of the trainer ranks (sorted) and this rank's bytes in its host's slots
        (:data:`HOST_LINKS` each), zeros in the others: summed, each host's links."""
        hosts = sorted(set(self.hosts))
        mine = hosts.index(self.hosts[self.group.rank])
        links = [0] * (3 * len(hosts))
        sent = self.sender.router.sent
        links[3 * mine:3 * mine + 3] = [report.route_bytes, report.payload_bytes, sent.to_other_hosts]
        return hosts, links

    # -- hook and shutdown -------------------------------------------------------------------------

    def attach_to(self, optimizer) -> None:
        """Run :meth:`step` after every ``optimizer.step()`` (wraps the bound method);
        the report of the last refit is :attr:`last_report`."""
        inner = optimizer.step

        def step(*args, **kwargs):
            out = inner(*args, **kwargs)
            self.last_report = self.step()
            return out

        optimizer.step = step

    def wait(self) -> float:
        """Wait until the work the last :meth:`step` left behind its report on this rank is done
        (the kept class indexes' moves, which the next step would wait for; in an RL job they run
        beside the rollouts); returns the seconds waited.  A benchmark calls it before timing
        anything else on the same cores, so that work is not charged to what it times."""
        t0 = time.perf_counter()
        self.sender.wait()
        return time.perf_counter() - t0

    def close(self, timeout: float = 60.0) -> None:
        """Stop the hosted engine server (if any) and close the transport (collective)."""
        if self.closed:
            return
        self.closed = True
        if self._thread is not None:
            t = self.wiring.transport
            t.send(self.wiring.engine_transport.rank, Envelope(MessageKind.STOP, 0, t.rank))
            t.flush()
            self._thread.join(timeout)
        self.wiring.close(timeout)


HOST_LINKS = ("trainer_to_trainer", "trainer_to_engine", "trainer_to_other_hosts")
"""The links of :attr:`RefitReport.bytes_by_host`, per host, in this order."""


def _added(*times: dict[str, float]) -> dict[str, float]:
    """Phase seconds of several spans of one call, added per phase."""
    out: dict[str, float] = {}
    for t in times:
        for k, v in t.items():
            out[k] = out.get(k, 0.0) + v
    return out


def _key(cfg: DcrConfig) -> bytes | None:
    return read_key_file(cfg.key_file) if cfg.key_file else None


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n

