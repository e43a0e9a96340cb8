"""Fp8Linear: a model whose linear layers hold the FP8 engine tensors, refit in place through the codec."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from nemo_dcr import codec, quant
from nemo_dcr.types import bits_view
from nemo_dcr.verify.fp8_reference import quantize_ref


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(192)
        self.up_proj = nn.Linear(192, 300, bias=False)
        self.down_proj = nn.Linear(300, 192, bias=True)

    def forward(self, x):
        return self.down_proj(torch.relu(self.up_proj(self.input_layernorm(x))))


def model_and_plan():
    torch.manual_seed(0)
    model = nn.Module()
    model.layers = nn.ModuleList([Block(), Block()])
    model.to(torch.bfloat16)
    state = {n: p.detach().clone() for n, p in model.state_dict().items()}
    return model, state, quant.Fp8Plan.build({n: t.shape for n, t in state.items()})


def run(model, x):
    for layer in model.layers:
        x = layer(x)
    return x


def test_swapped_model_holds_the_engine_tensors_and_uses_them():
    model, state, plan = model_and_plan()
    assert sorted(plan.fp8) == sorted(n for n in state if n.endswith("proj.weight"))
    engine, _ = plan.quantize_model(state)
    replaced = quant.to_fp8_linears(model, plan, engine)
    sd = model.state_dict()
    assert set(plan.scale_names.values()) <= set(sd) and set(plan.fp8) <= set(sd)
    assert all(sd[n].dtype == torch.float8_e4m3fn and sd[n].data_ptr() == engine[n].data_ptr() for n in plan.fp8)
    x = torch.randn(4, 192, dtype=torch.bfloat16)
    lin = replaced["layers.0.up_proj.weight"]
    q, s, _ = quantize_ref(state["layers.0.up_proj.weight"].float().numpy(), (128, 128))
    w = torch.from_numpy(q.copy()).view(torch.float8_e4m3fn).float() * torch.from_numpy(
        np.repeat(np.repeat(s, 128, 0), 128, 1)[:300, :192])
    assert torch.equal(lin(x), nn.functional.linear(x, w.to(torch.bfloat16)))
    out = run(model, x)
    assert torch.isfinite(out).all()


def test_refit_through_the_codec_reaches_the_forward_after_refresh():
    model, state, plan = model_and_plan()
    engine, amax = plan.quantize_model(state)
    replaced = quant.to_fp8_linears(model, plan, engine)
    target = {n: t.clone() for n, t in state.items()}
    target["layers.1.up_proj.weight"] = (target["layers.1.up_proj.weight"].float() * 1.3).to(torch.bfloat16)
    x = torch.randn(3, 192, dtype=torch.bfloat16)
    before = run(model, x)
    deltas, amax, _ = plan.deltas([d for d in codec.diff_tensors(state, target) if d.nnz], target, amax)
    payload = codec.encode_deltas(deltas, {n: bits_view(t) for n, t in engine.items()})
    touched = codec.apply(engine, payload)
    assert torch.equal(run(model, x), before)  # cached: the refit wrote through integer views
    for name in touched:
        if name in replaced:
            replaced[name].refresh()
    fresh = plan.quantize_model(target)[0]
    want_model, _, _ = model_and_plan()
    quant.to_fp8_linears(want_model, plan, fresh)
    assert torch.equal(run(model, x), run(want_model, x)) and not torch.equal(run(model, x), before)


def test_non_linear_module_planned_as_fp8_is_refused():
    model, state, plan = model_and_plan()
    engine, _ = plan.quantize_model(state)
    model.layers[0].up_proj = nn.Identity()
    with pytest.raises(quant.Fp8Error, match="planned FP8 weights have no nn.Linear|not nn.Linear"):
        quant.to_fp8_linears(model, plan, engine)
