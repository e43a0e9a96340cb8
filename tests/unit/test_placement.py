"""Placement by probing the engine's own ``load_weights`` with iota and value tensors, on the CPU
stand-in of vLLM's loader contract (``tests.standins.vllm_standin``, not vLLM): the probed map
must agree with what the loaders really do to real tensors, cover every canonical element once,
and skip vocab padding; tensors loaded through a value transform are found and reloaded, direct
writes that bypass the loaders are placed, skipped tensors are named."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nemo_dcr.apply.placement import PlacementError, Runs, assign_primary, check_coverage
from nemo_dcr.apply.probe import SHADOW, Kind, probe_engine
from nemo_dcr.apply.write_guard import record_writes
from tests.standins.vllm_standin import StandinDims, StandinModel, StandinTruthModel, canonical_shapes, truth_shapes

D = StandinDims()


def _set_loader(param, fn):
    old = getattr(param, "weight_loader", None)
    param.weight_loader = fn
    return old


def _probe(model, shapes=None):
    return probe_engine(model, shapes or canonical_shapes(D), _set_loader).placement


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


def _select_oracle(runs: Runs, pos: np.ndarray):
    """Runs.select by numpy bisection (the map written out, not the compiled walk under test)."""
    r = np.searchsorted(runs.canon, pos, side="right") - 1
    rr = np.maximum(r, 0)
    held = (r >= 0) & (pos < runs.canon[rr] + runs.length[rr]) if runs.canon.size else np.zeros(pos.size, bool)
    k = pos[held] - runs.canon[rr[held]]
    return held, runs.view_start[rr[held]] + k, runs.local[rr[held]] + k * runs.step[rr[held]]


def test_runs_select_and_view_maps_match_bisection_in_any_order():
    """The compiled merge walk against bisection: random runs (gaps, steps, long jumps past
    several runs), positions sorted and shuffled, held and not held, no runs at all."""
    rng = np.random.default_rng(7)
    for trial in range(200):
        nr = int(rng.integers(0, 60))
        length = rng.integers(1, 20, nr)
        gaps = rng.integers(0, 6, nr) * (rng.random(nr) < 0.7)
        canon = (np.cumsum(gaps + np.concatenate([[0], length[:-1]])) if nr else np.zeros(0)).astype(np.int64)
        runs = Runs(canon, rng.integers(0, 5000, nr).astype(np.int64), length.astype(np.int64),
                    rng.integers(1, 4, nr).astype(np.int64))
        top = int(canon[-1] + length[-1] + 5) if nr else 10
        for shuffled in (False, True):
            pos = np.sort(rng.choice(top, size=int(rng.integers(0, top + 1)), replace=False)).astype(np.int64)
            if shuffled:
                rng.shuffle(pos)
            for got, want in zip(runs.select(pos), _select_oracle(runs, pos)):
                assert np.array_equal(got, want), trial
            if runs.numel:
                view = rng.integers(0, runs.numel, 40)
                view = view if shuffled else np.sort(view)
                r = np.searchsorted(runs.view_start, view, side="right") - 1
                k = view - runs.view_start[r]
                assert np.array_equal(runs.view_to_canon(view), runs.canon[r] + k)
                assert np.array_equal(runs.view_to_local(view), runs.local[r] + k * runs.step[r])
    empty = Runs(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64))
    assert empty.view_to_canon(np.zeros(0, np.int64)).size == 0
    with pytest.raises(IndexError, match="holds no element"):
        empty.view_to_canon(np.array([0]))


def test_runs_found_in_chunks_are_joined_and_a_contiguous_view_gathers_without_a_copy():
    """A probe finds runs chunk by chunk: a view that is one contiguous range of its param must
    come out as one run (its decode base is then a view of the param, not a copy per refit)."""
    from nemo_dcr.apply.shard_view import ShardView

    chunks = [Runs(np.array([c]), np.array([c + 6]), np.array([4])) for c in (8, 0, 4)]
    plain = Runs.merged(chunks + [Runs(np.array([12]), np.array([40]), np.array([2]))])
    assert (plain.canon.tolist(), plain.local.tolist(), plain.length.tolist()) == ([0, 12], [6, 40], [12, 2])
    rows = Runs.merged([Runs(np.array([0]), np.array([0]), np.array([3]), np.array([4])),
                        Runs(np.array([3]), np.array([12]), np.array([3]), np.array([4])),
                        Runs(np.array([6]), np.array([24]), np.array([3]), np.array([1]))])
    assert rows.length.tolist() == [6, 3] and rows.step.tolist() == [4, 1]  # same step joined, not across steps
    assert rows.expand()[1].tolist() == [0, 4, 8, 12, 16, 20, 24, 25, 26]
    param = torch.arange(20, dtype=torch.bfloat16)
    view = ShardView(param, Runs.merged(chunks))
    base = view.gather()
    assert base.data_ptr() == param[6:].data_ptr() and base.tolist() == param[6:18].tolist()


def test_stepped_runs_map_a_transpose_one_run_per_row():
    e, a, b = 2, 3, 4
    canon = np.arange(e * a * b)
    local = canon // (a * b) * (a * b) + canon % b * a + canon // b % a  # [E, A, B] stored as [E, B, A]
    runs = Runs.from_pairs(canon, local)
    assert runs.length.size <= e * a + 1 and set(runs.step.tolist()) <= {1, a}
    c, l = runs.expand()
    assert c.tolist() == canon.tolist() and l.tolist() == local.tolist()
    assert runs.view_to_local(np.arange(canon.size)).tolist() == local.tolist()
    held, view, loc = runs.select(np.array([5, 23]))
    assert held.all() and loc.tolist() == local[[5, 23]].tolist()


def test_pieces_follow_the_expanded_runs():
    e, a, b = 2, 3, 4
    canon = np.concatenate([np.arange(e * a * b), np.arange(100, 110)])
    local = np.concatenate([canon[:24] // (a * b) * (a * b) + canon[:24] % b * a + canon[:24] // b % a,
                            np.arange(40, 50)])  # a transpose (step a), then one plain run
    runs = Runs.from_pairs(canon, local)
    c, l = runs.expand()
    parts = list(runs.pieces(5))
    assert all(p[0].size <= 5 for p in parts)
    assert np.concatenate([p[0] for p in parts]).tolist() == c.tolist()
    assert np.concatenate([p[1] for p in parts]).tolist() == l.tolist()


def _pairs_of_view(runs, intervals):
    """The old way: every element of the intervals expanded, then compressed again."""
    view = np.concatenate([np.arange(s, s + n) for s, n in intervals] or [np.zeros(0, np.int64)])
    return Runs.from_pairs(runs.view_to_canon(view), runs.view_to_local(view)).expand()


@pytest.mark.parametrize("seed", range(6))
def test_runs_of_view_intervals_equal_the_expanded_pairs(seed):
    rng = np.random.default_rng(seed)
    e, a, b = 3, 5, 7  # stepped runs (a transpose) after plain ones
    t = np.arange(e * a * b)
    canon = np.concatenate([np.arange(40), 100 + rng.permutation(60)[:30], 200 + t])
    transposed = t // (a * b) * (a * b) + t % b * a + t // b % a
    local = np.concatenate([np.arange(40) + 7, 60 + np.arange(30), 500 + transposed])
    runs = Runs.from_pairs(canon, local)
    edges = np.sort(rng.choice(np.arange(1, runs.numel), size=10, replace=False))
    bounds = np.concatenate([[0], edges, [runs.numel]])
    intervals = [(int(s), int(t - s)) for s, t in zip(bounds[:-1], bounds[1:])][seed % 2::2]
    got = runs.of_view(intervals)
    want_c, want_l = _pairs_of_view(runs, intervals)
    c, l = got.expand()
    assert c.tolist() == want_c.tolist() and l.tolist() == want_l.tolist()
    assert np.all(np.diff(got.canon) > 0) and got.length.sum() == sum(n for _, n in intervals)
    assert runs.of_view([(0, runs.numel)]).expand()[1].tolist() == runs.expand()[1].tolist()
    assert runs.of_view([]).numel == 0
    with pytest.raises(PlacementError, match="outside"):
        runs.of_view([(0, runs.numel + 1)])


class _Twice(torch.nn.Module):
    """A loader that writes one canonical element at two positions, and one that scales."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16), requires_grad=False)
        self.s = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16), requires_grad=False)
        self.w.weight_loader = lambda p, x: (p.data.copy_(x), p.data.__setitem__(1, x[0]))
        self.s.weight_loader = lambda p, x: p.data.copy_(x * 2)

    def load_weights(self, weights):
        for name, x in weights:
            p = getattr(self, name)
            p.weight_loader(p, x)
        return set()


