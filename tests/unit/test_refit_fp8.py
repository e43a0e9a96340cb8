"""The refit path to an FP8 engine (``dcr.engine_format: fp8``) in one process: DeltaRefit with its
FP8 mirror -> codec -> the engine's transaction with the FP8 checks, with faults and resyncs.

The trainer is the row-shard stand-in (tests/standins/shard_trainer.py) at world 1, so its bf16
params are the canonical targets.  After every refit the engine's FP8 bytes and scales are compared
with an independent re-quantization of those targets (nemo_dcr/verify/fp8_reference.py, not the
code under test), and its kept BF16 tensors with the targets themselves, bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nemo_dcr import codec, quant
from nemo_dcr.apply import InjectedFault, TensorEngine, apply_version
from nemo_dcr.config.schema import DcrConfig
from nemo_dcr.kernels.traffic import host_bits
from nemo_dcr.refit import DeltaRefit, colocated_wiring
from nemo_dcr.refit.fp8_mirror import fp8_plan
from nemo_dcr.transport import Envelope
from nemo_dcr.types import SparseDelta, int_view
from nemo_dcr.verify.fp8_reference import fp8_mismatches, quantize_ref
from tests.standins.shard_trainer import ShardTrainer

KEY = b"f" * 32
BLOCK = (32, 32)
SHAPES = {"model.layers.0.self_attn.q_proj.weight": (96, 80), "model.layers.0.mlp.down_proj.weight": (64, 150),
          "model.embed_tokens.weight": (40, 32), "model.norm.weight": (32,)}
FP8 = ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight")


def _cfg(**kw) -> DcrConfig:
    return DcrConfig(transport="inprocess", reply_timeout_s=120, engine_format="fp8", fp8_block=list(BLOCK), **kw)


PLAN = fp8_plan(_cfg(), SHAPES)


def _engine(trainer: ShardTrainer | None = None) -> TensorEngine:
    """An FP8 engine holding zeros (zero scales), or the quantization of the trainer's weights."""
    if trainer is None:
        tensors = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in SHAPES.items()}
        held, _ = PLAN.quantize_model(tensors)
        held = {n: torch.zeros_like(t) for n, t in held.items()}
    else:
        held, _ = PLAN.quantize_model({n: p.clone() for n, p in trainer.params.items()})
    engine = TensorEngine(held, key=KEY)
    engine.check = quant.Fp8TransactionCheck(PLAN)
    return engine


def _refit(trainer, engine, **cfg) -> DeltaRefit:
    c = _cfg(**cfg)
    return DeltaRefit(c, trainer, colocated_wiring(c, 0, KEY), engine, key=KEY)


def _bits(tensors) -> dict[str, np.ndarray]:
    return {n: host_bits(t).reshape(tuple(t.shape)).copy() for n, t in tensors.items()}


def _mismatches(trainer: ShardTrainer, engine, fp8_names=FP8) -> list[str]:
    fp8 = {n: (BLOCK, n[: -len("weight")] + "weight_scale_inv") for n in fp8_names}
    return fp8_mismatches(_bits(engine.tensors), _bits(trainer.params), fp8)


@pytest.fixture
def rig():
    trainer = ShardTrainer(SHAPES, 0, 1, lr=2e-4)
    engine = _engine()
    refit = _refit(trainer, engine, verify="incremental", verify_steps=3)
    yield trainer, engine, refit
    refit.close(5)


def test_plan_names_the_engine_tensors():
    assert sorted(PLAN.fp8) == sorted(FP8)
    assert sorted(PLAN.engine_names()) == sorted([*SHAPES, *(n + "_scale_inv" for n in FP8)])


