"""The megatron source's remap through the captured slice's runs (:class:`RunTable`, one compiled
merge walk) gives the very pieces of the layout plan's transforms: the same canonical tensors in
the same order, the same entries, indices and bits, for every param of every rank of every
layout the iota tests cover; and it declines (None: the caller takes the transforms) where a
position lies in no run (vocabulary padding, outside the slice) or positions do not increase."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_layout_iota import CASES, _case_id, _layout, _ranks

from nemo_dcr.integrations.megatron.source import RunTable, _row_runs
from nemo_dcr.kernels.cpu import map_runs
from nemo_dcr.layout import build_plan
from nemo_dcr.types import SparseDelta


def _delta(name: str, pos: np.ndarray, rng) -> SparseDelta:
    new = rng.integers(0, 1 << 16, pos.size, dtype=np.uint16)
    old = rng.integers(0, 1 << 16, pos.size, dtype=np.uint16)
    return SparseDelta(name, "bf16", (int(pos.max()) + 1 if pos.size else 1,), pos, new, old)


def _by_transform(plan, name: str, d: SparseDelta) -> list[tuple]:
    out = []
    for p in plan.remap(name, torch.from_numpy(d.positions)):
        sel = p.selection.numpy()
        out.append((p.name, p.index.numpy().astype(np.int64), d.new_bits[sel], d.old_bits[sel]))
    return out


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_run_table_pieces_equal_the_transforms(case):
    family, dims, topo, spec = case
    rng = np.random.default_rng(0)
    walked = 0
    for pp_rank, chunk, tp_rank, ep_rank, etp_rank in _ranks(topo):
        plan = build_plan(family, dims, _layout(topo, pp_rank, tp_rank, ep_rank, etp_rank), vpp_chunk=chunk,
                          spec=spec)
        for name, pp_ in plan.params.items():
            n = pp_.numel
            width = int(pp_.local_shape[-1]) if pp_.local_shape else 1
            for lo, hi in ((0, n), (n // 3, n - n // 5)):
                if hi <= lo:
                    continue
                runs = _row_runs(plan, name, lo, hi, width)
                table = RunTable.of(runs, lambda idx: plan.remap(name, idx))
                held = sum(int(r.length.sum()) for r in runs.values())
                if table is None:
                    assert held == 0, name
                    continue
                for density in (1.0, 0.3, 0.02):
                    pos = np.flatnonzero(rng.random(hi - lo) < density).astype(np.int64) + lo
                    if not pos.size:
                        continue
                    d = _delta(name, pos, rng)
                    got = table.pieces(d, {t: ("bf16", (1,)) for t in table.names})
                    want = _by_transform(plan, name, d)
                    if got is None:  # some position maps to nothing: the transforms drop it
                        assert sum(w[1].size for w in want) < pos.size, name
                        continue
                    walked += 1
                    assert [g.name for g in got] == [w[0] for w in want], name
                    for g, (_, index, new, old) in zip(got, want):
                        assert np.array_equal(g.positions, index), (name, g.name)
                        assert np.array_equal(g.new_bits, new) and np.array_equal(g.old_bits, old), (name, g.name)
    assert walked > 0


def test_run_table_declines_what_it_cannot_walk():
    family, dims, topo, spec = CASES[5]  # SmolLM2-like, TP=3 PP=2
    plan = build_plan(family, dims, _layout(topo, 0, 1, 0, 0), spec=spec)
    name = next(n for n in plan.params if "linear_qkv.weight" in n)
    n, width = plan.params[name].numel, plan.params[name].local_shape[-1]
    lo, hi = width, n - width  # the captured slice leaves out the first and the last row
    table = RunTable.of(_row_runs(plan, name, lo, hi, width), lambda idx: plan.remap(name, idx))
    rng = np.random.default_rng(1)
    canon = {t: ("bf16", (1,)) for t in table.names}
    for pos in ([lo - 1, lo + 3], [lo, hi], [lo + 5, lo + 2], [lo + 2, lo + 2]):
        assert table.pieces(_delta(name, np.array(pos, np.int64), rng), canon) is None, pos
    assert table.pieces(_delta(name, np.array([lo, hi - 1], np.int64), rng), canon) is not None


def test_map_runs_groups_by_target_in_entry_order():
    start, length = np.array([0, 10, 20], np.int64), np.array([5, 5, 5], np.int64)
    canon, target = np.array([100, 0, 105], np.int64), np.array([1, 0, 1], np.int64)
    bad, sel, index, counts = map_runs(np.array([1, 11, 21, 22], np.int64), start, length, canon, target, 2)
    assert bad == -1 and counts.tolist() == [1, 3]
    assert sel.tolist() == [1, 0, 2, 3] and index.tolist() == [1, 101, 106, 107]
    assert map_runs(np.array([1, 7], np.int64), start, length, canon, target, 2)[0] == 1  # in no run
    assert map_runs(np.array([3, 3], np.int64), start, length, canon, target, 2)[0] == 1  # not increasing
