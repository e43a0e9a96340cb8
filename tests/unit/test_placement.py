"""Placement by probing loaders with iota tensors, on the CPU stand-in of vLLM's loader contract
(``tests.standins.vllm_standin``, not vLLM): the probed map must agree with what the loaders
really do to real tensors, cover every canonical element once, and skip vocab padding."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nemo_dcr.apply.placement import (
    PlacementError,
    Runs,
    assign_primary,
    check_coverage,
    probe_model,
    probe_tensor,
    record_loader_calls,
)
from tests.standins.vllm_standin import StandinDims, StandinModel, canonical_shapes

D = StandinDims()


def _set_loader(param, fn):
    old = param.weight_loader
    param.weight_loader = fn
    return old


def _probe(model):
    shapes = canonical_shapes(D)
    calls = record_loader_calls(model, shapes.items(), _set_loader)
    return probe_model(model, shapes, calls, lambda p: p.weight_loader)


def _weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in canonical_shapes(D).items()}


def _grid(tp, ep):
    return [(r, e) for e in range(ep) for r in range(tp)]


@pytest.mark.parametrize("tp,ep", [(1, 1), (2, 1), (4, 1), (2, 2)])
def test_probe_matches_real_load(tp, ep):
    weights = _weights()
    for rank, ep_rank in _grid(tp, ep):
        model = StandinModel(D, tp, rank, ep, ep_rank)
        placement = _probe(model)
        model.load_weights(weights.items())
        params = dict(model.named_parameters())
        for name, tp_ in placement.items():
            canon, local = tp_.runs.expand()
            got = params[tp_.param].detach().reshape(-1).view(torch.int16)[torch.from_numpy(local)]
            want = weights[name].reshape(-1).view(torch.int16)[torch.from_numpy(canon)]
            assert torch.equal(got, want), name


@pytest.mark.parametrize("tp,ep", [(2, 1), (4, 1), (2, 2)])
def test_every_element_held_once_as_primary(tp, ep):
    ranks = assign_primary([_probe(StandinModel(D, tp, r, ep, e)) for r, e in _grid(tp, ep)])
    check_coverage(ranks, canonical_shapes(D))
    k = "model.layers.0.self_attn.k_proj.weight"  # one KV head: replicated on every TP rank
    assert all(k in r for r in ranks)
    assert [sum(n for _, n in r[k].primary) for r in ranks][:tp] == [16] + [0] * (tp - 1)


def test_qkv_shard_is_one_run_at_its_offset():
    placement = _probe(StandinModel(D, tp=2, rank=1))
    q, k = placement["model.layers.0.self_attn.q_proj.weight"], placement["model.layers.0.self_attn.k_proj.weight"]
    assert q.param == "layers.0.self_attn.qkv_proj.weight"
    assert (q.runs.canon.tolist(), q.runs.local.tolist(), q.runs.length.tolist()) == ([32], [0], [32])
    assert (k.runs.canon.tolist(), k.runs.local.tolist(), k.runs.length.tolist()) == ([0], [32], [16])


def test_vocab_padding_is_not_placed():
    last = _probe(StandinModel(D, tp=2, rank=1))["model.embed_tokens.weight"]
    canon, local = last.runs.expand()
    assert canon.min() == 8 * D.hidden and canon.max() == 10 * D.hidden - 1  # rows 8, 9 of 10
    assert local.max() < 2 * D.hidden  # rows 2..7 of the local shard are padding: absent


def test_moe_experts_only_on_their_ep_rank():
    placement = _probe(StandinModel(D, tp=1, rank=0, ep=2, ep_rank=1))
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" not in placement
    up = placement["model.layers.1.mlp.experts.3.up_proj.weight"]
    assert up.param == "layers.1.mlp.experts.w13_weight"
    assert up.runs.local[0] == 1 * (2 * D.moe_ffn * D.hidden) + D.moe_ffn * D.hidden  # expert 1, 2nd half


def test_runs_select_and_views():
    runs = Runs.from_pairs(np.array([5, 6, 7, 0, 1, 20]), np.array([10, 11, 12, 0, 1, 3]))
    assert runs.canon.tolist() == [0, 5, 20] and runs.length.tolist() == [2, 3, 1]
    held, view, local = runs.select(np.array([1, 2, 6, 20, 21]))
    assert held.tolist() == [True, False, True, True, False]
    assert view.tolist() == [1, 3, 5] and local.tolist() == [1, 11, 3]
    assert runs.view_to_local(view).tolist() == local.tolist()
    assert runs.view_to_canon(view).tolist() == [1, 6, 20]


def test_probe_refuses_duplicates_and_value_changes():
    def twice(buf, iota):
        buf[0], buf[1] = iota[0], iota[0]

    with pytest.raises(PlacementError, match="two engine positions"):
        probe_tensor("t", (4,), "p", (4,), twice)

    def scaled(buf, iota):
        buf.copy_(iota * 0.5)

    with pytest.raises(PlacementError, match="changed values"):
        probe_tensor("t", (4,), "p", (4,), scaled, dtype=torch.float64)


def test_probing_leaves_live_params_untouched():
    model = StandinModel(D, tp=2, rank=0)
    model.load_weights(_weights(1).items())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _probe(model)
    for n, p in model.named_parameters():
        assert p.dtype == torch.bfloat16 and torch.equal(p.view(torch.int16), before[n].view(torch.int16)), n
