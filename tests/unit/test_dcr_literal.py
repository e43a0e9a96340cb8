"""Literal groups of the ``dcr`` coding (docs/wire_format.md section 4.4).

Bodies are written bit by bit here from the spec text, not with the encoder, and decoded by the
compiled decoder (with and without a kept index) and the oracles of tests/oracles (vectorized
numpy, group-by-group, torch).  Each MUST of a literal group gets its
own malformed body.  The encoder side: weights much smaller than their update are coded as
literals, smaller than as steps, and round-trip bit-exactly.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nemo_dcr.codec.dcr import DcrIndex, decode_dcr, encode_dcr
from nemo_dcr.codec.errors import MalformedRecordError
from nemo_dcr.types import bits_view, spec_of
from tests.oracles import decode_dcr_np, decode_dcr_per_group, decode_dcr_torch, encode_dcr_np, encode_dcr_per_group

SHIFT, EBITS, NBITS = 7, 8, 16  # bf16: 7 mantissa bits, 8 exponent bits


def _varints(values) -> bytes:
    out = bytearray()
    for v in values:
        while True:
            b, v = v & 0x7F, v >> 7
            out.append(b | (0x80 if v else 0))
            if not v:
                break
    return bytes(out)


def _body(cls: int, n: int, e_ref: int, k_lit: int, values, n_neg: int | None = None) -> bytes:
    """One group of width 1 at class ``cls`` whose ``n`` elements all change (no ranks item)."""
    k = k_lit + SHIFT + 1
    q = "".join("0" * (v >> k) + "1" for v in values)
    r = "".join(format(v & ((1 << k) - 1), f"0{k}b") for v in values)
    bits = q + r
    bits += "0" * (-len(bits) % 8)
    data = bytes(int(bits[i : i + 8], 2) for i in range(0, len(bits), 8))
    table = _varints([cls, 1, 1, n, n + 1 if n_neg is None else n_neg, e_ref]) + bytes([k_lit])
    return table + _varints([len(q), len(r)]) + data


def _zigzag(x: int) -> int:
    return 2 * x if x >= 0 else -2 * x - 1


def _value(e_new: int, e_ref: int, sign: int, mant: int) -> int:
    return (_zigzag(e_new - e_ref) << (SHIFT + 1)) | (sign << SHIFT) | mant


def _base(cls: int, n: int) -> np.ndarray:
    return np.array([(cls << SHIFT) | (3 * i) for i in range(n)], dtype=np.uint16)


def _decoders(body, base):
    spec = spec_of(torch.bfloat16)
    yield "compiled", lambda: decode_dcr(body, base, spec, "w")
    yield "compiled, kept index", lambda: decode_dcr(body, base, spec, "w", DcrIndex.build(base, spec))
    yield "numpy", lambda: decode_dcr_np(body, base, spec, "w")
    yield "per-group", lambda: decode_dcr_per_group(body, base, spec, "w")
    t = torch.from_numpy(base.view(np.int16).copy()).view(torch.bfloat16)

    def torch_decode():
        p, nb = decode_dcr_torch(body, t, "w")
        return p.numpy(), nb.numpy().view(np.uint16)

    yield "torch", torch_decode


def test_literal_group_decodes_as_written():
    cls, e_ref = 100, 108
    base = _base(cls, 4)
    news = [(108, 0, 5), (107, 1, 127), (110, 0, 0), (0, 1, 0)]  # the last one is -0.0
    body = _body(cls, 4, e_ref, 1, [_value(e, e_ref, s, m) for e, s, m in news])
    want = np.array([(s << 15) | (e << SHIFT) | m for e, s, m in news], dtype=np.uint16)
    for which, run in _decoders(body, base):
        pos, new = run()
        assert pos.tolist() == [0, 1, 2, 3], which
        assert np.array_equal(new.astype(np.uint16), want), which


@pytest.mark.parametrize("case", ["e_ref_outside_field", "exponent_below_field", "exponent_above_field",
                                  "literal_equals_old", "k_lit_too_large", "n_neg_two_over_n"])
def test_malformed_literal_groups_are_refused(case):
    cls = 100
    base = _base(cls, 2)
    ok = [_value(108, 108, 0, 1), _value(109, 108, 1, 2)]
    body = {
        "e_ref_outside_field": lambda: _body(cls, 2, 256, 0, [_value(108, 256, 0, 1)] * 2),
        "exponent_below_field": lambda: _body(cls, 2, 1, 0, [ok[0], _value(-1, 1, 0, 0)]),
        "exponent_above_field": lambda: _body(cls, 2, 255, 0, [_value(255, 255, 0, 1), _value(256, 255, 0, 0)]),
        "literal_equals_old": lambda: _body(cls, 2, cls, 0, [ok[0], _value(cls, cls, 0, 3)]),  # base[1] bits
        "k_lit_too_large": lambda: _body(cls, 2, 108, 56, ok),
        "n_neg_two_over_n": lambda: _body(cls, 2, 108, 0, ok, n_neg=4),
    }[case]()
    match = {"e_ref_outside_field": "reference exponent", "exponent_below_field": "exponent outside",
             "exponent_above_field": "exponent outside", "literal_equals_old": "equals the old",
             "k_lit_too_large": "Rice parameter", "n_neg_two_over_n": "counts exceed"}[case]
    for which, run in _decoders(body, base):
        with pytest.raises(MalformedRecordError, match=match):
            run()
            pytest.fail(f"{which} accepted {case}")


def test_encoder_codes_tiny_weights_as_literals_and_round_trips():
    """Weights far below the update: new values do not depend on old ones, so literals win."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4096, generator=g) * 1e-9  # exponent ~ 2^-30
    w[:2048] = torch.randn(2048, generator=g) * 0.02  # ordinary weights too (steps groups)
    base_t = w.bfloat16()
    upd = torch.randn(4096, generator=g).sign() * 1e-4 * torch.rand(4096, generator=g)
    new_t = (w + upd).bfloat16()
    spec = spec_of(torch.bfloat16)
    base, new = bits_view(base_t), bits_view(new_t)
    pos = np.flatnonzero(base != new)
    body = encode_dcr(base, pos, new[pos], spec)
    assert body == encode_dcr_per_group(base, pos, new[pos], spec) == encode_dcr_np(base, pos, new[pos], spec)
    p2, n2 = decode_dcr(body, base, spec, "w")
    assert np.array_equal(p2, pos) and np.array_equal(n2, new[pos])
    # the same tensors coded with steps only (literal groups switched off in the numpy oracle) are larger
    import tests.oracles.encode as enc

    saved = enc.literal_choice
    enc.literal_choice = lambda *a: np.zeros(len(a[0]), bool)
    try:
        steps_only = encode_dcr_np(base, pos, new[pos], spec)
    finally:
        enc.literal_choice = saved
    assert len(body) < 0.9 * len(steps_only), (len(body), len(steps_only))
    p3, n3 = decode_dcr(steps_only, base, spec, "w")
    assert np.array_equal(n3, new[pos])
