"""Policy side of the NeMo-RL plugin: one policy worker of the refit's trainer group.

The first sync of a session decides, on every policy worker at once (one ``all_true`` over the
trainer group, so all take the same path), where the refit reads the weights:

* **shards** (a Megatron policy worker, :func:`.shards.policy_shards`): the one refit path's
  capture / remap / encode runs on the worker's own megatron-core shards
  (:class:`~nemo_dcr.integrations.megatron.MegatronSource`, as in the main job); NeMo-RL's
  export iterator is never started, so Megatron-Bridge's export and its gathers do not run, and
  no worker keeps a copy of the model.
* **export** (anything else, said once in the log with the reason): every worker drains
  NeMo-RL's export (Megatron Bridge yields the full HF tensors on every rank, by collectives,
  so every rank iterates it to the end) and keeps a CPU copy of only the canonical tensors it
  *owns* (:func:`nemo_dcr.refit.routing.assign_owners`, the owners the refit itself uses, so
  routing moves nothing between ranks): a :class:`~nemo_dcr.refit.canonical.CanonicalSource`.

Either source feeds one :class:`~nemo_dcr.refit.DeltaRefit` whose trainer group runs over the
store transport (:class:`~nemo_dcr.refit.group.TransportGroup`): each ``send_weights`` is one
``attach()`` (first sync of a session: the engines' checksums decide what to send; vLLM starts
from dummy weights, so everything) or one ``step()``.

A failure anywhere in that attempt (an exception on any policy or rollout worker, a refit that
did not commit) ends it for every party (:class:`~.session.SyncAborted`) and the sync resyncs at
once through the same path (a fresh ``attach()`` from the live shards or the owned copies:
checksums decide what to send); only when that fails too, or when the export itself was bad (it
is read once), does ``send_weights`` raise, naming the rank and cause of each attempt.  Policy
rank 0 then tells every rollout worker that the sync is over (an ``END`` with a successful
:class:`~.session.SyncOutcome`).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Iterable, Mapping

import torch

from nemo_dcr.refit import DeltaRefit, RefitReport, engine_wiring
from nemo_dcr.refit.canonical import CanonicalSource
from nemo_dcr.refit.group import TransportGroup
from nemo_dcr.refit.routing import assign_owners
from nemo_dcr.refit.source import TrainerSource
from nemo_dcr.telemetry import Phase, PhaseClock
from nemo_dcr.types import DTYPES

from .options import PluginOptions
from .session import ATTEMPTS, SyncAborted, SyncOutcome, SyncTransport, Topology, remove_other_sessions, remove_stale
from .shards import policy_shards
from .sync_log import log_once, log_sync, log_unloaded

SHARDS, EXPORT = "shards", "export"
"""Where the refit reads the policy's weights (:attr:`PolicySide.capture`)."""


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