def test_an_element_landing_twice_and_a_scaling_loader_are_transforms():
    probe = probe_engine(_Twice(), {"w": (4,), "s": (4,)}, _set_loader)
    assert probe.reload == {"s": ("s",), "w": ("w",)} and probe.placement["s"].param == SHADOW + "s"
    assert probe.params["s"].kind == probe.params["w"].kind == Kind.TRANSFORMED and probe.refusals == {}


def _truth(tp=2, rank=1, seed=0):
    model = StandinTruthModel(D, tp, rank)
    g = torch.Generator().manual_seed(seed)
    weights = {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in truth_shapes(D).items()}
    model.load_weights(weights.items())
    return model, weights


def test_recording_sees_direct_writes_and_writes_nothing():
    model, _ = _truth()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    writes = record_writes(model, truth_shapes(D), _set_loader)
    gate_up = writes["model.layers.1.mlp.router_experts.gate_up_proj"]
    assert gate_up.loader == () and gate_up.direct == ("layers.1.mlp.router_experts.w13",)
    assert writes["model.layers.0.mixer.A_log"].loader == ("layers.0.mixer.A",)
    assert writes["model.mtp.0.weight"].params == ()
    assert all(torch.equal(p.view(torch.uint8), before[n].view(torch.uint8)) for n, p in model.named_parameters())