@pytest.mark.parametrize("lr", [2e-6, 1e-2])  # sparse FP8 deltas; whole re-quantization with scale changes
def test_every_refit_is_bit_exact_against_independent_requantization(lr):
    trainer = ShardTrainer(SHAPES, 0, 1, lr=lr)
    engine = _engine()
    refit = _refit(trainer, engine, verify="incremental", verify_steps=2, telemetry_encodings=["reference"])  # bf16 bytes measured
    try:
        r = refit.attach()
        assert r.mode == "attach" and r.committed and r.resynced and _mismatches(trainer, engine) == []
        scale_changes = 0
        for step in range(1, 5):
            before = _bits(engine.tensors)
            trainer.step()
            r = refit.step()
            assert r.mode == "delta" and r.committed and not r.resynced and r.verified, r.detected
            assert _mismatches(trainer, engine) == []
            after = _bits(engine.tensors)
            f = r.engine_format
            # counts of the report against what changed in the engine (counted here independently)
            assert f["fp8_changed"] == sum(int((before[n] != after[n]).sum()) for n in FP8)
            assert f["scale_changes"] == sum(int((before[n + "_scale_inv"] != after[n + "_scale_inv"]).sum())
                                             for n in FP8)
            assert f["fp8_elements"] == sum(int(np.prod(SHAPES[n])) for n in FP8)
            assert f["fp8_dense_bytes"] == f["fp8_elements"] + 4 * sum(before[n + "_scale_inv"].size for n in FP8)
            assert f["bf16_delta_bytes"] > 0 and 0 < r.fp8_density <= 1
            # the FP8 weights' part alone, each side encoded on its own (kept tensors changed too)
            assert 0 < f["bf16_weights_delta_bytes"] < f["bf16_delta_bytes"]
            assert 0 < f["fp8_weights_delta_bytes"] < r.payload_bytes
            assert r.dense_bytes == sum(t.numel() * t.element_size() for t in engine.tensors.values())
            scale_changes += f["scale_changes"]
            # small steps take the FP8 delta (no block rescanned), large ones re-quantize whole weights
            assert (f["blocks_rescanned"] == f["fp8_blocks"]) == (lr > 1e-3)
        assert (scale_changes > 0) == (lr > 1e-3)
    finally:
        refit.close(5)


def test_sparse_changes_that_move_block_maxima_rescale_whole_blocks():
    trainer = ShardTrainer(SHAPES, 0, 1, lr=2e-6)
    engine = _engine()
    refit = _refit(trainer, engine)
    try:
        refit.attach()
        name = FP8[1]
        w = trainer.params[name]
        before = _bits(engine.tensors)
        blk = w[:32, :32].float().abs()
        r0, c0 = divmod(int(blk.argmax()), 32)
        w[r0, c0] = w[r0, c0] * 1.5  # block (0, 0) grows
        blk = w[32:64, 32:64].float().abs()
        r1, c1 = divmod(int(blk.argmax()), 32)
        w[32 + r1, 32 + c1] = w[32 + r1, 32 + c1] * 0.25  # block (1, 1) shrinks: its amax is rescanned
        w[:32, 128:] = 0  # the ragged edge block (0, 4) becomes zero (7% of the weight: still a delta)
        r = refit.step()
        assert r.committed and not r.resynced and _mismatches(trainer, engine) == []
        after = _bits(engine.tensors)
        scales = int((before[name + "_scale_inv"] != after[name + "_scale_inv"]).sum())
        f = r.engine_format
        assert scales == f["scale_changes"] >= 3 and 1 <= f["blocks_rescanned"] < f["fp8_blocks"]
    finally:
        refit.close(5)


def test_an_engine_holding_the_quantized_weights_gets_nothing_at_attach():
    trainer = ShardTrainer(SHAPES, 0, 1, lr=2e-4)
    engine = _engine(trainer)
    refit = _refit(trainer, engine)
    try:
        r = refit.attach()
        assert r.committed and not r.resynced and r.payload_bytes == 0 and r.verified
        trainer.step()
        assert refit.step().committed and _mismatches(trainer, engine) == []
    finally:
        refit.close(5)


