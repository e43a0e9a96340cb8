"""vLLM worker extension on a GPU: probe vLLM's own loaders for SmolLM2, apply a real delta in
place into fused qkv/gate_up params, and match the trainer's layout-independent checksums.
Skipped without CUDA or vllm (neither is available on CPU machines)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs CUDA: the vLLM worker extension runs inside a vLLM GPU worker"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="needs vllm installed (not installable on CPU machines)"),
]

KEY = b"vllm-worker-test-key-0123456789ab"


def test_vllm_worker_applies_real_delta(real_checkpoints):
    import vllm

    from nemo_dcr.apply.placement import assign_primary, placement_from_json, placement_to_json
    from nemo_dcr.checkpoint import load_checkpoint
    from nemo_dcr.codec import Identity, diff_tensors
    from nemo_dcr.refit.fanout import Fanout
    from nemo_dcr.refit.mirror import SenderMirror
    from nemo_dcr.types import bits_view
    from nemo_dcr.verify.checksum import tensor_checksum

    base, target = (load_checkpoint(real_checkpoints[i]) for i in (0, 1))
    llm = vllm.LLM(model=str(real_checkpoints[0]), dtype="bfloat16", enforce_eager=True, gpu_memory_utilization=0.3,
                   worker_extension_cls="nemo_dcr.integrations.vllm.worker.DcrWorkerExtension")
    shapes = {n: list(t.shape) for n, t in base.items()}
    probed = [placement_from_json(p) for p in llm.collective_rpc("dcr_probe", args=(shapes,))]
    ranks = assign_primary(probed)
    assert any(tp.param.endswith("qkv_proj.weight") for tp in ranks[0].values())
    llm.collective_rpc("dcr_attach", args=([placement_to_json(r) for r in ranks], KEY, 0))

    mirror = SenderMirror({n: ("bf16", tuple(t.shape)) for n, t in base.items()})
    mirror.reset(base, 0)
    fanout = Fanout(dict(enumerate(ranks)), mirror)
    deltas = [d for d in diff_tensors(base, target) if d.nnz]
    parts = fanout.encode(deltas, Identity(base_version=0, target_version=1), "dcr", KEY, 1 << 20)
    out = llm.collective_rpc("dcr_apply", args=([parts[r] for r in range(len(ranks))],))
    assert all(o["version"] == 1 for o in out)
    sums = {}
    for o in llm.collective_rpc("dcr_checksums", args=(True,)):
        for n, c in o["checksums"].items():
            sums[n] = (sums.get(n, 0) + c) % (1 << 64)
    assert sums == {n: tensor_checksum(bits_view(t)) for n, t in target.items()}
