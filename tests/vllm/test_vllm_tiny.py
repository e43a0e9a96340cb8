"""A real vLLM engine (CPU) refit in place, on a tiny random Llama: TP=1 from dummy weights (the
first refit is a full resync, then a delta, then a dense ``load_weights``), and TP=2 with each
engine rank in its own process receiving only its own parts, committing or rolling back together.
Every check is against a *fresh* vLLM engine loaded from the dense checkpoint."""

from __future__ import annotations

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
    from nemo_dcr.integrations.vllm.verify import engine_params

    with VllmEngine.start(str(model_dir), tensor_parallel_size=tp, key=KEY, **ENGINE_ARGS) as eng:
        return engine_params(eng.llm), eng.generate(PROMPTS)[0]


def test_dummy_engine_resync_then_delta_then_dense(tiny_llama, tmp_path):
    from nemo_dcr.integrations.vllm.engine import VllmEngine
    from nemo_dcr.integrations.vllm.verify import engine_params, param_differences

    base = checkpoint_tensors(tiny_llama)
    target = perturbed(base)
    target_dir = write_like(tiny_llama, target, tmp_path / "target")
    with VllmEngine.start(str(tiny_llama), key=KEY, load_format="dummy", **ENGINE_ARGS) as eng:
        assert len(eng.compare(tiny_llama)[0]) == len(base)  # dummy weights: nothing is the checkpoint
        trainer = Trainer(eng.routes(), base)
        result = eng.resync(trainer.resync(base, 1))
        trainer.commit(1)
        assert result.resync and eng.version == 1 and eng.compare(tiny_llama) == {0: []}
        assert eng.checksums() == _sums(base) == eng.checksums(full=True)

        result = eng.apply(trainer.delta(base, target, 2))
        trainer.commit(2)
        assert not result.resync and eng.version == 2
        assert sum(result.touched.values()) == _changed(base, target)
        assert eng.checksums() == _sums(target) == eng.checksums(full=True)
        assert eng.compare(target_dir) == {0: []}
        refit, generated = engine_params(eng.llm), eng.generate(PROMPTS)

        assert eng.load_weights(str(tiny_llama), 3) == _sums(base) and eng.version == 3
        dense = engine_params(eng.llm)
    want, want_tokens = _fresh(target_dir)
    assert param_differences(refit, want) == []
    assert generated == (want_tokens, 2)
    base_params, base_tokens = _fresh(tiny_llama)
    assert param_differences(dense, base_params) == []
    assert base_tokens != want_tokens  # the generations compared above can tell the versions apart


def _tampered(part: bytes) -> bytes:
    data = bytearray(part)
    data[len(data) // 2] ^= 0x01
    return bytes(data)


def test_tp2_ranks_receive_own_parts_and_commit_together(tiny_llama, tmp_path):
    from nemo_dcr.integrations.vllm.engine import RankRefusedError, VllmEngine
    from nemo_dcr.integrations.vllm.verify import engine_params, param_differences

    base = checkpoint_tensors(tiny_llama)
    target = perturbed(base)
    target_dir = write_like(tiny_llama, target, tmp_path / "target")
    q = "model.layers.0.self_attn.q_proj.weight"
    with VllmEngine.start(str(tiny_llama), tensor_parallel_size=2, key=KEY, **ENGINE_ARGS) as eng:
        routes = eng.routes()
        assert [routes[r][q].numel for r in (0, 1)] == [base[q].numel() // 2] * 2
        assert routes[1][q].param == "model.layers.0.self_attn.qkv_proj.weight"
        before, tokens_before = engine_params(eng.llm), eng.generate(PROMPTS)[0]
        trainer = Trainer(routes, base)
        parts = trainer.delta(base, target, 1)
        for r in (0, 1):  # each rank's records are in its own view index space
            records = [rec for p in parts[r] for rec in inspect(p, KEY).records]
            assert records and all(rec.shape == (routes[r][rec.name].numel,) for rec in records)

        with pytest.raises(RankRefusedError) as refused:
            eng.apply({0: parts[0], 1: [_tampered(p) for p in parts[1]]})
        assert [f[0] for f in refused.value.failures] == [1] and refused.value.rolled_back == [0]
        assert eng.version == 0 and param_differences(engine_params(eng.llm), before) == []

        result = eng.apply(parts)
        trainer.commit(1)
        assert result.target_version == 1 == eng.version
        assert eng.checksums() == _sums(target) == eng.checksums(full=True)
        assert eng.compare(target_dir) == {0: [], 1: []}
        refit, generated = engine_params(eng.llm), eng.generate(PROMPTS)
    want, want_tokens = _fresh(target_dir, tp=2)
    assert param_differences(refit, want) == []
    assert generated == (want_tokens, 1) and tokens_before != want_tokens
