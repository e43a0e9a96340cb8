"""A real vLLM engine (CPU) refit in place, on a tiny random Llama: TP=1 from dummy weights (the
first refit is a full resync, then a delta, then a dense ``load_weights``), and TP=2 with each
engine rank in its own process receiving only its own parts, committing or rolling back together.
Every check is against a *fresh* vLLM engine loaded from the dense checkpoint."""

from __future__ import annotations

from dataclasses import replace

import pytest
from vllm_models import ENGINE_ARGS, KEY, PROMPTS, Trainer, checkpoint_tensors, perturbed, write_like

from nemo_dcr.codec import inspect
from nemo_dcr.types import bits_view
from nemo_dcr.verify.checksum import tensor_checksum

pytestmark = pytest.mark.vllm


def _sums(tensors):
    return {n: tensor_checksum(bits_view(t)) for n, t in tensors.items()}


def _changed(base, target) -> int:
    return sum(int((bits_view(base[n]) != bits_view(target[n])).sum()) for n in base)


def _fresh(model_dir, tp=1):
    """Params of every rank and greedy generations of a fresh engine loaded from ``model_dir``."""
    from nemo_dcr.integrations.vllm.engine import VllmEngine
    from nemo_dcr.integrations.vllm.verify import engine_state

    with VllmEngine.start(str(model_dir), tensor_parallel_size=tp, key=KEY, **ENGINE_ARGS) as eng:
        return engine_state(eng.llm), eng.generate(PROMPTS)[0]


def test_dummy_engine_resync_then_delta_then_dense(tiny_llama, tmp_path):
    from nemo_dcr.integrations.vllm.engine import VllmEngine
    from nemo_dcr.integrations.vllm.verify import engine_state, state_differences

    base = checkpoint_tensors(tiny_llama)
    target = perturbed(base)
    target_dir = write_like(tiny_llama, target, tmp_path / "target")
    with VllmEngine.start(str(tiny_llama), key=KEY, load_format="dummy", **ENGINE_ARGS) as eng:
        assert len(eng.compare(tiny_llama)[0]) == len(base)  # dummy weights: nothing is the checkpoint
        with Trainer(eng, base) as trainer:
            first = trainer.first  # the engine's checksums differ from the trainer's: a full resync
            assert first.committed and first.resynced and eng.version == first.version == 1
            assert any("differ at (re)start" in d for d in first.detected)
            assert eng.compare(tiny_llama) == {0: []}
            assert eng.checksums().canonical == _sums(base) == eng.checksums(full=True).canonical

            r = trainer.step_to(target)
            assert r.committed and r.mode == "delta" and not r.resynced and eng.version == 2
            assert r.changed == _changed(base, target)
        assert eng.checksums().canonical == _sums(target) == eng.checksums(full=True).canonical
        assert eng.compare(target_dir) == {0: []}
        refit, generated = engine_state(eng.llm), eng.generate(PROMPTS)

        assert eng.load_weights(str(tiny_llama), 3) == _sums(base) and eng.version == 3
        dense = engine_state(eng.llm)
    want, want_tokens = _fresh(target_dir)
    assert state_differences(refit, want) == []
    assert generated == (want_tokens, 2)
    base_params, base_tokens = _fresh(tiny_llama)
    assert state_differences(dense, base_params) == []
    assert base_tokens != want_tokens  # the generations compared above can tell the versions apart


def _tamper_shard_1(envs):
    """Flip one byte in the middle of every payload part for TP rank 1 (its shard)."""
    out = []
    for e in envs:
        body = bytearray(e.body)
        if e.shard == 1 and body:
            body[len(body) // 2] ^= 0x01
        out.append(replace(e, body=bytes(body)))
    return out


def test_tp2_ranks_receive_own_parts_and_commit_together(tiny_llama, tmp_path):
    """Through the refit path: each TP rank receives only records in its own view index space; a
    corrupted part for rank 1 makes rank 1 refuse and rank 0 roll back, the engine stays at its
    version and the trainer's recovery resync lands; then a clean delta; all vs a fresh engine."""
    from nemo_dcr.integrations.vllm.engine import VllmEngine
    from nemo_dcr.integrations.vllm.verify import engine_state, state_differences

    base = checkpoint_tensors(tiny_llama)
    target = perturbed(base)
    middle = perturbed(base, seed=7)
    target_dir = write_like(tiny_llama, target, tmp_path / "target")
    middle_dir = write_like(tiny_llama, middle, tmp_path / "middle")
    q = "model.layers.0.self_attn.q_proj.weight"
    with VllmEngine.start(str(tiny_llama), tensor_parallel_size=2, key=KEY, **ENGINE_ARGS) as eng:
        routes = eng.routes()
        assert [routes[r][q].numel for r in (0, 1)] == [base[q].numel() // 2] * 2
        assert routes[1][q].param == "model.layers.0.self_attn.qkv_proj.weight"
        tokens_before = eng.generate(PROMPTS)[0]
        with Trainer(eng, base) as trainer:
            assert not trainer.first.resynced and set(trainer.refit.sender.routes) == {(1, 0), (1, 1)}
            seen = []
            sizes = {r: {n: tp.numel for n, tp in routes[r].items()} for r in (0, 1)}

            def spy(envs):  # each shard's records are in that rank's own view index space
                for e in envs:
                    seen.extend((e.shard, rec.name, rec.shape) for rec in inspect(e.body, KEY).records)
                return envs

            r = trainer.step_to(middle, tamper=_tamper_shard_1)
            refused = [d for v, w, d in trainer.events if w == "refused"]
            assert len(refused) == 1 and refused[0].startswith("RankRefusedError"), trainer.events
            assert "rank 1" in refused[0] and "rolled back [0]" in refused[0]
            assert r.committed and r.resynced and eng.compare(middle_dir) == {0: [], 1: []}
            assert eng.checksums(full=True).canonical == _sums(middle)

            r = trainer.step_to(target, tamper=spy)
            assert r.committed and not r.resynced and r.verified
            assert seen and all(shape == (sizes[s][name],) for s, name, shape in seen)
            assert {s for s, _, _ in seen} == {0, 1}
        assert eng.checksums().canonical == _sums(target) == eng.checksums(full=True).canonical
        assert eng.compare(target_dir) == {0: [], 1: []}
        refit, generated = engine_state(eng.llm), eng.generate(PROMPTS)
    want, want_tokens = _fresh(target_dir, tp=2)
    assert state_differences(refit, want) == []
    assert generated[0] == want_tokens and tokens_before != want_tokens
