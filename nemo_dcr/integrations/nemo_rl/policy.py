"""Policy side of the NeMo-RL plugin: one policy worker of the refit's trainer group.

Every policy worker drains NeMo-RL's export (Megatron Bridge yields the full HF tensors on every
rank, by collectives, so every rank must iterate it to the end) and keeps a CPU copy of only the
canonical tensors it *owns* (:func:`nemo_dcr.refit.routing.assign_owners`, the owners the refit
itself uses, so routing moves nothing between ranks).  Those copies are a
:class:`~nemo_dcr.refit.canonical.CanonicalSource` for a :class:`~nemo_dcr.refit.DeltaRefit`
whose trainer group runs over the store transport (:class:`~nemo_dcr.refit.group.TransportGroup`):
each ``send_weights`` is one ``attach()`` (first sync of a session: the engines' checksums decide
what to send; vLLM starts from dummy weights, so everything) or one ``step()``, then policy rank 0
tells every rollout worker that the sync is over (an ``END`` message with the outcome).
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from typing import Iterable, Mapping

import torch

from nemo_dcr.refit import DeltaRefit, RefitReport, engine_wiring
from nemo_dcr.refit.canonical import CanonicalSource
from nemo_dcr.refit.group import TransportGroup
from nemo_dcr.refit.routing import assign_owners
from nemo_dcr.telemetry import Phase, PhaseClock, TelemetryWriter, step_record
from nemo_dcr.transport import Envelope, MessageKind
from nemo_dcr.types import DTYPES

from .options import PluginOptions
from .session import SyncTransport, Topology, remove_other_sessions, remove_stale


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
    """

    def __init__(self, options: PluginOptions, key: bytes, rank: int, topo: Topology,
                 held: Mapping[str, torch.Tensor] | None = None):
        self.options, self.key, self.rank, self.topo = options, key, rank, topo
        owners = assign_owners({n: _numel(s) for n, (_, s) in topo.table.items()}, topo.train_world)
        self.owned = sorted(n for n, r in owners.items() if r == rank)
        held = dict(held or {})
        self.held = {n: held[n] if n in held and self._fits(n, held[n]) else self._empty(n) for n in self.owned}
        self.transport = SyncTransport(topo.folder, rank, key, topo.session)
        self.group = TransportGroup(self.transport, range(topo.train_world), options.dcr.reply_timeout_s)
        self.refit: DeltaRefit | None = None
        self.syncs = 0
        self.last: RefitReport | None = None
        if rank == 0:
            remove_other_sessions(options.dcr.url, topo.session)

    def _empty(self, name: str) -> torch.Tensor:
        dtype, shape = self.topo.table[name]
        return torch.empty(shape, dtype=DTYPES[dtype].torch_dtype)

    def _fits(self, name: str, t: torch.Tensor) -> bool:
        dtype, shape = self.topo.table[name]
        return t.dtype == DTYPES[dtype].torch_dtype and tuple(t.shape) == shape

    def drain(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Iterate the whole export, copying the owned tensors into :attr:`held`; returns tensors seen.

        Raises:
            ValueError: after the export ended, naming tensors missing from, unknown to or
                disagreeing with the canonical table (FP8 KV-cache scales are not carried).
        """
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
            if name in self.held:
                self.held[name].copy_(t.detach())
        missing = sorted(set(self.topo.table) - seen)
        problems += [f"{n} (not exported)" for n in missing[:5]]
        if problems:
            raise ValueError(f"policy rank {self.rank}: the export disagrees with the vLLM workers' canonical table "
                             f"({len(problems)} problems): {problems[:8]}")
        return len(seen)

    def _refit_once(self) -> RefitReport:
        if self.refit is None:
            cfg = self.options.session_config(self.topo.folder)
            source = CanonicalSource(self.held, canonical=self.topo.table)
            wiring = engine_wiring(self.transport, range(self.topo.train_world),
                                   range(self.topo.train_world, self.topo.train_world + self.topo.rollout_world),
                                   self.group)
            self.refit = DeltaRefit(cfg, source, wiring, key=self.key, model="nemo_rl")
            mine = sorted(n for n, r in self.refit.sender.owners.items() if r == self.rank)
            if mine != self.owned:
                raise RuntimeError(f"policy rank {self.rank}: DeltaRefit's owners differ from the drain's")
            return self.refit.attach()
        return self.refit.step()

    def send(self, weights: Iterable[tuple[str, torch.Tensor]]) -> RefitReport:
        """One sync (see the module docstring).

        Raises:
            RuntimeError: the rollout workers did not all end up holding these weights (after the
                refit path's own recovery); the next sync re-attaches (checksums decide what to send).
        """
        self.syncs += 1
        t0 = time.perf_counter()
        self.transport.begin(self.syncs)
        self.group.restart(self.syncs)
        if self.rank == 0:
            remove_stale(self.topo.folder, self.syncs)
        report, error, clock = None, None, PhaseClock()
        try:
            with clock(Phase.EXPORT):
                self.drain(weights)
            report = self._refit_once()
            report = replace(report, times={**clock.seconds, **report.times})
            if not report.committed:
                raise RuntimeError(f"refit v{report.version} did not commit: {'; '.join(report.detected)}")
        except BaseException as exc:
            error, self.refit = exc, None  # the next sync starts from the engines' checksums
            raise
        finally:
            if self.rank == 0:
                self._end(report, error)
        self.last = report
        if self.rank == 0:
            self._log(report, time.perf_counter() - t0)
        return report

    def _end(self, report: RefitReport | None, error: BaseException | None) -> None:
        """Tell every rollout worker that this sync is over (and how it went)."""
        ok = error is None and report is not None
        body = json.dumps({"sync": self.syncs, "ok": ok,
                           "reason": "" if ok else f"{type(error).__name__}: {str(error)[:800]}"}).encode()
        version = report.version if report is not None else -1
        for e in range(self.topo.train_world, self.topo.train_world + self.topo.rollout_world):
            try:
                self.transport.send(e, Envelope(MessageKind.END, version, self.rank, body=body))
            except Exception:  # noqa: BLE001 - the receivers then time out with their own message
                if error is None:
                    raise

    def _log(self, r: RefitReport, seconds: float) -> None:
        """One ``[nemo-dcr refit]`` line on stdout and one JSON line in ``<telemetry_dir>/telemetry.jsonl``."""
        ratio = r.dense_bytes / r.payload_bytes if r.payload_bytes else float("inf")
        print(f"[nemo-dcr refit] sync {self.syncs} {r.mode} -> v{r.version}: changed {r.changed}/{r.numel} "
              f"({100 * r.density:.3f}%), payload {r.payload_bytes / 2**20:.3f} MiB vs dense "
              f"{r.dense_bytes / 2**20:.1f} MiB (x{ratio:.1f}), verified={r.verified}, resynced={r.resynced}, "
              f"{seconds:.2f}s" + (f"; handled: {'; '.join(r.detected)[:300]}" if r.detected else ""), flush=True)
        if self.options.dcr.telemetry_dir:
            row = step_record(self.syncs, r, session=self.topo.session, sync_s=seconds, time=time.time())
            try:
                TelemetryWriter(self.options.dcr.telemetry_dir, fresh=False).write(row)
            except (OSError, ValueError, NotImplementedError) as exc:
                print(f"[nemo-dcr refit] telemetry not written under {self.options.dcr.telemetry_dir}: {exc}", flush=True)
