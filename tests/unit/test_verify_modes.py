"""``dcr.verify``: each mode catches a missed capture and a stray engine write within its bound,
then brings the engine back to the trainer's live weights, bit for bit.

* ``full``: at the next refit;
* ``sampled`` (K = ``verify_steps``): at the refit whose slice holds the planted element, never
  later than K refits after it was planted (the slices are checked here against the numpy
  reference of the selection, and each refit's slice covers ~1/K of every tensor);
* ``incremental``: at the next refit that is a multiple of K (the deltas' checksums alone do not
  see either fault: both sides moved by the same captured changes).

A *missed capture* is a change of the trainer's live weights that capture does not see (planted
in the capture baseline too); a *stray write* changes an engine param behind the refit's back:
in a tensor held whole, and in a replica (a TP-replicated norm held on two engine ranks, whose
copy on the non-primary rank is in no canonical sum, only in that rank's views).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from nemo_dcr.apply import TensorEngine
from nemo_dcr.apply.placement import Runs, assign_primary
from nemo_dcr.apply.probe import probe_engine
from nemo_dcr.config.schema import DcrConfig
from nemo_dcr.integrations.vllm.worker import set_loader
from nemo_dcr.refit import DeltaRefit, EngineServer, colocated_wiring, engine_wiring
from nemo_dcr.refit.canonical import CanonicalSource
from nemo_dcr.refit.group import LocalGroup
from nemo_dcr.transport import Envelope, InProcHub, MessageKind
from nemo_dcr.types import int_view
from nemo_dcr.verify.checksum import MASK64, element_hash
from nemo_dcr.verify.sample import Sample, runs_checksum
from tests.standins.shard_trainer import ShardTrainer
from tests.standins.vllm_standin import StandinDims, StandinModel, canonical_shapes

KEY = b"v" * 32
SHAPES = {"a.weight": (48, 32), "b.weight": (64, 16), "norm.weight": (32,)}
K, BLOCK = 4, 16
MODES = {"full": 1, "sampled": K, "incremental": K}


def _cfg(mode: str) -> DcrConfig:
    return DcrConfig(transport="inprocess", reply_timeout_s=60, telemetry_encodings=[], verify=mode,
                     verify_steps=K, verify_block=BLOCK)


def _flip(t: torch.Tensor, at: int) -> None:
    int_view(t)[at] ^= 1 << 3


def _due(mode: str, planted: int, name: str, at: int) -> int:
    """The refit that must catch an element planted just before refit ``planted``."""
    if mode == "full":
        return planted
    if mode == "incremental":
        return planted + (-planted) % K
    want = int(Sample(0, K, BLOCK).slice_of(name, np.array([at]))[0])
    return next(t for t in range(planted, planted + K) if Sample(t, K, BLOCK).slice == want)


def _run_until_caught(refit: DeltaRefit, first: int, due: int) -> int:
    """Refit (no training in between) until a refit resyncs; returns its number."""
    for t in range(first, first + K + 2):
        r = refit.step()
        if t < due:
            assert r.committed and not r.detected, (t, r.detected)
            continue
        assert r.committed and r.resynced and any("checksum mismatch" in d for d in r.detected), (t, r)
        return t
    raise AssertionError("never caught")


@pytest.mark.parametrize("plant", ["missed capture", "stray write"])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_each_mode_catches_a_planted_fault_within_its_bound(mode, plant):
    trainer = ShardTrainer(SHAPES, 0, 1, lr=2e-4)
    engine = TensorEngine({n: torch.zeros(s, dtype=torch.bfloat16) for n, s in SHAPES.items()}, key=KEY)
    cfg = _cfg(mode)
    refit = DeltaRefit(cfg, trainer, colocated_wiring(cfg, 0, KEY), engine, key=KEY)
    try:
        assert refit.attach().committed
        for _ in range(2):  # two ordinary refits: nothing planted, nothing found
            trainer.step()
            r = refit.step()
            assert r.committed and not r.detected, r.detected
        name, at, planted = "a.weight", 777, refit.refits + 1
        if plant == "missed capture":
            _flip(trainer.params[name], at)
            _flip(refit.store.bits(name), at)  # capture compares with the baseline: it sees nothing
        else:
            _flip(engine.tensors[name], at)
        caught = _run_until_caught(refit, planted, _due(mode, planted, name, at))
        assert caught - planted < MODES[mode]
        assert all(torch.equal(int_view(engine.tensors[n]), int_view(p)) for n, p in trainer.params.items())
        trainer.step()  # and the refit goes on from the re-read weights
        r = refit.step()
        assert r.committed and not r.detected and r.mode == "delta", r
        assert all(torch.equal(int_view(engine.tensors[n]), int_view(p)) for n, p in trainer.params.items())
    finally:
        refit.close(5)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_stray_write_in_a_replica_is_caught_by_that_rank_alone(mode):
    """The norm is replicated on both TP ranks; rank 2's copy is in no canonical sum."""
    dims = StandinDims()
    shapes = canonical_shapes(dims)
    g = torch.Generator().manual_seed(0)
    weights = {n: torch.randn(s, generator=g).bfloat16() for n, s in shapes.items()}
    models = [StandinModel(dims, 2, r) for r in range(2)]
    probed = [probe_engine(m, shapes, set_loader).placement for m in models]
    hub = InProcHub(3)
    servers = [EngineServer(TensorEngine({n: p.data for n, p in m.named_parameters()}, key=KEY, placement=pl),
                            hub.transport(1 + r), [0]) for r, (m, pl) in enumerate(zip(models, assign_primary(probed)))]
    threads = [threading.Thread(target=s.serve, daemon=True) for s in servers]
    for t in threads:
        t.start()
    cfg = _cfg(mode)
    refit = DeltaRefit(cfg, CanonicalSource(weights), engine_wiring(hub.transport(0), [0], [1, 2], LocalGroup()),
                       key=KEY)
    try:
        assert refit.attach().committed
        norm = dict(models[1].named_parameters())["norm.weight"].data
        planted, at = refit.refits + 1, 5
        _flip(norm, at)
        caught = _run_until_caught(refit, planted, _due(mode, planted, "model.norm.weight", at))
        assert caught - planted < MODES[mode]
        assert torch.equal(int_view(norm), int_view(weights["model.norm.weight"]))
    finally:
        for e in (1, 2):
            hub.transport(0).send(e, Envelope(MessageKind.STOP, 0, 0))
        for t in threads:
            t.join(5)


