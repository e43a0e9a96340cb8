"""The GPU path run on the CPU (docs/refit.md, "GPU path"): under ``device_path()`` host tensors take
the device code (torch gathers and scatters, copies through ``kernels.traffic``), and the counted
host <-> device bytes follow the changes, not the tensors' size, with results bit-identical to the
host path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nemo_dcr.apply import TensorEngine, apply_version
from nemo_dcr.capture import BaselineStore, capture
from nemo_dcr.codec import DcrIndexes, Identity, decode, encode_deltas
from nemo_dcr.kernels.traffic import device_path, measure, on_host
from nemo_dcr.types import SparseDelta, bits_view, spec_of
from nemo_dcr.verify.checksum import tensor_checksum

SPEC = spec_of(torch.bfloat16)


def _model(numel: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layer{i}.weight": (torch.randn(numel, generator=g) * 10.0 ** -i).to(torch.bfloat16) for i in range(3)}


def _step(model: dict[str, torch.Tensor], changes: int, seed: int) -> dict[str, torch.Tensor]:
    """``changes`` elements of each tensor move by one to three ULPs (some cross a binade)."""
    g = np.random.default_rng(seed)
    out = {}
    for n, t in model.items():
        bits = bits_view(t.clone()).copy()
        pos = g.choice(bits.size, changes, replace=False)
        bits[pos] = (bits[pos].astype(np.int64) + g.choice([-3, -1, 1, 2], changes)).astype(np.uint16)
        out[n] = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)
    return out


def _deltas(base, target) -> list[SparseDelta]:
    out = []
    for n, b in base.items():
        bb, tb = bits_view(b), bits_view(target[n])
        pos = np.flatnonzero(bb != tb).astype(np.int64)
        out.append(SparseDelta(n, SPEC.name, tuple(b.shape), pos, tb[pos], bb[pos]))
    return out


def _refits(numel: int, changes: int, steps: int, encoding: str = "dcr", on_device: bool = True):
    """Engine after ``steps`` refits of ``changes`` per tensor, the dense target and each refit's result."""
    model = _model(numel)
    engine = TensorEngine({n: t.clone() for n, t in model.items()})
    engine.build_indexes()  # at attach: not a refit's traffic
    bits = {n: bits_view(t.clone()) for n, t in model.items()}
    indexes, cur, results = DcrIndexes(), model, []
    for v in range(steps):
        target = _step(cur, changes, seed=v + 1)
        deltas = _deltas(cur, target)
        payload = encode_deltas(deltas, bits, Identity(base_version=v, target_version=v + 1), encoding,
                                indexes=indexes)
        if on_device:
            with device_path():
                results.append(apply_version(engine, {0: [payload]}))
        else:
            results.append(apply_version(engine, {0: [payload]}))
        for d in deltas:
            bits[d.name][d.positions] = d.new_bits
        indexes.update(deltas)
        cur = target
    return engine, cur, results


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("encoding", ["dcr", "reference"])
def test_device_path_is_bit_identical_to_the_host_path_and_the_dense_target(encoding):
    dev, target, dev_results = _refits(20_000, 300, 3, encoding)
    host, _, host_results = _refits(20_000, 300, 3, encoding, on_device=False)
    for n, t in target.items():
        assert _equal(dev.tensors[n], t) and _equal(host.tensors[n], t)
    for a, b in zip(dev_results, host_results):
        assert a.checksums == b.checksums and a.touched == b.touched
        assert all(np.array_equal(x.old_bits, y.old_bits) and np.array_equal(x.positions, y.positions)
                   for x, y in zip(a.deltas, b.deltas))
        assert b.host_device.total == 0  # host tensors: nothing crosses
    assert dev.indexes.builds == len(target)  # built at attach only: every decode read the changes alone


def test_engine_traffic_follows_the_changes_not_the_tensor_size():
    changes = 400
    small = _refits(10_000, changes, 2)[2]
    large = _refits(80_000, changes, 2)[2]
    for s, g in zip(small, large):
        changed = sum(s.touched.values())
        assert changed == sum(g.touched.values()) == 3 * changes
        assert s.host_device == g.host_device  # the same bytes whatever the size
        per = s.host_device.per_element(changed)
        # old bits gathered (2 B) cross to the host; positions (8 B, twice: gather and write) and
        # new bits (2 B, twice: write and read-back) cross to the device
        assert per == {"to_host": 2.0, "to_device": 20.0}
        assert s.host_device.total <= 64 * changed


