"""Routing on gloo.  Engine side: one trainer process, two engine processes (TP=2 stand-in engine
with fused qkv/gate_up, MoE w13/w2, padded vocab).  Each engine rank must receive only records
for elements it holds (view-sized), end bit-identical to loading the trainer's weights through
the stand-in's own loaders, and recover from a lost part by a routed resync.  Trainer side: three
trainer processes holding row shards route their AdamW changes to the owners over their own gloo
group, coded against their views, and put fewer bytes on that link than on the engines'."""

from __future__ import annotations

import json
import multiprocessing as mp
from pathlib import Path

import numpy as np
import pytest
import routing_worker as w
import torch

from tests.standins.vllm_standin import StandinModel

pytestmark = pytest.mark.distributed


def _run(tmp: Path, refits: int, trainers: int = 1) -> None:
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=w.engine_main, args=(str(tmp), r, trainers)) for r in range(trainers, trainers + w.TP)]
    procs += [ctx.Process(target=w.trainer_main, args=(str(tmp), refits, r, trainers)) for r in range(trainers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(180)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert codes == [0] * len(procs), f"exit codes {codes} (engines first)"


def test_two_engine_ranks_receive_only_their_records(tmp_path):
    _run(tmp_path, refits=4)
    rows = json.loads((tmp_path / "trainer.json").read_text())
    assert all(r["committed"] and r["ok"] and r["routed"] for r in rows), rows
    assert rows[2]["resynced"] and rows[2]["detected"], "the lost part was not detected and resynced"
    assert not rows[1]["resynced"] and not rows[3]["resynced"]
    places = w.placements()
    trainer = dict(np.load(tmp_path / "trainer.npz"))
    for r, placement in enumerate(places):
        seen = json.loads((tmp_path / f"engine{r}.json").read_text())["seen"]
        assert seen and {n for n, _, _ in seen} <= set(placement)
        assert all(shape == [placement[n].numel] for n, shape, _ in seen)
        ref = StandinModel(w.D, w.TP, r)  # dense reference: the stand-in's own loaders
        ref.load_weights((n, torch.from_numpy(b).view(torch.bfloat16)) for n, b in trainer.items())
        got = dict(np.load(tmp_path / f"engine{r}.npz"))
        for name, p in ref.named_parameters():
            assert np.array_equal(got[name], p.detach().view(torch.int16).numpy()), (r, name)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert places[0][q].numel + places[1][q].numel == int(np.prod(w.SHAPES[q]))  # q split, not copied


def _engines_match_a_dense_load(tmp: Path, d, trainer: dict) -> None:
    for r in range(w.TP):
        ref = StandinModel(d, w.TP, r)  # dense reference: the stand-in's own loaders
        ref.load_weights((n, torch.from_numpy(b).view(torch.bfloat16)) for n, b in trainer.items())
        got = dict(np.load(tmp / f"engine{r}.npz"))
        for name, p in ref.named_parameters():
            assert np.array_equal(got[name], p.detach().view(torch.int16).numpy()), (r, name)


def test_three_trainer_ranks_route_fewer_bytes_to_each_other_than_to_the_engines(tmp_path):
    _run(tmp_path, refits=3, trainers=3)
    rows = json.loads((tmp_path / "trainer.json").read_text())
    assert all(r["committed"] and r["ok"] and r["routed"] for r in rows), rows
    assert rows[0]["mode"] == "attach" and rows[0]["resynced"]  # the engine started empty
    deltas = [r for r in rows if r["mode"] == "delta"]
    assert not any(r["detected"] or r["resynced"] for r in deltas), deltas
    assert len(deltas) == 3 and all(0 < r["density"] < 0.2 for r in deltas), deltas
    for r in deltas:  # two thirds of every tensor are routed, coded like the payload
        print(f"density {r['density']:.2%}: {r['links']}")
        assert 0 < r["links"]["trainer_to_trainer"] <= r["links"]["trainer_to_engine"], r
    shards = [dict(np.load(tmp_path / f"trainer{r}.npz")) for r in range(3)]
    trainer = {n: np.concatenate([s[n] for s in shards]) for n in shards[0]}  # row shards, in rank order
    _engines_match_a_dense_load(tmp_path, w.BIG, trainer)