def test_transforms_bypasses_and_skipped_tensors_are_classified():
    model, weights = _truth()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    probe = probe_engine(model, truth_shapes(D), _set_loader)
    assert all(torch.equal(p.view(torch.uint8), before[n].view(torch.uint8)) for n, p in model.named_parameters())
    assert probe.skipped == {"model.mtp.0.weight": "the engine's load_weights loads nothing of it"}
    assert probe.refusals == {}
    assert probe.reload == {"model.layers.0.mixer.A_log": ("layers.0.mixer.A",)}  # -exp(A_log): a transform
    assert probe.params["layers.0.mixer.A"].kind == Kind.TRANSFORMED
    assert probe.params["layers.0.self_attn.W_T"].kind == Kind.UNWRITTEN  # derived: the vLLM side finds it
    experts = probe.placement["model.layers.1.mlp.router_experts.gate_up_proj"]  # written by param.copy_
    assert experts.param == "layers.1.mlp.router_experts.w13" and probe.params[experts.param].kind == Kind.IN_PLACE
    assert experts.runs.length.size < experts.numel // 4  # a transpose: runs of rows, not of elements
    live = dict(model.named_parameters())
    for name, tp_ in probe.placement.items():
        if tp_.param.startswith(SHADOW):
            continue
        canon, local = tp_.runs.expand()
        got = live[tp_.param].detach().reshape(-1).view(torch.int16)[torch.from_numpy(local)]
        assert torch.equal(got, weights[name].reshape(-1).view(torch.int16)[torch.from_numpy(canon)]), name


def test_probe_cost_is_one_load_per_tensor_plus_two_per_group():
    model = StandinModel(D, tp=1, rank=0)
    probe = probe_engine(model, canonical_shapes(D), _set_loader)
    groups = len({tp_.param for tp_ in probe.placement.values()})  # here each group is one param
    assert probe.stats.load_calls == len(canonical_shapes(D)) + 2 * groups  # all experts of w13 in one call
    w13 = dict(model.named_parameters())["layers.1.mlp.experts.w13_weight"]
    assert probe.stats.peak_bytes <= 12 * w13.numel() + 10 * D.vocab * D.hidden  # ~ one param's buffers


def test_probing_leaves_live_params_untouched():
    model = StandinModel(D, tp=2, rank=0)
    model.load_weights(_weights(1).items())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _probe(model)
    for n, p in model.named_parameters():
        assert p.dtype == torch.bfloat16 and torch.equal(p.view(torch.int16), before[n].view(torch.int16)), n