def test_slices_cover_every_element_once_per_cycle_and_are_pseudo_random():
    index = np.arange(100_000)
    slices = Sample(0, K, BLOCK, seed=7).slice_of("w", index)
    assert set(np.unique(slices)) == set(range(K))
    for s in range(K):  # about 1/K each, and not a fixed stride of blocks
        share = float((slices == s).mean())
        assert abs(share - 1 / K) < 0.02
    blocks = slices[::BLOCK]  # each group of K blocks takes a pseudo-random rotation of the K slices
    assert len({tuple(blocks[i:i + K]) for i in range(0, 400, K)}) == K
    assert not np.array_equal(slices, Sample(0, K, BLOCK, seed=8).slice_of("w", index))
    assert not np.array_equal(slices, Sample(0, K, BLOCK, seed=7).slice_of("v", index))


@pytest.mark.parametrize("sample", [None, Sample(1, K, BLOCK, seed=3), Sample(2, K, BLOCK, seed=3)])
def test_sums_over_stepped_runs_read_the_elements_the_runs_map(sample):
    """A transposed param ([E, A, B] stored as [E, B, A]) is one run per row stepping by A: the
    checksum reads each canonical element where the runs put it (numpy reference of the pairs)."""
    e, a, b = 2, 24, 40
    canon = np.arange(e * a * b)
    local = canon // (a * b) * (a * b) + canon % b * a + canon // b % a
    runs = Runs.from_pairs(canon, local)
    assert set(runs.step.tolist()) > {1}
    bits = np.random.default_rng(0).integers(0, 1 << 16, canon.size).astype(np.uint16)
    c, l = runs.expand()
    keep = np.ones(c.size, bool) if sample is None else sample.slice_of("w", c) == sample.slice
    want = int(element_hash(c[keep], bits[l[keep]]).sum(dtype=np.uint64)) & MASK64
    assert runs_checksum(bits, runs.local, runs.canon, runs.length, sample, "w", runs.step) == want
    with pytest.raises(ValueError, match="outside"):
        runs_checksum(bits[:-1], runs.local, runs.canon, runs.length, sample, "w", runs.step)
