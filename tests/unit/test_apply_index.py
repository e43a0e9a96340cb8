"""Kept ``dcr`` class indexes on both sides of a refit: built once, moved only by committed
versions, never stale after a rollback, rebuilt when the tensors changed behind them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nemo_dcr.apply import InjectedFault, TensorEngine, apply_version
from nemo_dcr.codec import DcrIndexes, Identity, diff_tensors, encode, encode_deltas
from nemo_dcr.codec.dcr import DcrIndex
from nemo_dcr.types import bits_view, spec_of
from nemo_dcr.verify.checksum import tensor_checksum

KEY = b"k" * 32


def _model(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layer{i}.weight": (torch.randn(96, 64, generator=g) * 10.0 ** -i).to(torch.bfloat16) for i in range(4)}


def _step(tensors, seed):
    """An Adam-like step: about 3% of the elements move by an ULP or two, some cross a binade."""
    g = torch.Generator().manual_seed(seed)
    return {n: (t.float() + torch.randn(t.shape, generator=g) * t.float().abs() * 0.02).to(torch.bfloat16)
            for n, t in tensors.items()}


class Sender:
    """What a trainer rank keeps: the engine's bits, their checksums and the kept indexes."""

    def __init__(self, tensors):
        self.bits = {n: bits_view(t.clone()) for n, t in tensors.items()}
        self.checksums = {n: tensor_checksum(b) for n, b in self.bits.items()}
        self.indexes = DcrIndexes()

    def payload(self, target, version):
        deltas = diff_tensors({n: _tensor(b, target[n]) for n, b in self.bits.items()}, target)
        data = encode_deltas(deltas, self.bits, Identity(base_version=version, target_version=version + 1), "dcr",
                             KEY, self.checksums, self.indexes)
        return data, deltas

    def commit(self, deltas):
        for d in deltas:
            self.bits[d.name][d.positions] = d.new_bits
            self.checksums[d.name] = tensor_checksum(self.bits[d.name])
        self.indexes.update(deltas)


def _tensor(bits, like):
    return torch.from_numpy(bits.view(np.int16)).view(like.dtype).reshape(like.shape)


def _fresh(indexes: DcrIndexes, tensors):
    """Every kept index equals one built now from ``tensors``."""
    for n, t in tensors.items():
        bits = bits_view(t)
        kept = indexes.get(n, bits, spec_of(t.dtype), tensor_checksum(bits))
        assert all(np.array_equal(a, b) for a, b in zip(kept.tables(), DcrIndex.build(bits, spec_of(t.dtype)).tables()))


def test_indexes_follow_committed_versions_without_rebuilds():
    model = _model()
    engine, sender = TensorEngine({n: t.clone() for n, t in model.items()}, key=KEY), Sender(model)
    cur = model
    for v in range(5):
        cur = _step(cur, seed=v + 1)
        data, deltas = sender.payload(cur, v)
        apply_version(engine, {0: [data]})
        sender.commit(deltas)
    assert engine.version == 5 and engine.indexes.builds == sender.indexes.builds == len(model)
    assert engine.indexes.moves > 0 and engine.indexes.moves == sender.indexes.moves  # classes did move
    _fresh(engine.indexes, engine.tensors)
    _fresh(sender.indexes, {n: _tensor(b, model[n]) for n, b in sender.bits.items()})
    assert engine.indexes.builds == sender.indexes.builds == len(model)  # the checks found every index current


def test_rolled_back_apply_leaves_indexes_current():
    model = _model()
    engine, sender = TensorEngine({n: t.clone() for n, t in model.items()}, key=KEY), Sender(model)
    target = _step(model, seed=1)
    data, deltas = sender.payload(target, 0)
    calls = []

    def fault(name):
        calls.append(name)
        if len(calls) == 2:
            raise InjectedFault(name)

    engine.fault = fault
    with pytest.raises(InjectedFault):
        apply_version(engine, {0: [data]})  # decoded with the indexes (built), two tensors written, rolled back
    assert engine.version == 0 and len(engine.indexes) == len(model)
    _fresh(engine.indexes, engine.tensors)
    engine.fault = None
    apply_version(engine, {0: [data]})  # the same version again, decoded with the same indexes
    sender.commit(deltas)
    assert engine.version == 1 and engine.indexes.builds == len(model)
    _fresh(engine.indexes, engine.tensors)


def test_tensors_written_behind_the_index_and_resync():
    model = _model()
    engine = TensorEngine({n: t.clone() for n, t in model.items()}, key=KEY)
    step1 = _step(model, seed=1)
    apply_version(engine, {0: [encode(model, step1, Identity(base_version=0, target_version=1), key=KEY)]})
    name = next(iter(model))
    engine.tensors[name].view(torch.int16)[0] ^= 1 << 9  # a write outside any transaction
    engine.checksums(full=True)  # the engine learns what memory holds; the kept index is now stale
    now = {n: t.clone() for n, t in engine.tensors.items()}
    step2 = _step(now, seed=2)
    builds = engine.indexes.builds
    apply_version(engine, {0: [encode(now, step2, Identity(base_version=1, target_version=2), key=KEY)]})
    assert engine.indexes.builds == builds + 1  # only the stale one was rebuilt
    _fresh(engine.indexes, engine.tensors)
    held = len(engine.indexes)
    engine.dense_refit(lambda ts: None, 3)  # the same bits again: every index stays
    assert len(engine.indexes) == held
    engine.dense_refit(lambda ts: [t.copy_(step1[n]) for n, t in ts.items()], 4)
    assert len(engine.indexes) == 0
