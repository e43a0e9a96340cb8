"""SmolLM2-135M in a real vLLM engine on CPU (TP=1), refit in place along real RL steps
(``step_0 -> step_1 -> step_2`` bf16 checkpoints): placement from vLLM's loaders (fused
``qkv_proj`` / ``gate_up_proj``, the tied ``lm_head`` sharing the embedding), checksums equal to
the trainer's, and every param and greedy generation identical to a fresh engine on ``step_2``."""

from __future__ import annotations

import pytest
from vllm_models import ENGINE_ARGS, KEY, PROMPTS, Trainer, checkpoint_tensors

from nemo_dcr.types import bits_view
from nemo_dcr.verify.checksum import tensor_checksum

pytestmark = pytest.mark.vllm

SMOLLM2 = dict(ENGINE_ARGS, hf_overrides={"architectures": ["LlamaForCausalLM"]}, max_model_len=512)
"""The step checkpoints' config.json (written from the GGUF config) names no architecture."""


def test_smollm2_real_steps_match_fresh_engine(real_checkpoints):
    from nemo_dcr.integrations.vllm.engine import VllmEngine
    from nemo_dcr.integrations.vllm.verify import engine_state, state_differences

    steps = [checkpoint_tensors(p) for p in real_checkpoints]
    with VllmEngine.start(str(real_checkpoints[0]), key=KEY, **SMOLLM2) as eng:
        placement = eng.placement()[0]
        k_proj = placement["model.layers.3.self_attn.k_proj.weight"]
        assert k_proj["param"] == "model.layers.3.self_attn.qkv_proj.weight" and k_proj["param_shape"] == [960, 576]
        assert placement["model.layers.3.mlp.up_proj.weight"]["param"] == "model.layers.3.mlp.gate_up_proj.weight"
        assert eng.probed[0]["aliases"] == {"lm_head.weight": "model.embed_tokens.weight"}
        with Trainer(eng, steps[0]) as trainer:
            assert trainer.first.committed and not trainer.first.resynced  # loaded from step_0: nothing sent
            for v in (1, 2):
                r = trainer.step_to(steps[v])
                assert r.committed and r.mode == "delta" and not r.resynced and r.verified, r.detected
                assert r.version == v == eng.version and r.changed > 0
                assert eng.checksums().canonical == {n: tensor_checksum(bits_view(t)) for n, t in steps[v].items()}
        assert eng.checksums(full=True) == eng.checksums()
        assert eng.compare(real_checkpoints[2]) == {0: []}
        refit, generated = engine_state(eng.llm), eng.generate(PROMPTS)
    with VllmEngine.start(str(real_checkpoints[2]), key=KEY, **SMOLLM2) as fresh:
        assert state_differences(refit, engine_state(fresh.llm)) == []
        assert generated == (fresh.generate(PROMPTS)[0], 2)
