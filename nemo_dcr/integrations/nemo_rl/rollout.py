"""Rollout side of the NeMo-RL plugin: a vLLM worker's live parameters as one refit engine rank.

NeMo-RL builds the checkpoint engine inside every vLLM worker process (every TP/PP rank of every
vLLM engine) and stores it as the worker's ``checkpoint_engine`` attribute; the engine gets no
reference to the worker.  It finds the worker through the garbage collector's referrers
(:func:`find_owner`), reads the canonical table NeMo-RL handed the worker before
(``state_dict_info`` = ``{hf_name: (shape, dtype)}`` from ``prepare_refit_info``) and probes where
each canonical element lives in ``model_runner.model`` with vLLM's own weight loaders
(:func:`probe_worker`; :mod:`nemo_dcr.apply.probe`).

:func:`build_engine` makes the worker's engine: a :class:`~nemo_dcr.apply.TensorEngine` over the
live params and this rank's placement, applying each version transactionally in place (undo
log, verified checksums); no copy of the model is kept.  After a resync it writes the constants
vLLM's loaders leave in a param (vocab padding rows), so a first sync into vLLM's dummy weights
ends bit-identical to loading the policy's tensors with ``load_weights``.  :class:`RolloutSide`
serves the refit protocol for one sync (:meth:`RolloutSide.receive`) until the policy's
end-of-sync message.
"""

from __future__ import annotations

import gc
import time
from typing import Any, Mapping

from nemo_dcr.apply import EngineRefusedError, TensorEngine
from nemo_dcr.apply.placement import PlacementError, assign_primary, check_coverage
from nemo_dcr.refit.server import EngineServer
from nemo_dcr.transport import MessageKind, TransportError
from nemo_dcr.transport.base import TransportTimeout
from nemo_dcr.types import spec_of

from .session import ATTEMPTS, SyncOutcome, SyncTransport, Topology


def find_owner(obj: Any, attr: str = "checkpoint_engine") -> Any | None:
    """The object whose attribute ``attr`` is ``obj`` (NeMo-RL's ``worker.checkpoint_engine``).

    On Python 3.11+ an instance keeps its attributes inline, so the referrer is the owner itself;
    otherwise it is the owner's ``__dict__``, whose own referrer is the owner.
    """
    for ref in gc.get_referrers(obj):
        d = ref if isinstance(ref, dict) else getattr(ref, "__dict__", None)
        if not isinstance(d, dict) or d.get(attr) is not obj:
            continue
        if d is not ref:
            return ref
        for owner in gc.get_referrers(ref):
            if getattr(owner, "__dict__", None) is ref:
                return owner
    return None


