"""The demo's dense comparison of an FP8 transformers engine (nemo_dcr/tools/demo/hf_engine.py): the
engine's FP8 bytes and scales against an independent re-quantization of a dense BF16 export.
It must accept the engine that quantized that export and see one wrong byte or scale."""

from __future__ import annotations

import pytest
import torch

from nemo_dcr.config.schema import DcrConfig
from nemo_dcr.refit.fp8_mirror import fp8_plan
from nemo_dcr.types import int_view

transformers = pytest.importorskip("transformers")


def _engine_and_export():
    from nemo_dcr.integrations.hf.engine import HFEngine

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(
        hidden_size=160, intermediate_size=200, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=64, tie_word_embeddings=True))
    dense = {n: p.detach().to(torch.bfloat16).clone() for n, p in model.named_parameters()}
    cfg = DcrConfig(transport="inprocess", engine_format="fp8")  # 128x128 blocks: 160 and 200 leave ragged edges
    plan = fp8_plan(cfg, {n: tuple(t.shape) for n, t in dense.items()})
    return HFEngine(model, torch.bfloat16, fp8_plan=plan), dense, plan


def test_the_engine_that_quantized_the_export_equals_it():
    from nemo_dcr.tools.demo.hf_engine import load_and_compare

    engine, dense, plan = _engine_and_export()
    assert len(plan.fp8) == 7 and all(engine.tensors[n].dtype == torch.float8_e4m3fn for n in plan.fp8)
    load_s, compare_s, same = load_and_compare(engine, dense)
    assert same and load_s >= 0 and compare_s >= 0


@pytest.mark.parametrize("which", ["fp8_byte", "scale", "kept_bf16"])
def test_one_wrong_bit_is_seen(which):
    from nemo_dcr.tools.demo.hf_engine import load_and_compare

    engine, dense, plan = _engine_and_export()
    weight = next(iter(plan.fp8))
    name = {"fp8_byte": weight, "scale": plan.scale_names[weight], "kept_bf16": "model.norm.weight"}[which]
    view = int_view(engine.tensors[name]).reshape(-1)
    view[3] ^= 1
    assert load_and_compare(engine, dense)[2] is False
    view[3] ^= 1
    assert load_and_compare(engine, dense)[2] is True