def test_capture_on_the_device_path_moves_only_the_changes():
    model = _model(50_000)
    target = _step(model, 250, seed=7)
    params = {n: t.clone() for n, t in model.items()}
    with device_path():
        store = BaselineStore("device")
        for n, p in params.items():
            store.register(n, p)
        for n, p in params.items():
            p.copy_(target[n])
        with measure() as scan:
            deltas = capture(params, store, version=1)
        with measure() as commit:
            store.commit(1)
    changed = sum(d.nnz for d in deltas)
    assert changed == 3 * 250
    assert scan.per_element(changed) == {"to_host": 8.0, "to_device": 0.0}  # 4 B position, new and old bits
    assert commit.per_element(changed) == {"to_host": 0.0, "to_device": 10.0}  # positions and new bits
    want = _deltas(model, target)
    assert all(np.array_equal(d.positions, w.positions) and np.array_equal(d.new_bits, w.new_bits)
               and np.array_equal(d.old_bits, w.old_bits) for d, w in zip(deltas, want))
    assert all(_equal(store.bits(n).view(torch.bfloat16), target[n]) for n in target)


def test_a_device_tensor_without_its_checksum_or_index_is_copied_whole_and_counted():
    model = _model(5_000)
    target = _step(model, 50, seed=3)
    bits = {n: bits_view(t.clone()) for n, t in model.items()}
    payload = encode_deltas(_deltas(model, target), bits, Identity(), "dcr")
    with device_path(), measure() as crossed:
        assert not on_host(model["layer0.weight"])
        decoded = decode(payload, model)  # no checksums, no kept index: the whole base crosses
    assert crossed.to_host == sum(t.numel() * 2 for t in model.values())
    with measure() as crossed:
        host = decode(payload, model, base_checksums={n: tensor_checksum(b) for n, b in bits.items()})
    assert crossed.total == 0
    assert all(np.array_equal(a.new_bits, b.new_bits) for a, b in zip(decoded.deltas, host.deltas))


def test_the_refit_report_counts_the_trainers_copies():
    from nemo_dcr.config.schema import DcrConfig
    from nemo_dcr.refit import DeltaRefit, colocated_wiring
    from tests.standins.shard_trainer import ShardTrainer

    shapes = {"a.weight": (48, 32), "b.weight": (64, 16)}
    trainer = ShardTrainer(shapes, 0, 1, lr=2e-4)
    engine = TensorEngine({n: p.detach().clone() for n, p in trainer.params.items()})
    cfg = DcrConfig(transport="inprocess", reply_timeout_s=120, verify="incremental", verify_steps=0)
    refit = DeltaRefit(cfg, trainer, colocated_wiring(cfg, 0, None), engine)
    try:
        with device_path():
            refit.attach()
            for _ in range(2):
                trainer.step()
                r = refit.step()
                assert r.committed and r.mode == "delta" and r.changed > 0
                # capture: 4 B position + new + old bits to the host; baseline commit: 8 B position + new bits
                assert r.host_device_bytes == {"to_host": 8 * r.changed, "to_device": 10 * r.changed}
    finally:
        refit.close(5)
    assert all(_equal(engine.tensors[n], p.detach()) for n, p in trainer.params.items())


def test_a_view_of_many_runs_is_gathered_on_the_device_from_its_runs():
    from nemo_dcr.apply.placement import Runs
    from nemo_dcr.apply.shard_view import ShardView

    param = _model(64 * 300)["layer0.weight"].reshape(300, 64)
    local = (np.arange(300)[:, None] * 64 + 16 + np.arange(32)[None, :]).reshape(-1)  # a column shard: 300 runs
    view = ShardView(param, Runs.from_pairs(np.arange(local.size), local))
    host = view.gather()
    with device_path(), measure() as crossed:
        dev = view.gather()
    assert torch.equal(host.view(torch.int16), dev.view(torch.int16))
    runs = view.runs.length.size
    assert runs < local.size // 8 and crossed.total == 24 * runs  # the runs, not an index per element


def test_a_stepped_view_is_gathered_on_the_device_like_on_the_host():
    from nemo_dcr.apply.placement import Runs
    from nemo_dcr.apply.shard_view import ShardView

    param = _model(64 * 300)["layer0.weight"].reshape(300, 64)
    runs = Runs(np.array([0, 300] + list(range(600, 600 + 80))), np.array([5, 6] + list(range(7, 87))),
                np.array([300, 300] + [1] * 80), np.array([64, 64] + [1] * 80))  # two columns, then 80 runs of 1
    view = ShardView(param, runs)
    host = view.gather()
    with device_path(), measure():
        dev = view.gather()
    assert torch.equal(host.view(torch.int16), dev.view(torch.int16))
    assert torch.equal(host[:300].view(torch.int16), param[:, 5].contiguous().view(torch.int16))
