"""The post-optimizer-step hook: one object that refits the engine after every step.

Algorithm-agnostic: GRPO, PPO, distillation or any loop calls :meth:`DeltaRefit.step` right
after ``optimizer.step()`` (or lets :meth:`DeltaRefit.attach` do it)::

    refit = DeltaRefit.from_config(cfg.dcr, model=chunks, optimizer=opt, engine=engine,
                                   preset=preset)
    refit.initial_sync()                 # dense refit: the engine starts at version 0
    for batch in data:
        loss.backward(); opt.step()
        report = refit.step()            # capture -> remap -> transfer -> encode -> apply -> verify

Every trainer rank calls :meth:`step` (it is collective); the engine lives on one rank.
Per step: each rank captures only its own slice of its own shard against the baseline of
what the engine holds, remaps the changed elements to canonical (HF) names, and the parts
travel to the engine rank, which encodes them against its canonical mirror of the engine's
bits and applies the payload transactionally (:class:`nemo_dcr.apply.TensorEngine`: base and
target checksums are checked; a failure rolls back exactly).  The engine rank broadcasts the
verdict; the baseline commits only on success.  A refused or failed refit, a mismatch in the
full checksum scan, or ``full_resync_interval`` triggers a full resync (a dense refit).
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist

from nemo_dcr.capture import BaselineStore, capture
from nemo_dcr.codec import Identity, encode_deltas
from nemo_dcr.codec.stats import layer_type
from nemo_dcr.config.schema import DcrConfig
from nemo_dcr.types import SparseDelta, int_view, spec_of


class TrainerShard(Protocol):
    """What the hook needs from a trainer rank (built by an adapter, e.g. Megatron)."""

    params: dict[str, torch.Tensor]
    """Local name -> live (bf16) param of this rank."""
    ranges: dict[str, tuple[int, int]]
    """Local name -> flat (start, stop) slice this rank captures."""

    def remap(self, delta: SparseDelta) -> list[SparseDelta]:
        """A local delta as canonical pieces (name, canonical positions, new and old bits)."""

    def dense_export(self) -> dict[str, torch.Tensor] | None:
        """Collective: every canonical tensor, whole, on the engine rank (None elsewhere)."""


@dataclass
class RefitReport:
    """What one refit did (identical fields on every rank; engine-side values on its rank)."""

    version: int
    mode: str
    """``delta``, ``resync`` (full, forced or after a failure) or ``dense`` (dense refit)."""
    changed: int = 0
    numel: int = 0
    payload_bytes: int = 0
    dense_bytes: int = 0
    bytes_by_encoding: dict[str, int] = field(default_factory=dict)
    by_layer_type: dict[str, dict[str, int]] = field(default_factory=dict)
    """layer type -> {"changed", "numel"}."""
    times: dict[str, float] = field(default_factory=dict)
    """Phase -> seconds (capture, remap, transfer, encode, apply, verify, commit; ``total`` is
    their sum; ``telemetry``, measuring other encodings' sizes, is outside it)."""
    verified: bool | None = None
    """Checksums agreed (None: not checked this refit)."""
    error: str | None = None

    @property
    def density(self) -> float:
        """Changed elements over all elements."""
        return self.changed / max(self.numel, 1)


@contextmanager
def _timed(times: dict[str, float], phase: str):
    t0 = time.perf_counter()
    try:
        yield
    finally:
        times[phase] = times.get(phase, 0.0) + time.perf_counter() - t0


def merge_pieces(parts: list[list[SparseDelta]]) -> list[SparseDelta]:
    """Canonical pieces from all ranks -> one sorted delta per canonical tensor."""
    by_name: dict[str, list[SparseDelta]] = defaultdict(list)
    for rank_parts in parts:
        for p in rank_parts:
            by_name[p.name].append(p)
    out = []
    for name, pieces in by_name.items():
        pos = np.concatenate([p.positions for p in pieces])
        order = np.argsort(pos, kind="stable")
        pos = pos[order]
        if pos.size > 1 and (np.diff(pos) <= 0).any():
            raise RuntimeError(f"{name}: two ranks captured the same element")
        new = np.concatenate([p.new_bits for p in pieces])[order]
        old = np.concatenate([p.old_bits for p in pieces])[order]
        out.append(SparseDelta(name, pieces[0].dtype, pieces[0].shape, pos, new, old))
    return out


class DeltaRefit:
    """Bit-exact delta refit of one engine from a sharded trainer; see the module docstring.

    Args:
        cfg: the ``dcr`` config block.
        shard: this rank's :class:`TrainerShard`.
        engine: the engine on ``engine_rank`` (an object with ``tensors``, ``version``,
            ``apply(parts)``, ``checksums(full)`` and ``engine.guard``, e.g.
            :class:`nemo_dcr.integrations.hf.engine.HFEngine`); None on other ranks.
        engine_rank: global rank hosting the engine.
        key: HMAC key of the payloads (read from ``cfg.key_file`` when None).
    """

    def __init__(self, cfg: DcrConfig, shard: TrainerShard, engine: Any = None,
                 engine_rank: int = 0, key: bytes | None = None):
        cfg.validate()
        self.cfg = cfg
        self.shard = shard
        self.engine = engine
        self.engine_rank = engine_rank
        self.key = key if key is not None or not cfg.key_file else _read_key(cfg.key_file)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.version = 0
        self.refits = 0
        self.store = BaselineStore(cfg.baseline, cfg.baseline_dir and f"{cfg.baseline_dir}/rank{self.rank}")
        self._mirror: dict[str, np.ndarray] = {}
        self._mirror_ck: dict[str, int] = {}

    @classmethod
    def from_config(cls, cfg: DcrConfig, model, optimizer=None, engine: Any = None, *,
                    preset=None, engine_rank: int = 0, key: bytes | None = None) -> "DeltaRefit":
        """Attach to a Megatron model (list of chunks) and optionally its optimizer.

        Args:
            cfg: the ``dcr`` block.
            model: this rank's Megatron model chunks (``build_gpt_model`` output).
            optimizer: when given, :meth:`attach` runs :meth:`step` after each ``step()``.
            engine: the engine on ``engine_rank``.
            preset: the :class:`~nemo_dcr.integrations.megatron.build.ModelPreset` of the model.
            engine_rank: global rank hosting the engine.
            key: HMAC key (default: ``cfg.key_file``).
        """
        from nemo_dcr.demo.trainer import MegatronShard

        refit = cls(cfg, MegatronShard(model, preset, engine_rank), engine, engine_rank, key)
        if optimizer is not None:
            refit.attach(optimizer)
        return refit

    def attach(self, optimizer) -> None:
        """Run :meth:`step` after every ``optimizer.step()`` (wraps the bound method)."""
        inner = optimizer.step

        def step(*args, **kwargs):
            out = inner(*args, **kwargs)
            self.last_report = self.step()
            return out

        optimizer.step = step

    @property
    def is_engine(self) -> bool:
        """This rank hosts the engine."""
        return self.rank == self.engine_rank

    def initial_sync(self) -> RefitReport:
        """Dense refit to version 0 and register the baseline (call once, before training)."""
        report = self.dense_refit(self.version)
        self._after_full_sync()
        return report

    def dense_refit(self, version: int, into_engine: bool = True) -> RefitReport:
        """Gather every shard, convert to canonical tensors and load them (the dense baseline).

        Args:
            version: version the engine holds afterwards.
            into_engine: False: time the same refit into scratch copies (engine untouched).
        """
        times: dict[str, float] = {}
        with _timed(times, "export"):
            dense = self.shard.dense_export()
        report = RefitReport(version, "dense", times=times)
        if self.is_engine:
            with _timed(times, "load"):
                self._load_dense(dense, version, into_engine)
            report.numel = sum(t.numel() for t in dense.values())
            report.dense_bytes = report.payload_bytes = sum(t.numel() * t.element_size()
                                                            for t in dense.values())
        times["total"] = sum(times.values())
        return report

    def _load_dense(self, dense: dict[str, torch.Tensor], version: int, into_engine: bool) -> None:
        if not into_engine:
            for name, t in dense.items():
                torch.empty_like(self.engine.tensors[name]).copy_(t)
            return
        with self.engine.engine.guard.write():
            for name, t in dense.items():
                self.engine.tensors[name].copy_(t)
            self.engine.engine.guard.version = version
        self._mirror = {n: int_view(t).numpy().view(spec_of(t.dtype).uint).copy()
                        for n, t in self.engine.tensors.items()}
        self._mirror_ck = self.engine.checksums(full=True)

    def _after_full_sync(self) -> None:
        for name, p in self.shard.params.items():
            self.store.register(name, p, self.version)

    def step(self) -> RefitReport:
        """Refit the engine to the trainer's current weights (collective; call after the step)."""
        self.version += 1
        self.refits += 1
        every = self.cfg.full_resync_interval
        if not self.cfg.enabled or (every and self.refits % every == 0):
            return self._resync("resync" if self.cfg.enabled else "dense")
        report = RefitReport(self.version, "delta")
        ok = self._delta(report)
        with _timed(report.times, "commit"):
            if ok:
                self.store.commit(self.version)
        report.times["total"] = sum(v for k, v in report.times.items() if k != "telemetry")
        if not ok:
            resync = self._resync("resync")
            resync.error = report.error
            return resync
        return report

    def _resync(self, mode: str) -> RefitReport:
        report = self.dense_refit(self.version)
        report.mode = mode
        self.store = BaselineStore(self.store.backend, self.store.directory)
        self._after_full_sync()
        return report

    def _delta(self, report: RefitReport) -> bool:
        t = report.times
        with _timed(t, "capture"):
            deltas = capture(self.shard.params, self.store, self.shard.ranges, version=self.version)
        with _timed(t, "remap"):
            pieces = [p for d in deltas for p in self.shard.remap(d)]
        with _timed(t, "transfer"):
            gathered = [None] * dist.get_world_size() if self.is_engine else None
            dist.gather_object(pieces, gathered, dst=self.engine_rank)
        verdict = [None]
        if self.is_engine:
            verdict[0] = self._engine_side(merge_pieces(gathered), report)
        dist.broadcast_object_list(verdict, src=self.engine_rank)
        report.error = verdict[0]
        return verdict[0] is None

    def _engine_side(self, merged: list[SparseDelta], report: RefitReport) -> str | None:
        """Encode, apply, verify, update the mirror; returns None or the failure message."""
        t = report.times
        ident = Identity("", "", self.version - 1, self.version)
        with _timed(t, "encode"):
            payload = encode_deltas(merged, self._mirror, ident, self.cfg.encoding, self.key,
                                    self._mirror_ck)
        with _timed(t, "telemetry"):  # sizes of the other encodings; not part of the refit
            self._account(merged, payload, report)
        try:
            with _timed(t, "apply"):
                result = self.engine.apply([payload])
        except Exception as exc:  # refused or rolled back: the engine still holds its old version
            return f"{type(exc).__name__}: {exc}"
        with _timed(t, "verify"):
            error = self._verify(result.checksums, report)
        for d in merged:
            self._mirror[d.name][d.positions] = d.new_bits
        self._mirror_ck.update(result.checksums)
        return error

    def _verify(self, expected: dict[str, int], report: RefitReport) -> str | None:
        every = self.cfg.full_verify_interval
        if not self.cfg.verify_interval or self.refits % self.cfg.verify_interval:
            return None
        report.verified = True  # the transaction checked base and target checksums already
        if every and self.refits % every == 0:
            actual = self.engine.checksums(full=True)
            bad = [n for n, c in expected.items() if actual.get(n) != c]
            report.verified = not bad
            if bad:
                return f"full checksum scan disagrees on {bad[:5]}"
        return None

    def _account(self, merged: list[SparseDelta], payload: bytes, report: RefitReport) -> None:
        report.payload_bytes = len(payload)
        report.bytes_by_encoding = {self.cfg.encoding: len(payload)}
        for enc in self.cfg.telemetry_encodings:
            if enc not in report.bytes_by_encoding:
                report.bytes_by_encoding[enc] = len(encode_deltas(
                    merged, self._mirror, Identity(), enc, None, self._mirror_ck))
        changed = {d.name: d.nnz for d in merged}
        kinds: dict[str, dict[str, int]] = defaultdict(lambda: {"changed": 0, "numel": 0})
        for name, bits in self._mirror.items():
            k = kinds[layer_type(name)]
            k["numel"] += bits.size
            k["changed"] += changed.get(name, 0)
        report.by_layer_type = dict(kinds)
        report.changed = sum(changed.values())
        report.numel = sum(b.size for b in self._mirror.values())
        report.dense_bytes = sum(b.nbytes for b in self._mirror.values())


def _read_key(path: str) -> bytes:
    with open(path, "rb") as f:
        key = f.read().strip()
    if len(key) < 16:
        raise ValueError(f"{path}: an HMAC key needs at least 16 bytes, found {len(key)}")
    return key

