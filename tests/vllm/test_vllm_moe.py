"""A real vLLM MoE engine (tiny random Qwen3-MoE, 4 experts) on CPU: vLLM prepacks the expert
weights after loading (``process_weights_after_loading``), so the refit writes the loader-layout
copies and repacks the touched experts; the checks read back what the kernel reads and compare
every param with a fresh engine, so a post-load rearrangement cannot go unnoticed; a dense
``load_weights`` of the same engine goes through the loader layout and repacks too."""

from __future__ import annotations

import pytest
import torch
from vllm_models import ENGINE_ARGS, KEY, PROMPTS, Trainer, checkpoint_tensors, perturbed, write_like

from nemo_dcr.types import bits_view
from nemo_dcr.verify.checksum import tensor_checksum

pytestmark = pytest.mark.vllm


def _live_vs_unpacked(worker) -> dict[str, bool]:
    """Per prepacked param: whether the live (kernel) layout differs from the loader layout."""
    from nemo_dcr.integrations.vllm.cpu import PackedExperts

    found = PackedExperts.find(worker.model_runner.model)
    return {n: not torch.equal(layer.live[n].view(torch.int16), layer.unpacked[n].view(torch.int16))
            for n, layer in found.items()}


def _naive_mismatches(worker, path: str) -> list[str]:
    """Canonical tensors whose elements are *not* at the probed positions of the live params: what
    an apply that ignored the post-load packing would have read and overwritten."""
    from nemo_dcr.apply.shard_view import ShardView
    from nemo_dcr.checkpoint import load_checkpoint
    from nemo_dcr.types import int_view

    live = dict(worker.model_runner.model.named_parameters())
    ref = load_checkpoint(path)
    out = []
    for name, tp in worker.dcr_engine.placed.items():
        got = int_view(ShardView(live[tp.param].data, tp.runs).gather())
        want = int_view(ref[name]).reshape(-1)[torch.from_numpy(tp.runs.expand()[0])]
        if not torch.equal(got, want):
            out.append(name)
    return sorted(out)


def test_moe_refit_repacks_experts_and_matches_fresh_engine(tiny_moe, tmp_path):
    from nemo_dcr.integrations.vllm.engine import VllmEngine
    from nemo_dcr.integrations.vllm.verify import engine_state, state_differences

    base = checkpoint_tensors(tiny_moe)
    target = perturbed(base)
    target_dir = write_like(tiny_moe, target, tmp_path / "target")
    experts = sorted(n for n in base if ".mlp.experts." in n)
    with VllmEngine.start(str(tiny_moe), key=KEY, **ENGINE_ARGS) as eng:
        packed = eng.probed[0]["packed"]
        assert len(packed) == 4 and all(p.endswith(("w13_weight", "w2_weight")) for p in packed)
        assert all(eng.llm.collective_rpc(_live_vs_unpacked)[0].values())  # vLLM did rearrange them
        assert eng.llm.collective_rpc(_naive_mismatches, args=(str(tiny_moe),))[0] == experts
        assert eng.compare(tiny_moe) == {0: []}  # the loader-layout copies are the checkpoint
        tokens_before = eng.generate(PROMPTS)[0]

        with Trainer(eng, base) as trainer:
            assert not trainer.first.resynced
            r = trainer.step_to(target)
            assert r.committed and not r.resynced and r.verified, r.detected
        changed = {n: int((bits_view(base[n]) != bits_view(target[n])).sum()) for n in experts}
        assert r.by_layer_type["experts"]["changed"] == sum(changed.values()) and all(changed.values())
        assert eng.checksums().canonical == {n: tensor_checksum(bits_view(t)) for n, t in target.items()}
        assert eng.checksums(full=True) == eng.checksums()
        assert eng.compare(target_dir) == {0: []}
        refit, generated = engine_state(eng.llm), eng.generate(PROMPTS)
        eng.load_weights(str(tiny_moe), 2)  # dense back to the base: loader layout, then repacked
        dense = engine_state(eng.llm)
    with VllmEngine.start(str(target_dir), key=KEY, **ENGINE_ARGS) as fresh:
        assert state_differences(refit, engine_state(fresh.llm)) == []  # packed experts included
        assert generated == (fresh.generate(PROMPTS)[0], 1)
    with VllmEngine.start(str(tiny_moe), key=KEY, **ENGINE_ARGS) as fresh:
        assert state_differences(dense, engine_state(fresh.llm)) == []
    assert tokens_before != generated[0]
