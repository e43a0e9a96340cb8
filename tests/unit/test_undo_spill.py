"""The undo log holds at most ``limit_bytes`` of old bits in memory; beyond that it spills them
to a temporary file, and a rollback restores every element bit for bit either way."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nemo_dcr.apply import InjectedFault, TensorEngine, UndoLog, apply_version
from nemo_dcr.codec import Identity, encode


def _ints(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randint(-2**15, 2**15, (5000,), dtype=torch.int16, generator=g),
            "b": torch.randint(-2**31, 2**31 - 1, (3000,), dtype=torch.int32, generator=g),
            "c": torch.randint(0, 256, (700,), dtype=torch.uint8, generator=g)}


@pytest.mark.parametrize("limit", [0, 64, 10_000, 1 << 30])
def test_rollback_is_exact_whatever_was_spilled(tmp_path, limit):
    views, ref = _ints(0), {n: t.clone() for n, t in _ints(0).items()}
    undo = UndoLog(limit_bytes=limit, spill_dir=str(tmp_path))
    rng = np.random.default_rng(1)
    for rnd in range(3):
        for name, v in views.items():
            pos = torch.from_numpy(np.sort(rng.choice(v.numel(), v.numel() // 3, replace=False)))
            undo.scatter(v, pos, torch.randint(0, 100, (pos.numel(),), dtype=v.dtype))
        undo.overwrite(views["b"], torch.full((3000,), rnd, dtype=torch.int32))
        assert undo.held_bytes <= limit
    if limit < 1 << 30:
        assert undo.spilled_bytes > 0
    undo.rollback()
    assert all(torch.equal(views[n], ref[n]) for n in ref)
    assert undo.held_bytes == undo.spilled_bytes == 0 and not list(tmp_path.iterdir())


def test_a_committed_log_leaves_no_file(tmp_path):
    views = _ints(2)
    undo = UndoLog(limit_bytes=0, spill_dir=str(tmp_path))
    undo.scatter(views["a"], torch.arange(100), torch.zeros(100, dtype=torch.int16))
    assert undo.spilled_bytes == 200 and undo._file is not None
    undo.close()
    assert undo._file is None and not list(tmp_path.iterdir())


def _bf16(seed: int, n: int = 20_000) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": (torch.randn(n, generator=g) * 0.02).to(torch.bfloat16) for i in range(3)}


def test_engine_bounds_its_undo_log_and_rolls_back_from_disk(tmp_path):
    base, target = _bf16(0), {n: (t.view(torch.int16) + 1).view(torch.bfloat16) for n, t in _bf16(0).items()}
    engine = TensorEngine({n: t.clone() for n, t in base.items()}, undo_limit_bytes=1000, spill_dir=str(tmp_path))
    payload = encode(base, target, Identity(base_version=0, target_version=1), "reference")
    written = []

    def fault(name):
        written.append(name)
        if len(written) == 3:
            raise InjectedFault("after the last tensor")

    engine.fault = fault
    with pytest.raises(InjectedFault):
        apply_version(engine, {0: [payload]})
    assert all(torch.equal(engine.tensors[n].view(torch.int16), base[n].view(torch.int16)) for n in base)
    engine.fault = None
    result = apply_version(engine, {0: [payload]})
    assert result.undo_bytes <= 1000 and result.undo_spilled_bytes >= 2 * 3 * 20_000 - 1000
    assert all(torch.equal(engine.tensors[n].view(torch.int16), target[n].view(torch.int16)) for n in base)
    assert not list(tmp_path.iterdir())


def test_resync_undo_spills_whole_tensors(tmp_path):
    base, target = _bf16(3), _bf16(4)
    engine = TensorEngine({n: t.clone() for n, t in base.items()}, undo_limit_bytes=0, spill_dir=str(tmp_path))
    zeros = {n: torch.zeros_like(t) for n, t in target.items()}
    resync = encode(zeros, target, Identity(base_version=0, target_version=5), "reference")
    engine.fault = lambda name: (_ for _ in ()).throw(InjectedFault(name)) if name == "w2" else None
    with pytest.raises(InjectedFault):
        apply_version(engine, {0: [resync]}, resync=True)
    assert all(torch.equal(engine.tensors[n].view(torch.int16), base[n].view(torch.int16)) for n in base)
    engine.fault = None
    result = apply_version(engine, {0: [resync]}, resync=True)
    assert result.undo_bytes == 0 and result.undo_spilled_bytes == 3 * 2 * 20_000
    assert all(torch.equal(engine.tensors[n].view(torch.int16), target[n].view(torch.int16)) for n in base)
