"""vLLM worker extension on a GPU: probe vLLM's own loaders for SmolLM2, apply a real delta in
place into fused qkv/gate_up params, and match the trainer's layout-independent checksums.
Skipped without CUDA or vllm (neither is available on CPU machines)."""

from __future__ import annotations

import pytest
import torch

from nemo_dcr.integrations.vllm import vllm_installed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs CUDA: the vLLM worker extension runs inside a vLLM GPU worker"),
    pytest.mark.skipif(not vllm_installed(), reason="needs a CUDA build of vllm installed"),
]

KEY = b"vllm-worker-test-key-0123456789ab"


def test_vllm_worker_applies_real_delta(real_checkpoints):
    import vllm

    from nemo_dcr.apply import apply_version
    from nemo_dcr.checkpoint import load_checkpoint
    from nemo_dcr.codec import Identity, diff_tensors
    from nemo_dcr.integrations.vllm import WORKER_EXTENSION
    from nemo_dcr.integrations.vllm.engine import VllmEngine
    from nemo_dcr.refit.fanout import Fanout
    from nemo_dcr.refit.mirror import SenderMirror
    from nemo_dcr.types import bits_view
    from nemo_dcr.verify.checksum import tensor_checksum

    base, target = (load_checkpoint(real_checkpoints[i]) for i in (0, 1))
    llm = vllm.LLM(model=str(real_checkpoints[0]), dtype="bfloat16", enforce_eager=True, gpu_memory_utilization=0.3,
                   hf_overrides={"architectures": ["LlamaForCausalLM"]}, worker_extension_cls=WORKER_EXTENSION)
    engine = VllmEngine(llm, {n: list(t.shape) for n, t in base.items()}, KEY, 0)
    assert engine.probed[0]["packed"] == []  # no CPU prepacking on CUDA
    assert any(p["param"].endswith("qkv_proj.weight") for p in engine.placement()[0].values())

    mirror = SenderMirror({n: ("bf16", tuple(t.shape)) for n, t in base.items()})
    mirror.reset(base, 0)
    fanout = Fanout(engine.routes(), mirror)
    deltas = [d for d in diff_tensors(base, target) if d.nnz]
    parts = fanout.encode(deltas, Identity(base_version=0, target_version=1), "dcr", KEY, 1 << 20)
    assert apply_version(engine, parts).target_version == 1
    assert engine.checksums(full=True).canonical == {n: tensor_checksum(bits_view(t)) for n, t in target.items()}
    assert engine.compare(real_checkpoints[1]) == {0: []}
