"""The vLLM worker extension's code path without vLLM, mixed into a stand-in worker whose model is
the loader-contract stand-in (``tests.standins.vllm_standin``, not vLLM): probe, attach,
prepare and commit a routed delta per TP rank, roll back when one rank refuses, and sum canonical
checksums to the trainer's totals; on the truth stand-in, a transformed tensor is reloaded through
its loader, a derived one re-derived, a directly written one placed, and both ranks end as a
fresh load of the target.  The real engine is tested in ``tests/vllm``."""

from __future__ import annotations

import torch

from nemo_dcr.apply.placement import assign_primary, check_coverage, placement_from_json, placement_to_json
from nemo_dcr.codec import Identity, diff_tensors
from nemo_dcr.integrations.vllm.worker import DcrWorkerExtension, set_loader
from nemo_dcr.refit.fanout import Fanout
from nemo_dcr.refit.mirror import SenderMirror
from nemo_dcr.types import bits_view
from nemo_dcr.verify.checksum import tensor_checksum
from tests.standins.vllm_standin import StandinDims, StandinModel, StandinTruthModel, canonical_shapes, truth_shapes

D, TP, KEY = StandinDims(), 2, b"worker-test-key-0123456789abcdef"


class StandinWorker(DcrWorkerExtension):
    """Stand-in for vLLM's worker: ``rank`` and ``model_runner.model`` are all the extension uses."""

    def __init__(self, rank: int, weights):
        self.rank = rank
        self.model_runner = type("Runner", (), {})()
        self.model_runner.model = StandinModel(D, TP, rank)
        self.model_runner.model.load_weights(weights.items())


def _weights(seed):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in canonical_shapes(D).items()}


def test_worker_extension_applies_routed_delta():
    base, target = _weights(0), _weights(0)
    for t in target.values():
        t.view(torch.int16).reshape(-1)[::3] += 1  # change a third of every tensor by one ULP
    workers = [StandinWorker(r, base) for r in range(TP)]
    shapes = {n: list(s) for n, s in canonical_shapes(D).items()}
    ranks = assign_primary([placement_from_json(w.dcr_probe(shapes)["placement"]) for w in workers])
    for w in workers:
        w.dcr_attach([placement_to_json(r) for r in ranks], KEY, 0)
    base_live = {n: p.detach().clone() for n, p in workers[0].model_runner.model.named_parameters()}
    mirror = SenderMirror({n: ("bf16", tuple(t.shape)) for n, t in base.items()})
    mirror.reset(base, 0)
    parts = Fanout(dict(enumerate(ranks)), mirror).encode(diff_tensors(base, target), Identity(base_version=0,
                                                          target_version=1), "dcr", KEY, 1 << 20)
    by_rank = [parts[r] for r in range(TP)]
    bad = [by_rank[0], [b"\0" + p[1:] for p in by_rank[1]]]
    replies = [w.dcr_prepare(bad) for w in workers]
    assert [x["ok"] for x in replies] == [True, False] and replies[1]["error"]
    assert [w.dcr_rollback()["rolled_back"] for w in workers] == [True, False]
    assert all(torch.equal(p.view(torch.int16), base_live[n].view(torch.int16))
               for n, p in workers[0].model_runner.model.named_parameters())
    assert all(w.dcr_prepare(by_rank)["ok"] for w in workers)
    assert all(w.dcr_commit()["version"] == 1 for w in workers)
    sums = {}
    for w in workers:
        for n, c in w.dcr_checksums(full=True)["checksums"].items():
            sums[n] = (sums.get(n, 0) + c) % (1 << 64)
    assert sums == {n: tensor_checksum(bits_view(t)) for n, t in target.items()}
    ref = StandinModel(D, TP, 1)
    ref.load_weights(target.items())
    live = dict(workers[1].model_runner.model.named_parameters())
    assert all(torch.equal(p.view(torch.int16), live[n].view(torch.int16)) for n, p in ref.named_parameters())


class _PropertyParam(torch.nn.Parameter):
    """Like vLLM's parameter classes: ``weight_loader`` is a read-only property."""

    @property
    def weight_loader(self):
        return self._weight_loader


