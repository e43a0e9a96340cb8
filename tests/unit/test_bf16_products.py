"""bf16 matrix products computed in fp32 on CPUs without native bf16 (``tools/megatron/bf16_products.py``):
the mode's products equal the fp32 product rounded to bf16, forward and backward, and it leaves
everything else (and every other device) alone."""

from __future__ import annotations

import contextlib

import torch

from nemo_dcr.tools.megatron import bf16_products as bp


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().view(torch.int16)


def test_products_are_fp32_rounded_to_bf16_forward_and_backward():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(33, 64, generator=g).bfloat16().requires_grad_(True)
    lin = torch.nn.Linear(64, 48, dtype=torch.bfloat16)
    q, k = torch.randn(3, 5, 16, generator=g).bfloat16(), torch.randn(3, 16, 7, generator=g).bfloat16()
    with bp._Fp32Products():
        y = lin(x)
        att = torch.baddbmm(torch.empty(3, 5, 7, dtype=torch.bfloat16), q, k, beta=0.0, alpha=0.5)
        y.float().square().sum().backward()
    assert y.dtype == att.dtype == lin.weight.grad.dtype == x.grad.dtype == torch.bfloat16
    want = (x.detach().float() @ lin.weight.detach().float().t() + lin.bias.detach().float()).bfloat16()
    assert torch.equal(_bits(y), _bits(want))
    assert torch.equal(_bits(att), _bits((0.5 * (q.float() @ k.float())).bfloat16()))
    dy = (2 * y.detach().float()).bfloat16()  # d(sum y^2)/dy, the bf16 grad the linear's backward gets
    assert torch.equal(_bits(x.grad), _bits((dy.float() @ lin.weight.detach().float()).bfloat16()))
    assert torch.equal(_bits(lin.weight.grad), _bits((dy.float().t() @ x.detach().float()).bfloat16()))


def test_other_dtypes_and_ops_pass_through():
    a, b = torch.randn(4, 8), torch.randn(8, 3)
    with bp._Fp32Products():
        out = a @ b
        h = torch.randn(4, 8).bfloat16() + 1
    assert out.dtype == torch.float32 and torch.equal(out, a @ b) and h.dtype == torch.bfloat16


def test_context_only_on_a_cpu_without_native_bf16(monkeypatch):
    assert isinstance(bp.bf16_products_in_fp32("meta"), contextlib.nullcontext)
    monkeypatch.setattr(bp, "_native_bf16_cpu", lambda: True)
    assert isinstance(bp.bf16_products_in_fp32("cpu"), contextlib.nullcontext)
    monkeypatch.setattr(bp, "_native_bf16_cpu", lambda: False)
    assert isinstance(bp.bf16_products_in_fp32(torch.device("cpu")), bp._Fp32Products)