def _rewrite(engine: TensorEngine, change):
    """A tamper that decodes each part against the engine, lets ``change`` alter the decoded FP8
    changes, and re-encodes them validly (MAC and checksums agree): only the FP8 rules can refuse."""
    def tamper(envs):
        out = []
        for e in envs:
            dec = codec.decode(e.body, engine.tensors, KEY)
            h = dec.header
            deltas = change({d.name: d for d in dec.deltas}, engine)
            base = {n: host_bits(t) for n, t in engine.tensors.items()}
            body = codec.encode_deltas(list(deltas.values()), base,
                                       codec.Identity(h.model, h.run, h.base_version, h.target_version), key=KEY)
            out.append(Envelope(e.kind, e.version, e.sender, e.part, e.last, body))
        return out
    return tamper


def _set_scale(value: float):
    """The changed scales of the first weight (or block 0's) become ``value``."""
    def change(deltas, engine):
        name = FP8[0] + "_scale_inv"
        held = host_bits(engine.tensors[name])
        d = deltas.get(name)
        pos = d.positions if d is not None and d.nnz else np.array([0], np.int64)
        new = np.full(pos.size, value, np.float32).view(np.uint32)
        deltas[name] = SparseDelta(name, "fp32", tuple(engine.tensors[name].shape), pos, new, held[pos].copy())
        return deltas
    return change


def _lower_block_max(deltas, engine):
    """Every byte at +-448 in block (0, 0) of the first weight moves one code down (scale kept)."""
    name, (m, n) = FP8[0], SHAPES[FP8[0]]
    held = host_bits(engine.tensors[name])
    rows, cols = np.nonzero((held.reshape(m, n)[: BLOCK[0], : BLOCK[1]] & 0x7F) == 0x7E)
    top = (rows * n + cols).astype(np.int64)
    d = deltas.get(name) or SparseDelta(name, "fp8_e4m3", (m, n), np.zeros(0, np.int64), np.zeros(0, np.uint8),
                                        np.zeros(0, np.uint8))
    keep = ~np.isin(d.positions, top)
    pos = np.concatenate([d.positions[keep], top])
    order = np.argsort(pos)
    new = np.concatenate([d.new_bits[keep], held[top] - 1])[order]
    old = np.concatenate([d.old_bits[keep], held[top]])[order]
    deltas[name] = SparseDelta(name, d.dtype, d.shape, pos[order], new, old)
    return deltas


@pytest.mark.parametrize("change", [_set_scale(float("nan")), _set_scale(0.0), _set_scale(-1.0),
                                    _set_scale(float("inf")), _lower_block_max],
                         ids=["nan-scale", "zero-scale", "negative-scale", "inf-scale", "bytes-disagree"])
def test_bad_fp8_payloads_are_refused_by_the_transaction_and_repaired(rig, change):
    trainer, engine, refit = rig
    refit.attach()
    trainer.step()
    version = engine.version
    r = refit.step(tamper=_rewrite(engine, change))
    assert any("Fp8PayloadError" in d for d in r.detected), r.detected
    assert r.resynced and r.committed and _mismatches(trainer, engine) == []
    refused = [e for e in refit.server.stats.events if e[1] == "refused"]
    assert len(refused) == 1 and refused[0][0] == version + 1  # the tampered version was refused
    trainer.step()
    r = refit.step()
    assert r.mode == "delta" and r.committed and not r.resynced and _mismatches(trainer, engine) == []


def test_a_refused_payload_changes_nothing_in_the_engine():
    trainer = ShardTrainer(SHAPES, 0, 1, lr=1e-2)
    engine = _engine(trainer)
    held = _bits(engine.tensors)
    scale = FP8[1] + "_scale_inv"
    q = PLAN.quantize_model(trainer.params)[0]
    s = host_bits(q[scale]).copy()
    s[0] = np.float32("nan").view(np.uint32)  # block 0's scale becomes NaN
    target = {**engine.tensors, scale: torch.from_numpy(s.view(np.float32)).reshape(q[scale].shape)}
    payload = codec.encode(engine.tensors, target, codec.Identity(base_version=0, target_version=1), key=KEY)
    with pytest.raises(quant.Fp8PayloadError, match="block \\(0, 0\\).*not finite"):
        apply_version(engine, {0: [payload]})
    resync = codec.encode({n: torch.zeros_like(t) for n, t in target.items()}, target,
                          codec.Identity(base_version=0, target_version=1), key=KEY)
    with pytest.raises(quant.Fp8PayloadError, match="not finite"):
        apply_version(engine, {0: [resync]}, resync=True)
    assert engine.version == 0 and all(np.array_equal(held[n], b) for n, b in _bits(engine.tensors).items())


