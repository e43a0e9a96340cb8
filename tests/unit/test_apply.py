"""Transactional apply: commit, refusal before any write, exact rollback, versions, resync."""

from __future__ import annotations

import threading

import pytest
import torch

from nemo_dcr.apply import (
    ApplyVerificationError,
    IncompletePartsError,
    InjectedFault,
    TensorEngine,
    VersionMismatchError,
    apply_version,
)
from nemo_dcr.apply.transaction import UndoLog
from nemo_dcr.codec import Identity, encode
from nemo_dcr.codec.errors import AuthenticationError, BaseChecksumMismatchError, DeltaFormatError

KEY = b"k" * 32


def _model(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layer{i}.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16) for i in range(4)}


def _step(tensors, frac=0.02, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for n, t in tensors.items():
        mask = torch.rand(t.shape, generator=g) < frac
        out[n] = torch.where(mask, (t.float() * 1.01).to(torch.bfloat16), t)
    return out


def _clone(d):
    return {k: v.clone() for k, v in d.items()}


def _bits_equal(a, b):
    return all(torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)) for k in a)


@pytest.mark.parametrize("encoding", ["dcr", "reference", "raw"])
def test_apply_commits_and_reports_touched(encoding):
    base = _model()
    target = _step(base)
    engine = TensorEngine(_clone(base), version=3, key=KEY)
    payload = encode(base, target, Identity(base_version=3, target_version=4), encoding, KEY)
    result = apply_version(engine, {0: [payload]})
    assert engine.version == 4 and _bits_equal(engine.tensors, target)
    assert sum(result.touched.values()) == sum(int((base[k] != target[k]).sum()) for k in base)
    assert engine.checksums() == engine.checksums(full=True)
    assert 0 < result.undo_bytes < sum(t.numel() * 2 for t in base.values())


def test_parts_of_one_version_apply_together():
    base, target = _model(), _step(_model())
    names = sorted(base)
    parts = [encode({n: base[n] for n in half}, {n: target[n] for n in half}, Identity(base_version=0),
                    key=KEY) for half in (names[:2], names[2:])]
    engine = TensorEngine(_clone(base), key=KEY)
    apply_version(engine, {0: parts})
    assert _bits_equal(engine.tensors, target)
    with pytest.raises(IncompletePartsError):
        apply_version(TensorEngine(_clone(base), key=KEY), {0: [parts[0], parts[0]]})


def test_exception_between_tensors_rolls_back_bit_exact():
    base = _model()
    engine = TensorEngine(_clone(base), key=KEY)
    payload = encode(base, _step(base), Identity(base_version=0), key=KEY)
    seen = []

    def fault(name):
        seen.append(name)
        if len(seen) == 3:
            raise InjectedFault(f"crash after {name}")

    engine.fault = fault
    with pytest.raises(InjectedFault):
        apply_version(engine, {0: [payload]})
    assert engine.version == 0 and _bits_equal(engine.tensors, base) and len(seen) == 3
    assert engine.checksums() == engine.checksums(full=True)


def test_wrong_base_and_version_gap_refused_without_writes():
    base = _model()
    engine = TensorEngine(_clone(base), version=5, key=KEY)
    other = _step(base, seed=7)
    with pytest.raises(BaseChecksumMismatchError):
        apply_version(engine, {0: [encode(other, _step(other), Identity(base_version=5, target_version=6), key=KEY)]})
    with pytest.raises(VersionMismatchError) as gap:
        apply_version(engine, {0: [encode(base, _step(base), Identity(base_version=6, target_version=7), key=KEY)]})
    assert gap.value.is_gap
    with pytest.raises(VersionMismatchError) as stale:
        apply_version(engine, {0: [encode(base, _step(base), Identity(base_version=4, target_version=5), key=KEY)]})
    assert not stale.value.is_gap
    with pytest.raises(AuthenticationError):
        wrong_key = encode(base, _step(base), Identity(base_version=5, target_version=6), key=b"x" * 32)
        apply_version(engine, {0: [wrong_key]})
    assert engine.version == 5 and _bits_equal(engine.tensors, base)


def test_corrupt_byte_refused():
    base = _model()
    engine = TensorEngine(_clone(base), key=KEY)
    payload = bytearray(encode(base, _step(base), Identity(), key=KEY))
    payload[len(payload) // 2] ^= 0x40
    with pytest.raises(DeltaFormatError):
        apply_version(engine, {0: [bytes(payload)]})
    assert _bits_equal(engine.tensors, base)


def test_verification_failure_rolls_back():
    base = _model()
    engine = TensorEngine(_clone(base), key=KEY)
    engine.sums.views["layer2.weight"] ^= 1  # the engine's incremental value drifted
    payload = encode(base, _step(base), Identity(), key=KEY)
    with pytest.raises(DeltaFormatError):  # base checksum no longer matches: refused up front
        apply_version(engine, {0: [payload]})
    engine.checksums(full=True)
    target = _step(base)
    written = int(torch.nonzero((base["layer2.weight"] != target["layer2.weight"]).reshape(-1))[0])

    def corrupt(name):  # a written element changes behind the transaction's back (another writer, a device fault)
        if name == "layer2.weight":
            engine.tensors[name].view(torch.int16).reshape(-1)[written] ^= 1

    engine.fault = corrupt
    with pytest.raises(ApplyVerificationError, match=f"layer2.weight: element {written} reads back"):
        apply_version(engine, {0: [payload]})
    assert _bits_equal(engine.tensors, base) and engine.version == 0


def test_resync_from_zero_base_and_rollback():
    from nemo_dcr.refit.payloads import resync_payload

    base, other = _model(), _model(seed=9)
    engine = TensorEngine(_clone(base), version=4, key=KEY)
    parts = [resync_payload(other, target_version=9, key=KEY)]
    engine.fault = lambda name: (_ for _ in ()).throw(InjectedFault(name)) if name == "layer3.weight" else None
    with pytest.raises(InjectedFault):
        apply_version(engine, {0: parts}, resync=True)
    assert _bits_equal(engine.tensors, base) and engine.version == 4
    engine.fault = None
    result = apply_version(engine, {0: parts}, resync=True)
    assert result.resync and engine.version == 9 and _bits_equal(engine.tensors, other)
    with pytest.raises(VersionMismatchError):  # replayed old resync
        apply_version(engine, {0: parts}, resync=True)


def test_undo_log_restores_partial_scatter():
    t = torch.arange(10, dtype=torch.int16)
    undo = UndoLog()
    undo.scatter(t, torch.tensor([1, 3]), torch.tensor([100, 300], dtype=torch.int16))
    undo.overwrite(t, torch.zeros(10, dtype=torch.int16))
    undo.rollback()
    assert torch.equal(t, torch.arange(10, dtype=torch.int16))


def test_generation_never_sees_mixed_version():
    base = _model()
    engine = TensorEngine(_clone(base), key=KEY)
    versions, stop = [], threading.Event()

    def reader():
        while not stop.is_set():
            with engine.serving() as v:
                snap = {k: t.clone() for k, t in engine.tensors.items()}
                versions.append((v, snap))

    th = threading.Thread(target=reader)
    th.start()
    states = [base]
    for v in range(1, 6):
        states.append(_step(states[-1], seed=v))
        payload = encode(states[-2], states[-1], Identity(base_version=v - 1, target_version=v), key=KEY)
        apply_version(engine, {0: [payload]})
    stop.set()
    th.join()
    assert engine.guard.mixed_version_served == 0
    assert all(_bits_equal(snap, states[v]) for v, snap in versions)