def test_set_loader_handles_property_style_params():
    p = _PropertyParam(torch.zeros(2), requires_grad=False)
    p._weight_loader = "old"
    assert set_loader(p, "new") == "old" and p.weight_loader == "new"
    q = torch.nn.Parameter(torch.zeros(2), requires_grad=False)
    q.weight_loader = "a"
    assert set_loader(q, "b") == "a" and q.weight_loader == "b"


class TruthWorker(DcrWorkerExtension):
    """A stand-in worker over :class:`StandinTruthModel` (a transform, a direct write, a skipped
    tensor, a derived tensor), loaded and post-processed as an engine start would."""

    def __init__(self, rank: int, weights):
        self.rank = rank
        self.model_runner = type("Runner", (), {})()
        self.model_runner.model = model = StandinTruthModel(D, TP, rank)
        model.load_weights(weights.items())
        model.layers[0].self_attn.process_weights_after_loading()

    def _dcr_steps(self) -> dict:
        return {"layers.0.self_attn": self.model_runner.model.layers[0].self_attn.process_weights_after_loading}


def _live_bits(model):
    return {n: p.detach().clone().view(torch.uint8) for n, p in model.named_parameters()}


def test_transformed_derived_and_bypassed_tensors_end_as_a_fresh_load():
    g = torch.Generator().manual_seed(3)
    base = {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in truth_shapes(D).items()}
    target = {n: t.clone() for n, t in base.items()}
    for t in target.values():
        t.view(torch.int16).reshape(-1)[::3] += 1
    workers = [TruthWorker(r, base) for r in range(TP)]
    shapes = {n: list(s) for n, s in truth_shapes(D).items()}
    probed = [w.dcr_probe(shapes) for w in workers]
    assert all(p["refused"] == {} for p in probed) and probed[0]["skipped"] == {
        "model.mtp.0.weight": "the engine's load_weights loads nothing of it"}
    kinds = probed[1]["params"]
    assert kinds["layers.0.mixer.A"]["kind"] == "transformed" and kinds["layers.0.self_attn.W_T"]["kind"] == "derived"
    assert kinds["layers.1.mlp.router_experts.w13"]["kind"] == "in_place"
    ranks = assign_primary([placement_from_json(p["placement"]) for p in probed])
    check_coverage(ranks, shapes, probed[0]["skipped"])
    for w in workers:
        assert w.dcr_attach([placement_to_json(r) for r in ranks], KEY, 0)["shadows"] == ["model.layers.0.mixer.A_log"]
    canonical = {n: t for n, t in base.items() if n not in probed[0]["skipped"]}
    mirror = SenderMirror({n: ("bf16", tuple(t.shape)) for n, t in canonical.items()})
    mirror.reset(canonical, 0)
    fan = Fanout(dict(enumerate(ranks)), mirror)
    resync = fan.resync_payloads(sorted(canonical), 1, KEY)  # the first sync: the shadows learn A_log
    assert all(w.dcr_prepare([resync[r] for r in range(TP)], resync=True)["ok"] for w in workers)
    assert all(w.dcr_commit()["version"] == 1 for w in workers)
    mirror.reset(canonical, 1)
    delta = {n: t for n, t in target.items() if n in canonical}
    parts = fan.encode(diff_tensors(canonical, delta), Identity(base_version=1, target_version=2), "dcr", KEY, 1 << 20)
    held = [_live_bits(w.model_runner.model) for w in workers]
    bad = [parts[0], [b"\0" + p[1:] for p in parts[1]]]
    replies = [w.dcr_prepare(bad) for w in workers]
    assert replies[0]["ok"] and set(replies[0]["refreshed"]) == {"model.layers.0.mixer.A_log", "layers.0.self_attn"}
    assert not replies[1]["ok"] and workers[0].dcr_rollback()["rolled_back"]
    assert all(torch.equal(p, held[0][n]) for n, p in _live_bits(workers[0].model_runner.model).items())
    assert all(w.dcr_prepare([parts[r] for r in range(TP)])["ok"] for w in workers)
    assert all(w.dcr_commit()["version"] == 2 for w in workers)
    for r, w in enumerate(workers):
        fresh = TruthWorker(r, target).model_runner.model  # the engine's own dense load of the target
        want, got = _live_bits(fresh), _live_bits(w.model_runner.model)
        assert all(torch.equal(got[n], want[n]) for n in want), [n for n in want if not torch.equal(got[n], want[n])]
