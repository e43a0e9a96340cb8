"""The refit path in one process: DeltaRefit (capture -> remap -> route -> encode -> send) to a
hosted EngineServer thread over the in-process transport, with faults.

The trainer is the row-shard stand-in (tests/standins/shard_trainer.py) at world 1, so its bf16
params *are* the canonical tensors: the independent reference every engine tensor is compared
with (integer views), never the refit's own mirror or checksums.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from nemo_dcr.apply import InjectedFault, TensorEngine
from nemo_dcr.config.schema import DcrConfig
from nemo_dcr.refit import DeltaRefit, colocated_wiring
from nemo_dcr.refit.routing import merge
from nemo_dcr.telemetry.jsonl import step_record
from nemo_dcr.transport import Envelope
from nemo_dcr.types import SparseDelta, int_view
from tests.standins.shard_trainer import ShardTrainer

KEY = b"r" * 32
SHAPES = {"a.weight": (48, 32), "b.weight": (64, 16), "norm.weight": (32,)}


def _engine(trainer: ShardTrainer | None = None) -> TensorEngine:
    """An engine holding zeros, or the trainer's current weights."""
    tensors = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in SHAPES.items()}
    if trainer is not None:
        for n, p in trainer.params.items():
            tensors[n].copy_(p)
    return TensorEngine(tensors, key=KEY)


def _refit(trainer, engine, **cfg) -> DeltaRefit:
    c = DcrConfig(transport="inprocess", reply_timeout_s=120, **cfg)  # first calls compile kernels
    return DeltaRefit(c, trainer, colocated_wiring(c, 0, KEY), engine, key=KEY)


def _exact(trainer: ShardTrainer, engine: TensorEngine) -> bool:
    return all(torch.equal(int_view(engine.tensors[n]), int_view(p)) for n, p in trainer.params.items())


@pytest.fixture
def rig():
    trainer = ShardTrainer(SHAPES, 0, 1, lr=2e-4)
    engine = _engine()
    refit = _refit(trainer, engine, verify="incremental", verify_steps=3, telemetry_encodings=["reference"])  # sized too
    yield trainer, engine, refit
    refit.close(5)


def test_attach_resyncs_an_empty_engine_then_sparse_refits(rig):
    trainer, engine, refit = rig
    r = refit.attach()
    assert r.mode == "attach" and r.committed and r.resynced and _exact(trainer, engine)
    assert r.payload_bytes > 0 and r.changed == sum(int((int_view(p) != 0).sum()) for p in trainer.params.values())
    for step in range(1, 5):
        trainer.step()
        r = refit.step()
        assert r.mode == "delta" and r.committed and not r.resynced and r.verified, r.detected
        assert _exact(trainer, engine) and engine.version == r.version
        assert 0 < r.changed < sum(p.numel() for p in trainer.params.values())
        assert set(r.bytes_by_encoding) == {"dcr", "reference"} and r.bytes_by_encoding["dcr"] == r.payload_bytes
        assert r.verify.full == (step % 3 == 0)
        # the engine's own seconds of the version, from its ACK: within the trainer's wait for it
        assert set(r.engine_seconds) == {"parts", "apply", "checksums"}
        assert r.engine_seconds["apply"] + r.engine_seconds["checksums"] <= r.times["await"] + r.times["send"]
        assert step_record(step, r)["engine_seconds"] == {k: round(v, 6) for k, v in r.engine_seconds.items()}
    r = refit.step()  # nothing changed: an empty delta still moves the version
    assert r.changed == 0 and r.committed and engine.version == r.version


def test_wait_returns_once_the_work_behind_the_report_is_done(rig):
    trainer, engine, refit = rig
    refit.attach()
    trainer.step()
    assert refit.step().committed
    assert refit.wait() >= 0
    behind = ("nemo-dcr-mirror-index", "nemo-dcr-route-views")
    assert not [t.name for t in threading.enumerate() if t.name in behind and t.is_alive()]
    assert refit.wait() >= 0  # nothing left: returns at once
    trainer.step()
    assert refit.step().committed and _exact(trainer, engine)


