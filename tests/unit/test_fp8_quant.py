"""The FP8 quantizer against an independent reference (nemo_dcr/verify/fp8_reference.py), bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nemo_dcr import quant
from nemo_dcr.types import bits_view
from nemo_dcr.verify.fp8_reference import e4m3_bits, quantize_ref

SCHEMES = [quant.Fp8Scheme("block", (128, 128)), quant.Fp8Scheme("block", (16, 8)),
           quant.Fp8Scheme("channel"), quant.Fp8Scheme("tensor")]


def bf16_matrix(rng: np.random.Generator, m: int, n: int, kind: str) -> torch.Tensor:
    """Weights with the structures that matter: gaussian, zero rows/cols, tiny values, -0.0, outliers."""
    w = rng.standard_normal((m, n)).astype(np.float32) * np.float32(10.0 ** rng.uniform(-6, 0))
    if kind == "zeros":
        w[: m // 2] = 0.0
        w[:, : n // 3] = -0.0
    elif kind == "tiny":
        w *= np.float32(1e-6)
    elif kind == "outliers":
        w.reshape(-1)[rng.integers(0, w.size, 3)] = np.float32(300.0)
    return torch.from_numpy(w).to(torch.bfloat16)


def assert_matches_reference(w: torch.Tensor, scheme: quant.Fp8Scheme) -> None:
    qw = quant.quantize(w, scheme)
    q_ref, s_ref, a_ref = quantize_ref(w.float().numpy(), scheme.block_for(w.shape))
    np.testing.assert_array_equal(bits_view(qw.weight).reshape(w.shape), q_ref)
    np.testing.assert_array_equal(bits_view(qw.scale).reshape(s_ref.shape), s_ref.view(np.uint32))
    np.testing.assert_array_equal(qw.amax.numpy().view(np.uint32), a_ref.view(np.uint32))


def test_reference_cast_agrees_with_its_definition_on_every_code():
    """The reference's rounding sends every e4m3 value to its own code and midpoints to the even one."""
    codes = np.arange(0x7F, dtype=np.uint8)
    values = torch.from_numpy(codes).view(torch.float8_e4m3fn).float().numpy()
    np.testing.assert_array_equal(e4m3_bits(values), codes)
    np.testing.assert_array_equal(e4m3_bits(-values[1:]), codes[1:] | 0x80)
    mid = ((values[1:-1] + values[2:]) / 2).astype(np.float32)  # exact in fp32
    want = np.where(codes[1:-1] % 2 == 0, codes[1:-1], codes[2:])
    np.testing.assert_array_equal(e4m3_bits(mid), want)


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: f"{s.granularity}{s.block}")
@pytest.mark.parametrize("shape", [(256, 384), (300, 200), (1, 1), (129, 127)])
def test_quantize_matches_reference(scheme, shape):
    rng = np.random.default_rng(sum(shape))
    for kind in ("gauss", "zeros", "tiny", "outliers"):
        assert_matches_reference(bf16_matrix(rng, *shape, kind), scheme)


@settings(max_examples=60, deadline=None)
@given(m=st.integers(1, 150), n=st.integers(1, 150), bm=st.integers(1, 64), bn=st.integers(1, 64),
       kind=st.sampled_from(["gauss", "zeros", "tiny", "outliers"]), seed=st.integers(0, 2**31))
def test_quantize_matches_reference_any_shape(m, n, bm, bn, kind, seed):
    assert_matches_reference(bf16_matrix(np.random.default_rng(seed), m, n, kind), quant.Fp8Scheme("block", (bm, bn)))


def test_scale_grid_is_ceil_div_and_names_follow_vllm():
    s = quant.Fp8Scheme()
    assert s.grid((576, 1536)) == (5, 12) and s.grid((128, 128)) == (1, 1)
    assert quant.Fp8Scheme("channel").grid((192, 576)) == (192, 1)
    assert quant.Fp8Scheme("tensor").grid((192, 576)) == (1, 1)
    assert quant.scale_tensor_name("m.layers.0.mlp.up_proj.weight") == "m.layers.0.mlp.up_proj.weight_scale_inv"
    assert quant.scale_tensor_name("a.weight", quant.Fp8Scheme("tensor")) == "a.weight_scale"


def test_zero_block_gets_the_floor_scale_and_zero_bytes():
    w = torch.zeros(128, 256, dtype=torch.bfloat16)
    w[0, 200] = 1.0
    qw = quant.quantize(w)
    assert float(qw.scale[0, 0]) == float(np.float32(np.float32(1e-4) / np.float32(448)))
    assert not bits_view(qw.weight[:, :128].contiguous()).any()
    assert int(bits_view(qw.weight.contiguous())[200]) == 0x7E  # the block max quantizes to 448


def test_dequantize_is_q_times_scale_per_block():
    w = bf16_matrix(np.random.default_rng(1), 200, 300, "gauss")
    qw = quant.quantize(w)
    deq = quant.dequantize(qw.weight, qw.scale, dtype=torch.float32)
    s = qw.scale.numpy()
    want = torch.from_numpy(qw.weight.float().numpy() * np.repeat(np.repeat(s, 128, 0), 128, 1)[:200, :300])
    assert torch.equal(deq, want)
    rel = ((deq - w.float()).abs() / w.float().abs().clamp(min=1e-3)).median()
    assert rel < 0.07  # 3 mantissa bits


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_weight_is_refused(bad):
    w = torch.ones(64, 64, dtype=torch.bfloat16)
    w[3, 5] = bad
    with pytest.raises(quant.NonFiniteWeightError, match=r"up\.weight.*flat index 197"):
        quant.quantize(w, name="up.weight")


@pytest.mark.parametrize("shape", [(10,), (2, 3, 4), (0, 5)])
def test_non_matrix_is_refused(shape):
    with pytest.raises(quant.Fp8ShapeError, match="2-D"):
        quant.quantize(torch.zeros(shape, dtype=torch.bfloat16))


def test_scale_shape_mismatch_is_refused():
    qw = quant.quantize(torch.ones(300, 200, dtype=torch.bfloat16))
    with pytest.raises(quant.Fp8ShapeError, match=r"scale shape \[2, 2\].*grid \[3, 2\]"):
        quant.dequantize(qw.weight, qw.scale[:2])


def test_bad_scheme_is_refused():
    with pytest.raises(quant.Fp8Error, match="granularity"):
        quant.Fp8Scheme("row")
    with pytest.raises(quant.Fp8Error, match="block"):
        quant.Fp8Scheme("block", (0, 128))


def test_default_rule_keeps_embeddings_norms_router_and_lm_head():
    rule = quant.Fp8Rule()
    fp8 = ["model.layers.0.self_attn.q_proj.weight", "model.layers.3.mlp.gate_proj.weight",
           "model.layers.3.mlp.experts.7.down_proj.weight"]
    kept = [("model.embed_tokens.weight", 2), ("lm_head.weight", 2), ("model.norm.weight", 1),
            ("model.layers.0.input_layernorm.weight", 1), ("model.layers.3.mlp.gate.weight", 2),
            ("model.layers.0.self_attn.q_proj.bias", 1)]
    assert all(rule.is_fp8(n, (8, 8)) for n in fp8)
    assert not any(rule.is_fp8(n, (8,) * nd) for n, nd in kept)
    custom = quant.Fp8Rule(keep=quant.DEFAULT_KEEP + ("*.o_proj.weight",))
    assert not custom.is_fp8("model.layers.0.self_attn.o_proj.weight", (8, 8))