def canonical_table(state_dict_info: Mapping[str, Any]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """NeMo-RL's ``{name: (shape, dtype)}`` as ``{name: (wire dtype name, shape)}``."""
    return {n: (spec_of(dtype).name, tuple(int(s) for s in shape)) for n, (shape, dtype) in state_dict_info.items()}


def probe_worker(worker: Any) -> tuple[dict, dict[str, tuple[str, tuple[int, ...]]], dict]:
    """Placement of every canonical tensor on this vLLM worker, from vLLM's own loaders.

    Returns:
        ``(placement, table, fills)``: canonical name -> :class:`~nemo_dcr.apply.placement.TensorPlacement` (no primary
        yet), the canonical table, and the constants loaders write (``{param: [(pos, values)]}``).

    Raises:
        RuntimeError: the worker lacks what NeMo-RL gives it, or its model's ``load_weights`` wrote
            nothing at all (a model that does not follow vLLM's loader contract).
        EngineRefusedError: a param cannot be refit in place by this engine (named, with why):
            besides what the vLLM worker extension refuses, transformed, derived and prepacked
            tensors, whose after-write steps only the extension runs.
    """
    info = getattr(worker, "state_dict_info", None)
    if not info:
        raise RuntimeError("the vLLM worker has no state_dict_info: NeMo-RL's prepare_refit_info (called by "
                           "init_communicator before the checkpoint engine is prepared) did not reach it")
    from nemo_dcr.integrations.vllm.worker import probe_vllm  # imports vllm's platform (if installed)

    model = worker.model_runner.model
    table = canonical_table(info)
    shapes = {n: s for n, (_, s) in table.items()}
    dtypes = {n: spec_of(d).torch_dtype for n, (d, _) in table.items()}
    probe, derived, refused = probe_vllm(model, shapes, dtypes, getattr(worker, "vllm_config", None), device="cpu")
    if not probe.placement:
        raise RuntimeError(f"{type(model).__name__}.load_weights wrote nothing for any of {len(shapes)} "
                           "tensors: the model does not follow vLLM's weight-loader contract")
    refused.update({n: "transformed by its loader: reloads need the vLLM worker extension" for n in probe.reload})
    refused.update({g.module: "derives tensors after load: re-deriving needs the vLLM worker extension" for g in derived})
    refused.update({n: f"{t.kind.value}: needs the vLLM worker extension" for n, t in probe.params.items()
                    if t.kind.value == "rearranged"})
    if refused:
        raise EngineRefusedError(refused, "the NeMo-RL rollout worker")
    return probe.placement, table, probe.fills


def build_engine(worker: Any, probe: tuple, topo: Topology, rollout_rank: int, key: bytes,
                 keep_index: bool = True, threads: int | str = "auto") -> TensorEngine:
    """The in-place engine of rollout rank ``rollout_rank`` over the worker's live params: primaries
    assigned over every rollout rank's placement (from NeMo-RL's metadata, the same on every rank),
    coverage checked; ``keep_index`` keeps ``dcr`` class indexes of the views (host memory, ~2.3
    bytes per element); ``threads``: its worker threads (``dcr.threads``).

    Raises:
        PlacementError: some canonical element is held by no rollout rank.
    """
    placements = assign_primary(topo.placements())
    check_coverage(placements, {n: s for n, (_, s) in topo.table.items()})
    mine = placements[rollout_rank]
    own, _, fills = probe
    if set(mine) != set(own):
        raise PlacementError(f"rollout rank {rollout_rank}: NeMo-RL's metadata carries another rank's placement")
    params = {n: p.data for n, p in worker.model_runner.model.named_parameters()}
    return TensorEngine(params, 0, key, keep_index, placement=mine, fills=fills, threads=threads)


class RolloutSide:
    """One vLLM worker in one session: serves each sync, attempt by attempt, until the policy's
    end-of-sync message.

    Args:
        engine: this worker's engine (:func:`build_engine`; kept across sessions).
        topo: the session (from NeMo-RL's metadata).
        rollout_rank: this worker's rollout rank (refit-group rank ``T + rollout_rank``).
        key: HMAC key of the store transport.
        timeout_s: longest wait for the next message of a sync.
    """

    def __init__(self, engine: TensorEngine, topo: Topology, rollout_rank: int, key: bytes, timeout_s: float):
        self.engine, self.topo = engine, topo
        self.rank = topo.train_world + rollout_rank
        self.transport = SyncTransport(topo.folder, self.rank, key, topo.session)
        self.timeout_s = timeout_s
        self.syncs = 0
        self.last: dict = {}

    def receive(self) -> dict:
        """Serve one sync (its refits, recovery resyncs, queries; a second attempt after a failure
        anywhere) until its END; returns what happened.

        Raises:
            TimeoutError: no message for ``timeout_s`` (names the version held and the folder).
            RuntimeError: the sync failed for good (names the rank and cause of each attempt), or
                the policy reports a version this worker does not hold.
        """
        self.syncs += 1
        sync, start, bad, failures = self.syncs, self.engine.version, 0, []
        for attempt in range(ATTEMPTS):
            self.transport.begin(sync, attempt)
            server = EngineServer(self.engine, self.transport, list(range(self.topo.train_world)))
            outcome, version, bad = self._serve(sync, attempt, server, bad)
            if outcome.ok:
                return self._done(sync, outcome, version, server, start, bad, failures)
            failures.append(outcome.describe(self.topo.train_world))
            if outcome.final:
                break
        raise RuntimeError(f"nemo-dcr sync {sync} failed (rollout rank {self.rank - self.topo.train_world} holds "
                           f"v{self.engine.version}): {'; then '.join(failures)}")

    def _serve(self, sync: int, attempt: int, server: EngineServer, bad: int) -> tuple[SyncOutcome, int, int]:
        """Handle this attempt's messages until its END (or this worker's own failure, which it
        announces to every policy worker); returns the attempt's outcome, the version its END
        names and the count of envelopes that failed authentication."""
        while True:
            env = self._next(sync, server)
            if env is None:
                bad += 1
                continue
            if env.kind == MessageKind.END:
                return SyncOutcome.from_bytes(env.body), env.version, bad
            try:
                server.handle(env)
            except Exception as exc:  # noqa: BLE001 - ends the attempt for every party
                outcome = SyncOutcome(sync, attempt, False, attempt + 1 == ATTEMPTS, self.rank,
                                      f"{type(exc).__name__}: {str(exc)[:800]}")
                everyone = range(self.topo.train_world + self.topo.rollout_world)
                self.transport.end([r for r in everyone if r != self.rank], outcome)
                return outcome, -1, bad

    def _next(self, sync: int, server: EngineServer):
        try:
            return self.transport.recv(timeout=self.timeout_s)
        except TransportTimeout:
            raise TimeoutError(f"nemo-dcr rollout rank {self.rank - self.topo.train_world}: nothing from the policy "
                               f"workers for {self.timeout_s}s in sync {sync} (holding v{self.engine.version}; "
                               f"events {server.stats.events[-3:]}); folder {self.transport.folder}") from None
        except TransportError:  # a message that failed authentication: dropped like a lost one
            return None

    def _done(self, sync: int, outcome: SyncOutcome, version: int, server: EngineServer, start: int, bad: int,
              failures: list[str]) -> dict:
        if version != self.engine.version:
            raise RuntimeError(f"nemo-dcr sync {sync}: the policy reports v{version}, this rollout worker "
                               f"holds v{self.engine.version}")
        s = server.stats
        self.last = dict(sync=sync, attempt=outcome.attempt, version_before=start, version=self.engine.version,
                         committed=s.committed, resyncs=s.resyncs, refused=dict(s.refused), bad_envelopes=bad,
                         recovered=failures, at=time.time())
        return self.last
