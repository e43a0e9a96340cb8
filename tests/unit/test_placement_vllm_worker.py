"""The vLLM worker extension's code path without vLLM, mixed into a stand-in worker whose model is
the loader-contract stand-in (``tests.standins.vllm_standin``, not vLLM): probe, attach,
prepare and commit a routed delta per TP rank, roll back when one rank refuses, and sum canonical
checksums to the trainer's totals.  The real engine is tested in ``tests/vllm``."""

from __future__ import annotations

import torch

from nemo_dcr.apply.placement import assign_primary, placement_from_json, placement_to_json
from nemo_dcr.codec import Identity, diff_tensors
from nemo_dcr.integrations.vllm.worker import DcrWorkerExtension, set_loader
from nemo_dcr.refit.fanout import Fanout
from nemo_dcr.refit.mirror import SenderMirror
from nemo_dcr.types import bits_view
from nemo_dcr.verify.checksum import tensor_checksum
from tests.standins.vllm_standin import StandinDims, StandinModel, canonical_shapes

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
