"""The compiled coder and the torch oracle against the numpy oracle on CPU: same bytes, same decode.

The vectorized numpy oracle is the reference (its bytes are pinned by the golden tests); the
group-by-group oracle is a second, independent one (all in tests/oracles).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nemo_dcr.codec.dcr import decode_dcr, encode_dcr
from nemo_dcr.kernels import scan_changes, write_bits
from nemo_dcr.types import DTYPES, bits_view, tensor_from_bits
from tests.oracles import (
    decode_dcr_np,
    decode_dcr_per_group,
    decode_dcr_torch,
    encode_dcr_np,
    encode_dcr_per_group,
    encode_dcr_torch,
)


def _case(rng, spec, n, density, mode):
    if mode == "random":
        base = rng.integers(0, 1 << spec.bits, n, dtype=np.uint64).astype(spec.uint)
    else:
        w = (rng.standard_normal(n) * 10.0 ** rng.integers(-4, 1)).astype(np.float32)
        base = w.view(np.uint32) if spec.bits == 32 else (w.view(np.uint32) >> (32 - spec.bits)).astype(spec.uint)
    pos = np.sort(rng.choice(n, size=max(1, int(n * density)), replace=False)).astype(np.int64)
    if mode == "random":
        new = rng.integers(0, 1 << spec.bits, pos.size, dtype=np.uint64).astype(spec.uint)
    else:
        step = rng.integers(-3, 4, pos.size) * rng.integers(1, 40 if mode == "wide" else 2, pos.size)
        new = (base[pos].astype(np.int64) + step).astype(spec.uint)
    keep = new != base[pos]
    return base, pos[keep], new[keep]


def _check(spec, base, pos, new):
    ref = encode_dcr_np(base, pos, new, spec)
    assert ref == encode_dcr_per_group(base, pos, new, spec) == encode_dcr(base, pos, new, spec)
    t = tensor_from_bits(base, spec, (base.size,))
    new_t = tensor_from_bits(new, spec, (new.size,))
    assert encode_dcr_torch(t, torch.from_numpy(pos), new_t) == ref
    p, v = decode_dcr_torch(ref, t)
    assert np.array_equal(p.numpy(), pos)
    assert np.array_equal(v.numpy().view(spec.uint), new)
    p2, v2 = decode_dcr_np(ref, base, spec, "t")
    p3, v3 = decode_dcr_per_group(ref, base, spec, "t")
    p4, v4 = decode_dcr(ref, base, spec, "t")
    assert np.array_equal(p2, p3) and np.array_equal(v2, v3) and np.array_equal(p2, pos)
    assert np.array_equal(p4, pos) and np.array_equal(v4, v2)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("mode", ["random", "ulp", "wide"])
def test_torch_bytes_equal_numpy(dtype, mode):
    spec, rng = DTYPES[dtype], np.random.default_rng(abs(hash((dtype, mode))) % 2**32)
    for n, density in ((1, 1.0), (7, 0.5), (300, 0.02), (3000, 0.6), (70_000, 0.004), (140_000, 0.03)):
        base, pos, new = _case(rng, spec, n, density, mode)
        if pos.size:
            _check(spec, base, pos, new)


def test_many_small_random_cases():
    rng = np.random.default_rng(7)
    for i in range(150):
        spec = DTYPES[sorted(DTYPES)[i % len(DTYPES)]]
        base, pos, new = _case(rng, spec, int(rng.integers(1, 2000)), float(rng.uniform(0.001, 1.0)),
                               ("random", "ulp", "wide")[i % 3])
        if pos.size:
            _check(spec, base, pos, new)


def test_real_looking_bf16_delta():
    """Adam-like update of a bf16 weight matrix: most elements below half an ULP, some move 1-3 ULPs."""
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(1536 * 96, generator=g) * 0.02).to(torch.bfloat16)
    upd = torch.randn(w.numel(), generator=g) * 1e-4
    target = (w.float() + upd).to(torch.bfloat16)
    pos, new = scan_changes(target, w)
    assert 0 < pos.numel() < w.numel()
    spec = DTYPES["bf16"]
    _check(spec, bits_view(w), pos.numpy(), bits_view(target)[pos.numpy()])
    out = w.clone()
    write_bits(out, *decode_dcr_torch(encode_dcr_torch(w, pos, new), w))
    assert torch.equal(out.view(torch.int16), target.view(torch.int16))


def test_scan_is_bitwise():
    a = torch.tensor([0.0, -0.0, float("nan"), 1.0], dtype=torch.float32)
    b = a.clone()
    b.view(torch.int32)[1] = 0  # -0.0 -> +0.0 is a change
    b.view(torch.int32)[2] ^= 1  # another NaN payload is a change
    pos, new = scan_changes(b, a, chunk=3)
    assert pos.tolist() == [1, 2]
    assert torch.equal(new, b.view(torch.int32)[[1, 2]])
