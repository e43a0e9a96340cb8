"""The transformers engine: payloads land in the live parameters; generation is version-guarded."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from nemo_dcr.apply import InjectedFault, apply_version  # noqa: E402
from nemo_dcr.codec import Identity, encode  # noqa: E402
from nemo_dcr.integrations.hf.engine import HFEngine  # noqa: E402

KEY = b"h" * 32


def tiny_config(tied: bool = True):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=128, tie_word_embeddings=tied)


def _stepped(tensors, seed):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.where(torch.rand(t.shape, generator=g) < 0.05, (t.float() * 1.03).to(t.dtype), t)
            for n, t in tensors.items()}


def test_apply_into_live_params_matches_reloaded_model():
    engine = HFEngine.from_config(tiny_config(), key=KEY)
    base = {n: t.clone() for n, t in engine.tensors.items()}
    target = _stepped(base, 1)
    result = apply_version(engine, {0: [encode(base, target, Identity(base_version=0, target_version=1), key=KEY)]})
    assert engine.version == 1 and result.touched
    assert "lm_head.weight" not in engine.tensors  # tied: one canonical tensor
    ref = HFEngine.from_config(tiny_config())
    ref.model.load_state_dict(target, strict=False)
    ids = torch.tensor([[1, 5, 9, 3]])
    assert torch.equal(engine.logits(ids)[0], ref.logits(ids)[0])
    assert engine.model.lm_head.weight.data_ptr() == engine.model.model.embed_tokens.weight.data_ptr()
    gen = engine.generate(ids, max_new_tokens=3)
    assert gen.version == 1 and gen.tokens.shape == (1, 7)


def test_crash_mid_apply_keeps_old_logits():
    engine = HFEngine.from_config(tiny_config(tied=False), key=KEY)
    base = {n: t.clone() for n, t in engine.tensors.items()}
    ids = torch.tensor([[2, 4, 6]])
    before = engine.logits(ids)[0]
    payload = encode(base, _stepped(base, 2), Identity(), key=KEY)
    engine.engine.fault = lambda name: (_ for _ in ()).throw(InjectedFault(name)) if "layers.1" in name else None
    with pytest.raises(InjectedFault):
        apply_version(engine, {0: [payload]})
    assert engine.version == 0 and torch.equal(engine.logits(ids)[0], before)
    assert engine.checksums() == engine.checksums(full=True)
