"""Bit-exactness on a CUDA device: the scan and in-place writes, and the torch oracle of the ``dcr``
coder (tests/oracles) against the compiled coder on the host."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nemo_dcr.codec.dcr import encode_dcr
from nemo_dcr.kernels import scan_changes, write_bits
from nemo_dcr.types import DTYPES, bits_view, spec_of
from tests.oracles import decode_dcr_torch, encode_dcr_torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (GPU kernels run on the tensor's device)"),
]
FLOATS = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: spec_of(d).name)
def test_gpu_bytes_and_apply_exact(dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(300_000, generator=g, device="cuda") * 0.02).to(dtype)
    step = torch.randn(w.numel(), generator=g, device="cuda") * 2e-4
    target = (w.float() + step).to(dtype)
    pos, new = scan_changes(target, w)
    assert pos.device.type == "cuda" and pos.numel() > 0
    body = encode_dcr_torch(w, pos, new)
    w_h, t_h, p_h = w.cpu(), target.cpu(), pos.cpu().numpy()
    spec = DTYPES[spec_of(dtype).name]
    assert body == encode_dcr(bits_view(w_h), p_h, bits_view(t_h)[p_h], spec)
    out = w.clone()
    write_bits(out, *decode_dcr_torch(body, w))
    assert np.array_equal(bits_view(out.cpu()), bits_view(t_h))
