"""Engine truth on real vLLM engines (CPU) for the model families RL recipes use: ``nemo-dcr
check-engine`` on a tiny random config of each (Llama, Qwen2, Qwen3-MoE, Mixtral, Phi-3, Gemma-2,
DeepSeek-V3, NemotronH, gpt-oss) refits a live engine along a sparse bf16 step and must end
bit-identical to a fresh engine's own dense load (every param, buffer and tensor attribute),
with the first sync's preflight clean and greedy tokens equal; a quantized engine is refused up
front, naming its layers; a preflight sees a loader-written element the refit did not keep."""

from __future__ import annotations

import json

import pytest
from vllm_models import ENGINE_ARGS, KEY, quantized_w8a8, save_tiny, tiny_config

pytestmark = pytest.mark.vllm

RELOADED = {"nemotron_h": ["backbone.layers.0.mixer.A_log"],  # A = -exp(A_log), in fp32
            "deepseek_v3": ["model.layers.1.mlp.gate.e_score_correction_bias"]}  # kept in fp32
"""Canonical tensors each family loads through a transform (refit: reloaded through the loader)."""

PACKED = {"qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"}
"""Families whose experts the CPU MoE kernel prepacks (refit: loader layout, touched experts repacked)."""


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3_moe", "mixtral", "phi3", "gemma2", "deepseek_v3",
                                    "nemotron_h", "gpt_oss"])
def test_check_engine_is_bit_exact_for_each_family(family, tmp_path, capsys):
    from nemo_dcr.tools.cli import main

    config = tiny_config(family, tmp_path / family)
    code = main(["check-engine", "--engine", "vllm", "--config", str(config), "--steps", "1", "--json"])
    out = capsys.readouterr().out
    result = json.loads(out[out.index("{\n"):])
    assert code == 0 and result["exact"], result
    assert result["refused"] == {} and result["preflight"] == [] and result["differences"] == []
    assert result["tokens_equal"] and [r["mode"] for r in result["refits"]] == ["attach", "delta"]
    assert result["refits"][1]["changed"] > 0 and not result["refits"][1]["resynced"]
    assert result["reloaded"] == RELOADED.get(family, [])
    assert bool(result["rearranged"]) == (family in PACKED)
    assert result["probe"]["load_calls"] > 0 and result["probe"]["peak_bytes"] > 0


def test_quantized_engine_is_refused_naming_its_layers(tmp_path):
    from nemo_dcr.integrations.vllm.check import EXIT_REFUSED, check_engine

    base = quantized_w8a8(save_tiny("llama", tmp_path / "bf16"), tmp_path / "w8a8")
    check = check_engine(base, [], **ENGINE_ARGS)
    assert check.exit_code == EXIT_REFUSED and not check.refits
    assert "quantized by CompressedTensorsLinearMethod" in check.refused["model.layers.0.mlp.down_proj.weight_scale"]
    assert check.lines()[0] == "refused before the first sync:"


def _touch_padding(worker) -> None:
    """Write a value into a vocab padding row, which the loader fills with zeros."""
    weight = dict(worker.model_runner.model.named_parameters())["model.embed_tokens.weight"]
    weight.data[-1, 0] = 1.0


def test_preflight_sees_what_the_engine_own_load_would_rewrite(tiny_llama):
    from nemo_dcr.integrations.vllm.engine import VllmEngine

    with VllmEngine.start(str(tiny_llama), key=KEY, **ENGINE_ARGS) as eng:
        assert eng.preflight() == []
        eng.llm.collective_rpc(_touch_padding)
        assert eng.preflight() == ["rank 0: param:model.embed_tokens.weight: differs from the engine own load"]
        assert eng.preflight() == []  # the reload wrote the padding back