class PolicySide:
    """One policy worker in one session.

    Args:
        options: the plugin's settings.
        key: HMAC key.
        rank: this worker's rank (refit-group rank).
        topo: the session.
        held: CPU tensors of an earlier session of this worker (reused when the owners agree).
        worker: the NeMo-RL policy worker hosting the engine (:func:`.shards.policy_shards` reads
            its model; None: the export).

    Attributes:
        capture: :data:`SHARDS` or :data:`EXPORT` once the session's first sync chose (None before).
        capture_detail: what was found, or why the export is used.
        held: the owned canonical copies (export path only; allocated at the first drain).
    """

    def __init__(self, options: PluginOptions, key: bytes, rank: int, topo: Topology,
                 held: Mapping[str, torch.Tensor] | None = None, worker: Any = None):
        self.options, self.key, self.rank, self.topo = options, key, rank, topo
        owners = assign_owners({n: _numel(s) for n, (_, s) in topo.table.items()}, topo.train_world)
        self.owned = sorted(n for n, r in owners.items() if r == rank)
        self._earlier = dict(held or {})
        self.held: dict[str, torch.Tensor] = {}
        self.worker = worker
        self.capture: str | None = None
        self.capture_detail = ""
        self.shards: TrainerSource | None = None
        self.transport = SyncTransport(topo.folder, rank, key, topo.session, abort_on_end=True,
                                       share_bodies=True)
        self.group = TransportGroup(self.transport, range(topo.train_world), options.dcr.reply_timeout_s)
        self.refit: DeltaRefit | None = None
        self._drained = False
        self.syncs = 0
        self.last: RefitReport | None = None
        self.recovered: list[str] = []
        if rank == 0:
            remove_other_sessions(options.dcr.url, topo.session)
            log_unloaded(topo.session, topo.unloaded)

    @property
    def parties(self) -> list[int]:
        """Every other refit-group rank (policy and rollout)."""
        return [r for r in range(self.topo.train_world + self.topo.rollout_world) if r != self.rank]

    def _empty(self, name: str) -> torch.Tensor:
        dtype, shape = self.topo.table[name]
        return torch.empty(shape, dtype=DTYPES[dtype].torch_dtype)

    def _fits(self, name: str, t: torch.Tensor) -> bool:
        dtype, shape = self.topo.table[name]
        return t.dtype == DTYPES[dtype].torch_dtype and tuple(t.shape) == shape

    def _held_tensors(self) -> dict[str, torch.Tensor]:
        """The owned copies (allocated once; an earlier session's are reused where they fit)."""
        if not self.held:
            earlier = self._earlier
            self.held = {n: earlier[n] if n in earlier and self._fits(n, earlier[n]) else self._empty(n)
                         for n in self.owned}
            self._earlier = {}
        return self.held

    def choose_capture(self) -> str:
        """Shards on every worker, or the export on every worker (collective over the policy
        workers; the choice is said once in the log)."""
        found = policy_shards(self.worker, self.topo.table)
        if self.group.all_true(found.source is not None):
            self.shards, self.capture, self.capture_detail = found.source, SHARDS, found.detail
            self._earlier = {}
            log_once(("capture", self.topo.session), "capture from the policy's own Megatron shards, NeMo-RL's "
                                                     f"export is not run ({found.detail})", self.rank == 0)
            return self.capture
        self.capture = EXPORT
        self.capture_detail = found.detail if found.source is None else \
            "another policy worker cannot capture from its shards"
        log_once(("capture", EXPORT, self.capture_detail),
                 f"policy rank {self.rank}: capture from NeMo-RL's export, copying owned tensors "
                 f"({self.capture_detail})", found.source is None or self.rank == 0)
        return self.capture

    def drain(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Iterate the whole export, copying the owned tensors into :attr:`held`; returns tensors seen.

        Raises:
            ValueError: after the export ended, naming tensors missing from, unknown to or
                disagreeing with the canonical table.
        """
        held = self._held_tensors()
        self._drained = False
        seen, problems = set(), []
        for name, t in weights:
            if name in self.topo.unloaded:  # vLLM's load_weights skips it: so does the refit
                continue
            spec = self.topo.table.get(name)
            if spec is None or name in seen or tuple(t.shape) != spec[1] or t.dtype != DTYPES[spec[0]].torch_dtype:
                why = "twice" if name in seen else "unknown" if spec is None else f"{t.dtype}{list(t.shape)} vs {spec}"
                problems.append(f"{name} ({why})")
                continue
            seen.add(name)
            if name in held:
                held[name].copy_(t.detach())
        missing = sorted(set(self.topo.table) - seen)
        problems += [f"{n} (not exported)" for n in missing[:5]]
        if problems:
            raise ValueError(f"policy rank {self.rank}: the export disagrees with the vLLM workers' canonical table "
                             f"({len(problems)} problems): {problems[:8]}")
        self._drained = True
        return len(seen)

    # -- one sync ------------------------------------------------------------------------------

    def _refit_once(self) -> RefitReport:
        if self.refit is None:
            cfg = self.options.session_config(self.topo.folder)
            source = self.shards if self.capture == SHARDS else CanonicalSource(self._held_tensors(),
                                                                                 canonical=self.topo.table)
            wiring = engine_wiring(self.transport, range(self.topo.train_world),
                                   range(self.topo.train_world, self.topo.train_world + self.topo.rollout_world),
                                   self.group)
            self.refit = DeltaRefit(cfg, source, wiring, key=self.key, model="nemo_rl")
            mine = sorted(n for n, r in self.refit.sender.owners.items() if r == self.rank)
            if self.capture == EXPORT and mine != self.owned:
                raise RuntimeError(f"policy rank {self.rank}: DeltaRefit's owners differ from the session's")
            return self.refit.attach()
        return self.refit.step()

    def _attempt(self, weights: Iterable[tuple[str, torch.Tensor]] | None, clock: PhaseClock) -> RefitReport:
        if self.capture is None:
            self.choose_capture()
        if weights is not None and self.capture == EXPORT:
            with clock(Phase.EXPORT):
                self.drain(weights)
        report = self._refit_once()
        if not report.committed:
            raise RuntimeError(f"refit v{report.version} did not commit: {'; '.join(report.detected)[:600]}")
        return replace(report, times={**clock.seconds, **report.times})

    def send(self, weights: Iterable[tuple[str, torch.Tensor]]) -> RefitReport:
        """One sync (see the module docstring): NeMo-RL's export ``weights`` is drained once on the
        export path and left unstarted on the shard path.

        Raises:
            RuntimeError: the sync and its resync both failed (names the rank and cause of each);
                the next sync re-attaches (checksums decide what to send).
        """
        self.syncs += 1
        t0 = time.perf_counter()
        if self.rank == 0:
            remove_stale(self.topo.folder, self.syncs)
        failures: list[SyncOutcome] = []
        for attempt in range(ATTEMPTS):
            self.transport.begin(self.syncs, attempt)
            self.group.restart(self.syncs * ATTEMPTS + attempt)
            clock = PhaseClock()
            try:
                report = self._attempt(weights if attempt == 0 else None, clock)
                break
            except SyncAborted as exc:
                outcome = exc.outcome
            except Exception as exc:  # noqa: BLE001 - any failure ends the attempt for every party
                retry = attempt + 1 < ATTEMPTS and (self.capture == SHARDS or self._drained)
                outcome = SyncOutcome(self.syncs, attempt, False, not retry, self.rank,
                                      f"{type(exc).__name__}: {str(exc)[:800]}")
                self.transport.end(self.parties, outcome)
            finally:
                self.transport.release()  # the payload's shared bodies: staged names go, links stay
            self.refit = None  # the resync (or the next sync) starts from the engines' checksums
            failures.append(outcome)
            if outcome.final or attempt + 1 == ATTEMPTS:
                raise RuntimeError(self._failed(failures)) from None
        self.recovered = [f.describe(self.topo.train_world) for f in failures]
        if self.rank == 0:
            done = SyncOutcome(self.syncs, attempt, True, True, self.rank)
            self.transport.end(range(self.topo.train_world, self.topo.train_world + self.topo.rollout_world),
                               done, report.version)
        self.last = report
        if self.rank == 0:
            log_sync(self, report, time.perf_counter() - t0)
        return report

    def _failed(self, failures: list[SyncOutcome]) -> str:
        what = [f"attempt {f.attempt + 1} ended by {f.describe(self.topo.train_world)}" for f in failures]
        tail = "its resync failed too" if len(failures) > 1 else \
            "no resync was possible (the export is read once)" if self.capture == EXPORT else "no resync was possible"
        return (f"nemo-dcr sync {self.syncs} failed on policy rank {self.rank}'s side: {'; '.join(what)}; {tail}; "
                "the next sync re-attaches (checksums decide what to send)")
