"""The demo's dense refit check (nemo_dcr/tools/demo/dense_refit.py, hf_engine.py): a BF16 engine's digests
before and after its own dense load, an FP8 engine's bytes and scales against an independent
re-quantization of the dense BF16 tensors.  It must accept an engine that equals them and see one
wrong byte, scale or kept bit."""

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
    from nemo_dcr.tools.demo.dense_refit import load_dense
    from nemo_dcr.tools.demo.hf_engine import fp8_same

    engine, dense, plan = _engine_and_export()
    assert len(plan.fp8) == 7 and all(engine.tensors[n].dtype == torch.float8_e4m3fn for n in plan.fp8)
    assert fp8_same(engine, dense)
    load_s, check_s, same = load_dense(engine, dense, version=1, fp8=True)  # its own dense load
    assert same and load_s >= 0 and check_s >= 0 and engine.version == 1 and fp8_same(engine, dense)


def test_bf16_dense_load_is_compared_by_digests():
    from nemo_dcr.integrations.hf.engine import HFEngine
    from nemo_dcr.tools.demo.dense_refit import load_dense

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=64, tie_word_embeddings=True))
    engine = HFEngine(model, torch.bfloat16)
    dense = {n: t.clone() for n, t in engine.tensors.items()}
    assert load_dense(engine, dense, 1, fp8=False)[2] is True
    int_view(dense["model.norm.weight"]).reshape(-1)[5] ^= 1  # the engine no longer holds what its load gives
    assert load_dense(engine, dense, 2, fp8=False)[2] is False
    assert torch.equal(int_view(engine.tensors["model.norm.weight"]), int_view(dense["model.norm.weight"]))


@pytest.mark.parametrize("which", ["fp8_byte", "scale", "kept_bf16"])
def test_one_wrong_bit_is_seen(which):
    from nemo_dcr.tools.demo.hf_engine import fp8_same

    engine, dense, plan = _engine_and_export()
    weight = next(iter(plan.fp8))
    name = {"fp8_byte": weight, "scale": plan.scale_names[weight], "kept_bf16": "model.norm.weight"}[which]
    view = int_view(engine.tensors[name]).reshape(-1)
    view[3] ^= 1
    assert fp8_same(engine, dense) is False
    view[3] ^= 1
    assert fp8_same(engine, dense) is True
