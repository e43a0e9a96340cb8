"""DeltaRefit on a one-rank gloo world: bit-exact refits, resync on divergence, attach()."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from nemo_dcr.apply import TensorEngine
from nemo_dcr.config import DcrConfig
from nemo_dcr.hook import DeltaRefit, merge_pieces
from nemo_dcr.types import SparseDelta, int_view


class FakeShard:
    """One local param ``w`` [8, 16] whose rows 0-3 and 4-7 are canonical ``a`` and ``b``."""

    def __init__(self):
        self.params = {"w": torch.randn(8, 16).bfloat16()}
        self.ranges = {"w": (0, 128)}

    def remap(self, d: SparseDelta) -> list[SparseDelta]:
        out = []
        for name, lo in (("a", 0), ("b", 64)):
            sel = (d.positions >= lo) & (d.positions < lo + 64)
            if sel.any():
                out.append(SparseDelta(name, d.dtype, (4, 16), d.positions[sel] - lo,
                                       d.new_bits[sel], d.old_bits[sel]))
        return out

    def dense_export(self):
        w = self.params["w"]
        return {"a": w[:4].clone(), "b": w[4:].clone()}


class FakeEngine:
    def __init__(self):
        self.engine = TensorEngine({"a": torch.zeros(4, 16).bfloat16(),
                                    "b": torch.zeros(4, 16).bfloat16()})
        self.tensors = self.engine.tensors

    def apply(self, parts):
        return self.engine.apply(parts)

    def checksums(self, full=False):
        return self.engine.checksums(full)


@pytest.fixture
def world(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _bump(shard, frac=0.1, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = shard.params["w"]
    mask = torch.rand(w.shape, generator=g) < frac
    w[mask] = (w.float()[mask] * 1.05).bfloat16()


def _exact(shard, engine) -> bool:
    ref = shard.dense_export()
    return all(torch.equal(int_view(ref[n]), int_view(engine.tensors[n])) for n in ref)


def test_delta_refits_are_bit_exact(world):
    torch.manual_seed(0)
    shard, engine = FakeShard(), FakeEngine()
    refit = DeltaRefit(DcrConfig(telemetry_encodings=["reference", "raw"]), shard, engine)
    refit.initial_sync()
    assert _exact(shard, engine) and engine.engine.version == 0
    for step in range(1, 4):
        _bump(shard, seed=step)
        r = refit.step()
        assert r.mode == "delta" and r.version == step and r.error is None and r.verified
        assert _exact(shard, engine) and engine.engine.version == step
        assert 0 < r.changed < 128 and set(r.bytes_by_encoding) == {"dcr", "reference", "raw"}
        assert r.times["total"] >= r.times["apply"]
    r = refit.step()  # nothing changed: an empty delta still moves the version
    assert r.changed == 0 and engine.engine.version == 4


def test_divergent_engine_triggers_resync(world):
    torch.manual_seed(1)
    shard, engine = FakeShard(), FakeEngine()
    refit = DeltaRefit(DcrConfig(), shard, engine)
    refit.initial_sync()
    int_view(engine.tensors["a"])[3] ^= 1  # the engine's memory silently flips a bit
    engine.engine.checksums(full=True)
    _bump(shard, seed=5)
    r = refit.step()
    assert r.mode == "resync" and "Checksum" in (r.error or "")
    assert _exact(shard, engine)
    _bump(shard, seed=6)
    assert refit.step().mode == "delta" and _exact(shard, engine)


def test_forced_resync_interval_and_disabled(world):
    shard, engine = FakeShard(), FakeEngine()
    refit = DeltaRefit(DcrConfig(full_resync_interval=2), shard, engine)
    refit.initial_sync()
    modes = []
    for step in range(4):
        _bump(shard, seed=10 + step)
        modes.append(refit.step().mode)
        assert _exact(shard, engine)
    assert modes == ["delta", "resync", "delta", "resync"]
    off = DeltaRefit(DcrConfig(enabled=False), shard, FakeEngine())
    off.initial_sync()
    assert off.step().mode == "dense"


def test_attach_runs_after_optimizer_step(world):
    shard, engine = FakeShard(), FakeEngine()
    refit = DeltaRefit(DcrConfig(), shard, engine)
    refit.initial_sync()

    class Opt:
        def step(self):
            _bump(shard, seed=42)
            return "stepped"
    opt = Opt()
    refit.attach(opt)
    assert opt.step() == "stepped" and refit.last_report.version == 1 and _exact(shard, engine)


def test_merge_pieces_sorts_and_refuses_overlap():
    a = SparseDelta("t", "bf16", (10,), np.array([5, 7]), np.array([1, 2], np.uint16),
                    np.array([0, 0], np.uint16))
    b = SparseDelta("t", "bf16", (10,), np.array([1]), np.array([3], np.uint16), np.array([0], np.uint16))
    m = merge_pieces([[a], [b]])
    assert m[0].positions.tolist() == [1, 5, 7] and m[0].new_bits.tolist() == [3, 1, 2]
    with pytest.raises(RuntimeError, match="same element"):
        merge_pieces([[a], [a]])
