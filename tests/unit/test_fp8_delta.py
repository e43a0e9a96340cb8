"""FP8 delta: engine bytes + scales after codec encode/decode/apply == independent full re-quantization.

The engine starts from the reference quantization of the old target (nemo_dcr/verify/fp8_reference.py),
the trainer state is the reference's block maxima, and after every applied payload the engine's
tensors are compared by integer views with the reference quantization of the whole new target.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nemo_dcr import codec, quant
from nemo_dcr.checkpoint import load_checkpoint
from nemo_dcr.types import bits_view
from nemo_dcr.verify.fp8_reference import quantize_ref

MODES = ("ulp", "grow", "shrink", "zero_blocks", "signs", "mixed")


def engine_from_reference(w: torch.Tensor, block) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp8 weight, fp32 scale, fp32 amax) built from the reference, not from the code under test."""
    q, s, a = quantize_ref(w.float().numpy(), block)
    return (torch.from_numpy(q.copy()).view(torch.float8_e4m3fn), torch.from_numpy(s.copy()),
            torch.from_numpy(a.copy()))


def bf16(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(torch.bfloat16)


def make_step(rng: np.random.Generator, w0: torch.Tensor, mode: str, block) -> torch.Tensor:
    """A new target from ``w0`` exercising one way blocks can change."""
    w = w0.float().numpy().copy()
    flat, bits = w.reshape(-1), w0.clone().reshape(-1).view(torch.int16).numpy()
    pick = rng.integers(0, flat.size, max(1, flat.size // 50))
    if mode in ("ulp", "mixed"):  # +-1 ulp steps, the common case in RL
        step = bits.copy()
        step[pick] += rng.choice(np.array([-1, 1], np.int16), pick.size)
        stepped = torch.from_numpy(step).view(torch.bfloat16).float().numpy()
        flat[:] = np.where(np.isfinite(stepped), stepped, flat)  # 0x7FFF + 1 and friends are not weights
    if mode in ("grow", "mixed"):  # a few elements jump above their block's amax
        flat[pick[:3]] = np.abs(flat).max() * np.float32(1.5) + np.float32(1e-3)
    if mode in ("shrink", "mixed"):  # the block maxima shrink: the amax must be rescanned
        flat[np.argsort(np.abs(flat))[-5:]] *= np.float32(0.25)
    if mode in ("zero_blocks", "mixed"):
        bm, bn = block
        w[:bm, :bn] = 0.0
        w[-1:, -1:] = np.float32(rng.standard_normal())
    if mode == "signs":
        flat[pick] = -flat[pick]
    return bf16(w)


def apply_fp8_delta(w0: torch.Tensor, w1: torch.Tensor, block, encoding: str = "dcr"):
    """Engine from the reference of ``w0``; FP8 delta to ``w1`` through the codec; returns all parts."""
    scheme = quant.Fp8Scheme("block", block)
    q0, s0, a0 = engine_from_reference(w0, block)
    (d,) = codec.diff_tensors({"x.weight": w0}, {"x.weight": w1})
    fd = quant.fp8_delta(d, w1, a0, scheme)
    engine = {"x.weight": q0.clone(), "x.weight_scale_inv": s0.clone()}
    payload = codec.encode_deltas([fd.weight, fd.scale], {n: bits_view(t) for n, t in engine.items()},
                                  encoding=encoding)
    decoded = codec.decode(payload, engine)
    assert quant.check_fp8_changes("x.weight", engine["x.weight"], engine["x.weight_scale_inv"],
                                   decoded.deltas[0], decoded.deltas[1], scheme) >= 0
    codec.apply(engine, payload)
    return engine, fd, (q0, s0, a0)


def assert_equals_reference(engine, fd, old, w1, block):
    q1, s1, a1 = quantize_ref(w1.float().numpy(), block)
    np.testing.assert_array_equal(bits_view(engine["x.weight"]).reshape(q1.shape), q1)
    np.testing.assert_array_equal(bits_view(engine["x.weight_scale_inv"]), s1.reshape(-1).view(np.uint32))
    np.testing.assert_array_equal(fd.amax.numpy().view(np.uint32), a1.view(np.uint32))
    q0, s0, _ = old
    assert fd.stats.fp8_changed == int((bits_view(q0).reshape(q1.shape) != q1).sum())
    assert fd.stats.blocks_rescaled == int((bits_view(s0) != s1.reshape(-1).view(np.uint32)).sum())


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(m=st.integers(1, 160), n=st.integers(1, 160), bm=st.sampled_from([4, 16, 32, 128]),
       bn=st.sampled_from([4, 8, 64, 128]), mode=st.sampled_from(MODES), seed=st.integers(0, 2**31),
       encoding=st.sampled_from(["dcr", "reference"]))
def test_fp8_delta_is_bit_exact_on_edge_cases(m, n, bm, bn, mode, seed, encoding):
    rng = np.random.default_rng(seed)
    scale = np.float32(10.0 ** rng.uniform(-7, 1))  # includes blocks entirely below the 1e-4 floor
    w0 = bf16(rng.standard_normal((m, n)) * scale)
    w1 = make_step(rng, w0, mode, (bm, bn))
    engine, fd, old = apply_fp8_delta(w0, w1, (bm, bn), encoding)
    assert_equals_reference(engine, fd, old, w1, (bm, bn))
    if mode == "grow":  # an element above the old amax: new scale, block re-quantized whole
        assert fd.stats.blocks_rescaled > 0
    if mode == "shrink":  # a block maximum went down: its amax must be recomputed
        assert fd.stats.blocks_rescanned > 0


def test_small_steps_touch_only_changed_blocks_and_rescan_none():
    """Untouched blocks are never read: poisoning them with NaN changes nothing."""
    rng = np.random.default_rng(3)
    w0 = bf16(rng.standard_normal((512, 384)) * 0.02)
    w1 = w0.clone()
    w1[1:9, 2:5] = (w1[1:9, 2:5].float() * 1.05).to(torch.bfloat16)  # elements below their block's max
    w1[0, 0] = w0[:128, :128].abs().max() * 2  # block (0, 0): a larger amax, known without a rescan
    w1[200, 300] = -w1[200, 300]
    assert w0[1:9, 2:5].abs().max() < w0[:128, :128].abs().max() and w0[200, 300].abs() < w0[128:256, 256:].abs().max()
    _, _, a0 = engine_from_reference(w0, (128, 128))
    (d,) = codec.diff_tensors({"w.weight": w0}, {"w.weight": w1})
    fd = quant.fp8_delta(d, w1, a0)
    poisoned = w1.clone()
    poisoned[256:, :256] = float("nan")  # blocks (2..3, 0..1): no changed element there
    fp = quant.fp8_delta(d, poisoned, a0)
    assert fd.stats.blocks_touched == 2 and fd.stats.blocks == 12
    assert fd.stats.blocks_rescanned == 0
    for a, b in ((fd.weight, fp.weight), (fd.scale, fp.scale)):
        assert np.array_equal(a.positions, b.positions) and np.array_equal(a.new_bits, b.new_bits)


@pytest.mark.parametrize("granularity", ["channel", "tensor"])
def test_channel_and_tensor_granularity_deltas_are_bit_exact(granularity):
    rng = np.random.default_rng(5)
    w0 = bf16(rng.standard_normal((96, 200)) * 0.05)
    scheme = quant.Fp8Scheme(granularity)
    block = scheme.block_for(w0.shape)
    for mode in ("ulp", "grow", "shrink"):
        w1 = make_step(rng, w0, mode, block)
        engine, fd, old = apply_fp8_delta(w0, w1, block)
        assert_equals_reference(engine, fd, old, w1, block)
        w0 = w1


def real_pairs(dirs):
    steps = [load_checkpoint(d) for d in dirs]
    return list(zip(steps, steps[1:]))


def test_real_steps_are_bit_exact_against_full_requantization(real_checkpoints):
    """Two real GRPO steps of the embedded model, chained: every engine tensor equals the reference."""
    first = load_checkpoint(real_checkpoints[0])
    plan = quant.Fp8Plan.build({n: t.shape for n, t in first.items()})
    engine, amax = {n: first[n].clone() for n in plan.kept}, {}
    for n in plan.fp8:
        engine[n], engine[plan.scale_names[n]], amax[n] = engine_from_reference(first[n], (128, 128))
    for base, target in real_pairs(real_checkpoints):
        bf16_deltas = [d for d in codec.diff_tensors(base, target) if d.nnz]
        deltas, amax, stats = plan.deltas(bf16_deltas, target, amax)
        payload = codec.encode_deltas(deltas, {n: bits_view(t) for n, t in engine.items()})
        assert quant.check_fp8_payload(engine, codec.decode(payload, engine).deltas, plan) > 0
        codec.apply(engine, payload)
        for n in plan.kept:
            assert np.array_equal(bits_view(engine[n]), bits_view(target[n])), n
        for n in plan.fp8:
            q, s, a = quantize_ref(target[n].float().numpy(), (128, 128))
            assert np.array_equal(bits_view(engine[n]).reshape(q.shape), q), n
            assert np.array_equal(bits_view(engine[plan.scale_names[n]]), s.reshape(-1).view(np.uint32)), n
            assert np.array_equal(amax[n].numpy().view(np.uint32), a.view(np.uint32)), n
        fp8_changed = sum(s.fp8_changed for s in stats.values())
        bf16_changed = sum(stats[n].bf16_changed for n in stats)
        assert 0 < fp8_changed < bf16_changed  # FP8 drops changes below its resolution


def _one_weight():
    rng = np.random.default_rng(11)
    w0 = bf16(rng.standard_normal((256, 256)) * 0.02)
    w1 = make_step(rng, w0, "ulp", (128, 128))
    (d,) = codec.diff_tensors({"w.weight": w0}, {"w.weight": w1})
    return w0, w1, d, engine_from_reference(w0, (128, 128))[2]


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_target_is_refused_and_state_unchanged(bad):
    w0, w1, d, a0 = _one_weight()
    w1 = w1.clone()
    p = int(d.positions[7])
    w1.view(-1)[p] = bad
    d = codec.diff_tensors({"w.weight": w0}, {"w.weight": w1})[0]
    before = a0.clone()
    with pytest.raises(quant.NonFiniteWeightError, match=rf"w\.weight.*flat index {p}"):
        quant.fp8_delta(d, w1, a0)
    assert torch.equal(a0, before)


def test_inconsistent_inputs_are_refused():
    w0, w1, d, a0 = _one_weight()
    with pytest.raises(quant.Fp8Error, match="do not hold the delta's new bits"):
        quant.fp8_delta(d, w0, a0)
    with pytest.raises(quant.Fp8ShapeError, match="amax state"):
        quant.fp8_delta(d, w1, a0[:1])
    with pytest.raises(quant.Fp8Error, match="old and new bits"):
        quant.fp8_delta(type(d)(d.name, d.dtype, d.shape, d.positions, d.new_bits), w1, a0)
    with pytest.raises(quant.Fp8Error, match="bf16"):
        quant.fp8_delta(d, w1.float(), a0)
    with pytest.raises(quant.Fp8Error, match="not a quantization state"):
        quant.fp8_delta(d, w1, torch.full_like(a0, float("nan")))
    plan = quant.Fp8Plan.build({"w.weight": (256, 256)})
    with pytest.raises(quant.Fp8Error, match="not a tensor of this plan"):
        plan.deltas([type(d)("other.weight", d.dtype, d.shape, d.positions, d.new_bits, d.old_bits)], {}, {})


@pytest.mark.parametrize("mode", ["ulp", "mixed"])
def test_both_paths_of_weight_delta_give_the_same_changes(mode):
    """A delta over REQUANTIZE_FRACTION given the engine's bits is re-quantized whole: the same
    weight and scale changes, block maxima and counts as the delta path (every block rescanned)."""
    rng = np.random.default_rng(5)
    w0 = bf16(rng.standard_normal((256, 384)) * 0.02)
    w1 = w0
    for _ in range(8):  # enough steps for more than REQUANTIZE_FRACTION of the elements
        w1 = make_step(rng, w1, mode, (128, 128))
    (d,) = codec.diff_tensors({"w.weight": w0}, {"w.weight": w1})
    assert d.nnz > quant.REQUANTIZE_FRACTION * d.numel
    plan = quant.Fp8Plan.build({"w.weight": (256, 384)})
    q0, s0, a0 = engine_from_reference(w0, (128, 128))
    engine = {"w.weight": bits_view(q0), "w.weight_scale_inv": bits_view(s0)}
    by_delta = plan.weight_delta(d, w1, a0)
    whole = plan.weight_delta(d, w1, a0, engine)
    assert whole.stats == replace(by_delta.stats, blocks_rescanned=by_delta.stats.blocks)
    assert torch.equal(whole.amax.view(torch.int32), by_delta.amax.view(torch.int32))
    for a, b in ((whole.weight, by_delta.weight), (whole.scale, by_delta.scale)):
        assert (a.name, a.dtype, a.shape) == (b.name, b.dtype, b.shape)
        for x, y in ((a.positions, b.positions), (a.new_bits, b.new_bits), (a.old_bits, b.old_bits)):
            assert np.array_equal(x, y)