def test_attach_to_an_engine_that_already_holds_the_weights_sends_nothing():
    trainer = ShardTrainer(SHAPES, 0, 1, lr=2e-4)
    engine = _engine(trainer)
    refit = _refit(trainer, engine)
    try:
        r = refit.attach()
        assert r.committed and not r.resynced and r.payload_bytes == 0 and r.verified
        trainer.step()
        assert refit.step().committed and _exact(trainer, engine)
    finally:
        refit.close(5)


def _drop(envs):
    return envs[1:]


def _corrupt_records(envs):  # a byte of the record area, not the MAC: the codec's own checks refuse it
    out = []
    for e in envs:
        body = bytearray(e.body)
        body[len(body) // 2] ^= 0x5A
        out.append(Envelope(e.kind, e.version, e.sender, e.part, e.last, bytes(body)))
    return out


@pytest.mark.parametrize("fault", ["drop", "corrupt", "crash", "skew"])
def test_faults_are_detected_and_recovered(rig, fault):
    trainer, engine, refit = rig
    refit.attach()
    trainer.step()
    kw = {}
    if fault == "drop":
        kw["tamper"] = _drop
    elif fault == "corrupt":
        kw["tamper"] = _corrupt_records
    elif fault == "skew":
        kw["base_skew"] = 1
    else:
        def crash(name):  # once, in the middle of the delta's transaction
            if name == "b.weight":
                engine.fault = None
                raise InjectedFault("crash after writing b.weight")
        engine.fault = crash
    before = engine.version
    r = refit.step(**kw)
    assert r.detected and r.resynced and r.committed, r
    assert engine.version > before and _exact(trainer, engine)
    trainer.step()
    r = refit.step()
    assert r.mode == "delta" and r.committed and not r.resynced and _exact(trainer, engine)


def test_a_silent_bit_flip_in_the_engine_is_found_by_the_full_scan_and_repaired():
    trainer = ShardTrainer(SHAPES, 0, 1, lr=2e-4)
    engine = _engine()
    refit = _refit(trainer, engine, verify="full")
    try:
        refit.attach()
        int_view(engine.tensors["a.weight"])[3] ^= 1  # memory flips a bit; no checksum saw it
        trainer.step()
        r = refit.step()
        assert r.resynced and any("a.weight" in d for d in r.detected) and _exact(trainer, engine)
    finally:
        refit.close(5)


def test_trainer_resume_attaches_by_checksums_and_resyncs_only_what_moved():
    trainer = ShardTrainer(SHAPES, 0, 1, lr=2e-4)
    engine = _engine()
    refit = _refit(trainer, engine)
    refit.attach()
    saved = trainer.state()
    for _ in range(2):
        trainer.step()
        refit.step()
    refit.close(5)
    trainer.load(saved)  # the trainer restarts from an older checkpoint, in a new refit object
    again = _refit(trainer, engine)
    try:
        r = again.attach()
        assert r.resynced and r.committed and _exact(trainer, engine)
        assert any("differ at (re)start" in d for d in r.detected)
        trainer.step()
        assert again.step().committed and _exact(trainer, engine)
    finally:
        again.close(5)


def test_forced_resync_interval_and_disabled_delta():
    trainer = ShardTrainer(SHAPES, 0, 1, lr=2e-4)
    for cfg, expect in (({"full_resync_interval": 2}, ["delta", "resync", "delta", "resync"]),
                        ({"enabled": False}, ["resync"] * 4)):
        engine = _engine()
        refit = _refit(trainer, engine, **cfg)
        try:
            refit.attach()
            modes = []
            for _ in range(4):
                trainer.step()
                r = refit.step()
                modes.append(r.mode)
                assert r.committed and _exact(trainer, engine)
            assert modes == expect
        finally:
            refit.close(5)


def test_attach_to_optimizer_runs_a_refit_after_each_step(rig):
    trainer, engine, refit = rig
    refit.attach()

    class Opt:
        def step(self):
            trainer.step()
            return "stepped"

    opt = Opt()
    refit.attach_to(opt)
    assert opt.step() == "stepped" and refit.last_report.committed and _exact(trainer, engine)


def test_merge_sorts_and_refuses_overlap():
    a = SparseDelta("t", "bf16", (10,), np.array([5, 7]), np.array([1, 2], np.uint16), np.array([0, 0], np.uint16))
    b = SparseDelta("t", "bf16", (10,), np.array([1]), np.array([3], np.uint16), np.array([0], np.uint16))
    m = merge([a, b])
    assert m[0].positions.tolist() == [1, 5, 7] and m[0].new_bits.tolist() == [3, 1, 2]
    with pytest.raises(ValueError, match="captured twice"):
        merge([a, a])


def test_merge_of_interleaved_pieces_equals_a_sort():
    """Pieces as TP ranks route them (column slices interleaved row by row, disjoint row ranges,
    empty pieces, pieces arriving in any order, one piece out of order, up to more pieces than one
    merge pass takes) against a plain sort."""
    rng = np.random.default_rng(3)
    for trial in range(120):
        n, k = 600, int(rng.integers(1, 24))
        owner = rng.integers(0, k, n) if trial % 3 else np.arange(n) * k // n  # interleaved / row ranges
        keep = rng.random(n) < 0.4
        with_old = bool(trial % 2)
        pieces = []
        for q in range(k):
            pos = np.flatnonzero((owner == q) & keep)
            if trial % 5 == 0 and q == 0:
                pos = pos[::-1].copy()
            pieces.append(SparseDelta("t", "bf16", (n,), pos, (pos * 7 % 65521).astype(np.uint16),
                                      (pos * 3).astype(np.uint16) if with_old else None))
        if trial % 4 == 1:  # pieces in any order (row ranges are then concatenated in range order)
            pieces = [pieces[i] for i in rng.permutation(k)]
        (m,) = merge(pieces)
        want = np.flatnonzero(keep)
        assert np.array_equal(m.positions, want) and np.array_equal(m.new_bits, (want * 7 % 65521).astype(np.uint16))
        assert (m.old_bits is None) != with_old
        assert not with_old or np.array_equal(m.old_bits, (want * 3).astype(np.uint16))
        if want.size:
            twice = SparseDelta("t", "bf16", (n,), want[-1:], np.zeros(1, np.uint16), None)
            with pytest.raises(ValueError, match=f"element {want[-1]} was captured twice"):
                merge(pieces + [twice])


def test_owners_balance_by_size_and_pack_roundtrips():
    from nemo_dcr.refit.routing import Coding, PackEntry, assign_owners, pack, unpack

    assert assign_owners({"x": 100, "y": 60, "z": 50}, 2) == {"x": 0, "y": 1, "z": 1}
    e = PackEntry(2, Coding.DCR, 3, 11, 12, b"body")
    back = unpack(pack([e], 1, 0, KEY), 1, 0, KEY, 3)[0]
    assert (back.tensor, back.coding, back.count, back.base, back.target, bytes(back.body)) == (2, Coding.DCR, 3,
                                                                                                  11, 12, b"body")


class _DigestsFail(TensorEngine):
    """An engine whose digests fail (a member raising): the query is answered with a refusal."""

    def digests(self):
        raise RuntimeError("digests unavailable")


def test_a_query_an_engine_fails_is_refused_not_crashed():
    from nemo_dcr.refit.messages import Ask

    trainer = ShardTrainer(SHAPES, 0, 1, lr=2e-4)
    engine = _DigestsFail({n: torch.zeros(s, dtype=torch.bfloat16) for n, s in SHAPES.items()}, key=KEY)
    refit = _refit(trainer, engine)
    try:
        assert refit.attach().resynced
        refused = refit.sender.query(Ask.DIGESTS)[0]
        assert not refused.ok and refused.reason == "RuntimeError: digests unavailable"
        assert refused.query.ask == Ask.DIGESTS
        state = refit.sender.query(Ask.FULL)[0]  # the server still answers
        assert state.ok and set(state.checksums) == set(SHAPES) and state.query.ask == Ask.FULL
    finally:
        refit.close(5)


def test_every_engine_answers_a_digest_query():
    from nemo_dcr.apply.contract import tensor_digests
    from nemo_dcr.refit.messages import Ask

    trainer = ShardTrainer(SHAPES, 0, 1, lr=2e-4)
    engine = _engine()
    refit = _refit(trainer, engine)
    try:
        refit.attach()
        got = refit.sender.query(Ask.DIGESTS)[0]
        assert got.ok and got.digests == tensor_digests(trainer.params) == engine.digests()
    finally:
        refit.close(5)