def test_crash_mid_apply_and_a_silent_bit_flip_are_repaired():
    trainer = ShardTrainer(SHAPES, 0, 1, lr=2e-4)
    engine = _engine()
    refit = _refit(trainer, engine, verify="full")
    try:
        refit.attach()

        def crash(name):
            if name == FP8[1]:
                engine.fault = None
                raise InjectedFault(f"crash after writing {name}")
        engine.fault = crash
        trainer.step()
        r = refit.step()
        assert r.detected and r.resynced and r.committed and _mismatches(trainer, engine) == []
        int_view(engine.tensors[FP8[0]])[7] ^= 0x01  # memory flips a bit of an FP8 byte
        trainer.step()
        r = refit.step()
        assert r.resynced and any(FP8[0] in d for d in r.detected) and _mismatches(trainer, engine) == []
    finally:
        refit.close(5)


def test_forced_resyncs_send_the_quantized_state():
    trainer = ShardTrainer(SHAPES, 0, 1, lr=1e-3)
    for cfg, expect in (({"full_resync_interval": 2}, ["delta", "resync", "delta", "resync"]),
                        ({"enabled": False}, ["resync"] * 4)):
        engine = _engine()
        refit = _refit(trainer, engine, **cfg)
        try:
            refit.attach()
            modes = []
            for _ in range(4):
                trainer.step()
                r = refit.step()
                modes.append(r.mode)
                assert r.committed and _mismatches(trainer, engine) == []
            assert modes == expect
        finally:
            refit.close(5)


def test_fp8_weights_must_be_bf16_on_the_trainer():
    from nemo_dcr.refit.fp8_mirror import Fp8Mirror

    with pytest.raises(quant.Fp8Error, match="quantizes bf16 weights"):
        Fp8Mirror(PLAN, {FP8[0]: ("fp32", SHAPES[FP8[0]])})


def test_the_reference_check_sees_a_wrong_byte():
    trainer = ShardTrainer(SHAPES, 0, 1)
    engine = _engine(trainer)
    assert _mismatches(trainer, engine) == []
    int_view(engine.tensors[FP8[1] + "_scale_inv"])[2] ^= 1
    assert _mismatches(trainer, engine) == [FP8[1] + "_scale_inv"]
    q, _, _ = quantize_ref(np.zeros((3, 3), np.float32), BLOCK)
    assert not q.any()


def test_a_transformers_engine_with_fp8_weights_serves_each_refit_version():
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM, LlamaConfig

    from nemo_dcr.integrations.hf.engine import HFEngine

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=64, tie_word_embeddings=True))
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    plan = fp8_plan(_cfg(), shapes)
    engine = HFEngine(model, key=KEY, fp8_plan=plan)
    assert len(plan.fp8) == 7 and all(engine.tensors[n].dtype == torch.float8_e4m3fn for n in plan.fp8)
    trainer = ShardTrainer(shapes, 0, 1, lr=1e-2)
    refit = _refit(trainer, engine)
    try:
        assert refit.attach().resynced and _mismatches(trainer, engine, plan.fp8) == []
        ids = torch.tensor([[1, 5, 9, 3]])
        first = engine.logits(ids)[0]
        trainer.step()
        assert refit.step().committed and _mismatches(trainer, engine, plan.fp8) == []
        served = engine.logits(ids)[0]
        for m in engine.model.modules():  # drop every cached dequantized weight: the served logits were fresh
            if isinstance(m, quant.Fp8Linear):
                m.refresh()
        assert torch.equal(served, engine.logits(ids)[0]) and not torch.equal(first, served)
    finally:
        refit.close(5)
