"""Two-phase apply (prepare, then commit or rollback), as an engine spread over several ranks uses
it: a prepared version is written and verified but the old version stays current, readers wait,
and a rollback restores every bit; the same for an engine over params plus a placement (fused,
sharded params)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from nemo_dcr.apply import TensorEngine, VersionMismatchError
from nemo_dcr.apply.errors import PendingVersionError
from nemo_dcr.apply.placement import Runs, TensorPlacement, assign_primary
from nemo_dcr.codec import Identity, encode
from nemo_dcr.codec.errors import BaseChecksumMismatchError
from nemo_dcr.refit.payloads import resync_payload
from nemo_dcr.types import bits_view
from nemo_dcr.verify.checksum import tensor_checksum

KEY = b"p" * 32


def _model(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(16, 8, generator=g).to(torch.bfloat16) for i in range(3)}


def _changed(tensors, every=5):
    out = {}
    for n, t in tensors.items():
        c = t.clone()
        c.view(torch.int16).reshape(-1)[::every] += 1
        out[n] = c
    return out


def _bits(d):
    return {k: v.view(torch.int16).clone() for k, v in d.items()}


def _same(a, b):
    return all(torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)) for k in b)


def test_prepare_then_rollback_restores_bits_and_version():
    base = _model()
    target = _changed(base)
    engine = TensorEngine({k: v.clone() for k, v in base.items()}, version=2, key=KEY)
    before = engine.checksums()
    result = engine.prepare({0: [encode(base, target, Identity(base_version=2, target_version=3), key=KEY)]})
    assert engine.pending is result and engine.version == 2
    assert _same(engine.tensors, target)  # written, not yet committed
    with pytest.raises(PendingVersionError):
        engine.prepare({0: [encode(base, target, Identity(base_version=2, target_version=3), key=KEY)]})
    with pytest.raises(PendingVersionError):
        engine.checksums(full=True)
    engine.rollback()
    assert engine.pending is None and engine.version == 2 and _same(engine.tensors, base)
    assert engine.checksums(full=True) == before
    with pytest.raises(PendingVersionError):
        engine.commit()


def test_prepare_then_commit_moves_version_and_checksums():
    base = _model()
    target = _changed(base)
    engine = TensorEngine({k: v.clone() for k, v in base.items()}, version=0, key=KEY)
    engine.prepare({0: [encode(base, target, Identity(base_version=0, target_version=1), key=KEY)]})
    result = engine.commit()
    assert engine.version == 1 and result.target_version == 1 and _same(engine.tensors, target)
    assert engine.checksums() == engine.checksums(full=True)
    with pytest.raises(BaseChecksumMismatchError):  # the old payload is stale now; nothing is left pending
        engine.prepare({0: [encode(base, target, Identity(base_version=0, target_version=1), key=KEY)]})
    assert engine.pending is None


def test_readers_wait_while_a_version_is_prepared():
    base = _model()
    engine = TensorEngine({k: v.clone() for k, v in base.items()}, key=KEY)
    engine.prepare({0: [encode(base, _changed(base), Identity(base_version=0, target_version=1), key=KEY)]})
    seen = []
    reader = threading.Thread(target=lambda: seen.append(engine.serving().__enter__()))
    reader.start()
    reader.join(0.3)
    assert reader.is_alive() and not seen  # blocked on the prepared version
    engine.commit()
    reader.join(5)
    assert seen == [1]


def _routed(base, ranks=2):
    """Each tensor [16, 8] split by rows over ``ranks`` into one param per rank (a TP row shard)."""
    rows = 16 // ranks
    placements, params = [], []
    for r in range(ranks):
        lo = r * rows * 8
        runs = Runs.from_pairs(np.arange(lo, lo + rows * 8), np.arange(rows * 8))
        placements.append({n: TensorPlacement(n, (16, 8), f"p.{n}", (rows, 8), runs) for n in base})
        params.append({f"p.{n}": t[r * rows:(r + 1) * rows].clone() for n, t in base.items()})
    placements = assign_primary(placements)
    return [TensorEngine(params[r], 0, KEY, placement=placements[r]) for r in range(ranks)], placements


def _view_payloads(placements, base, target, identity):
    out = []
    for pl in placements:
        views = {n: tp.runs.expand()[0] for n, tp in pl.items()}
        b = {n: base[n].reshape(-1)[torch.from_numpy(v)] for n, v in views.items()}
        t = {n: target[n].reshape(-1)[torch.from_numpy(v)] for n, v in views.items()}
        out.append(encode(b, t, identity, key=KEY))
    return out


def _summed(engines):
    sums = {}
    for e in engines:
        for n, c in e.checksums().canonical.items():
            sums[n] = (sums.get(n, 0) + c) % (1 << 64)
    return sums


def test_routed_engines_roll_back_together_when_one_rank_fails():
    base = _model()
    target = _changed(base)
    engines, placements = _routed(base)
    snap = [_bits(e.params) for e in engines]
    parts = _view_payloads(placements, base, target, Identity(base_version=0, target_version=1))
    engines[0].prepare({0: [parts[0]]})
    with pytest.raises(VersionMismatchError):  # rank 1 refuses (payload for the wrong base version)
        stale = _view_payloads(placements, base, target, Identity(base_version=5, target_version=6))
        engines[1].prepare({0: stale[1:]})
    engines[0].rollback()
    assert all(_same(e.params, s) for e, s in zip(engines, snap))
    assert _summed(engines) == {n: tensor_checksum(bits_view(t)) for n, t in base.items()}
    for e, p in zip(engines, parts):
        e.prepare({0: [p]})
    for e in engines:
        e.commit()
    assert all(e.version == 1 for e in engines)
    assert _summed(engines) == {n: tensor_checksum(bits_view(t)) for n, t in target.items()}
    assert _summed(engines) == _summed([e for e in engines if e.checksums(full=True)])


def test_routed_resync_prepared_and_committed():
    base, other = _model(), _model(seed=7)
    engines, placements = _routed(base)
    for e, pl in zip(engines, placements):
        views = {n: other[n].reshape(-1)[torch.from_numpy(tp.runs.expand()[0])] for n, tp in pl.items()}
        assert e.prepare({0: [resync_payload(views, target_version=4, key=KEY)]}, resync=True).resync
    for e in engines:
        e.commit()
    assert _summed(engines) == {n: tensor_checksum(bits_view(t)) for n, t in other.items()}
