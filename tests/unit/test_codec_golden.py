"""Exact-bytes golden payloads of wire format v1 (docs/wire_format.md).

The payloads in ``golden/`` were produced once from the fixed tensors below. A codec change
that alters a single byte of the output fails here: that is a wire-format change and needs a
version bump (or a deliberate regeneration if the format is still unreleased).

Besides the byte comparison, the files are decoded by a small, independent reader written from
the spec (``tests/spec_reader.py``: ``struct`` + ``zstandard`` + ``json`` + pure Python bit
reading, no import of the codec), and the result is compared with the target tensors bit for bit.

Regenerate (only after a deliberate format change)::

    NEMO_DCR_REGEN_GOLDEN=1 python -m pytest tests/unit/test_codec_golden.py -k regenerate
"""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.spec_reader import SPEC, UINT, Parsed, ibits, spec_checksum, spec_decode_dcr, spec_decode_record

GOLDEN_DIR = Path(__file__).parent / "golden"
HMAC_KEY = b"golden-hmac-key-0123456789abcdef"
IDENTITY = dict(model="golden-model", run="golden-run", base_version=41, target_version=42)
CASES = {  # file name -> (encoding, key)
    "golden_dcr.bin": ("dcr", None),
    "golden_reference.bin": ("reference", None),
    "golden_raw.bin": ("raw", None),
    "golden_dcr_hmac.bin": ("dcr", HMAC_KEY),
}
# per case, the encoding each record must have (in record order); "same" for the unchanged tensor
EXPECTED_ENCODINGS = {
    "dcr": ["dcr", "dcr", "dcr", "same", "dcr"],
    "reference": ["reference", "reference", "reference", "same", "reference"],
    "raw": ["raw", "raw", "raw", "same", "raw"],
}

def from_bits(values, dtype: str, shape) -> torch.Tensor:
    tdt, nbits, _, _ = SPEC[dtype]
    arr = np.array(values, dtype=np.uint64).astype(UINT[nbits])
    signed = {8: np.uint8, 16: np.int16, 32: np.int32}[nbits]
    return torch.from_numpy(arr.view(signed).copy()).view(tdt).reshape(shape)


# ----------------------------------------------------------------------------- fixed tensors


def golden_tensors() -> tuple[dict, dict]:
    """Fixed base and target (deterministic formulas and literal bit patterns only)."""
    base, target = {}, {}

    # bf16 (16, 32): small weights, plus -0.0, a NaN with payload, +Inf, a subnormal
    b = [int(ibits(torch.tensor([((i * 37) % 101 - 50) / 1000.0]).to(torch.bfloat16))[0]) for i in range(512)]
    b[5], b[6], b[7], b[8] = 0x8000, 0x7FC1, 0x7F80, 0x0003
    t = list(b)
    t[3] += 1                    # +1 ULP
    t[40] += 1
    t[41] -= 1
    t[100] = b[100] ^ 0x8000     # sign flip
    t[5] = 0x0000                # -0.0 -> +0.0
    t[6] = 0xFFC1                # NaN -> NaN of the other sign, same payload
    t[8] = 0x0002                # subnormal step
    base["layers.0.attn.qkv.weight"] = from_bits(b, "bf16", (16, 32))
    target["layers.0.attn.qkv.weight"] = from_bits(t, "bf16", (16, 32))

    # fp32 (64,)
    b = [int(ibits(torch.tensor([i * 0.01 - 0.3], dtype=torch.float32))[0]) for i in range(64)]
    t = list(b)
    t[0] += 1
    t[63] += 2
    t[10] ^= 0x80000000
    t[30] = 0x7F800000           # -> +Inf
    base["layers.0.mlp.fc1.weight"] = from_bits(b, "fp32", (64,))
    target["layers.0.mlp.fc1.weight"] = from_bits(t, "fp32", (64,))

    # fp8 e4m3 (4, 32): every exponent class, NaN 0x7F, both zeros
    b = [(i * 13 + 5) % 0x7E for i in range(128)]
    b[0], b[1], b[2] = 0x00, 0x80, 0x7F
    t = list(b)
    t[1] = 0x00
    t[2] = 0xFF
    t[50] = (b[50] + 1) & 0xFF
    t[90] = (b[90] - 1) & 0xFF
    for i in (13, 23, 52, 62, 81, 91, 110, 120):  # every element of class 6 changes (+1 ULP)
        t[i] = b[i] + 1
    for i, step in ((4, 1), (14, 2), (33, 5), (43, -1), (72, 1), (101, 9)):  # 6 of the 8 in class 7
        t[i] = b[i] + step
    for i, step in ((15, 3), (44, 4), (73, -3)):  # class 9: every step of at least 3 ULPs
        t[i] = b[i] + step
    base["embed.weight"] = from_bits(b, "fp8_e4m3", (4, 32))
    target["embed.weight"] = from_bits(t, "fp8_e4m3", (4, 32))

    # fp16 (16,): unchanged -> a `same` record
    b = [(0x3C00 + 7 * i) & 0xFFFF for i in range(16)]
    base["final_norm.weight"] = from_bits(b, "fp16", (16,))
    target["final_norm.weight"] = from_bits(b, "fp16", (16,))

    # fp8 e5m2 (48,): +Inf and a NaN
    b = [(i * 11 + 3) % 0x7B for i in range(48)]
    b[4], b[5] = 0x7C, 0xFD
    t = list(b)
    t[4] = 0x7B                  # +Inf -> largest finite
    t[47] = (b[47] + 1) & 0xFF
    base["lm_head.weight"] = from_bits(b, "fp8_e5m2", (48,))
    target["lm_head.weight"] = from_bits(t, "fp8_e5m2", (48,))
    return base, target


def produce(encoding: str, key: bytes | None) -> bytes:
    from nemo_dcr.codec import encode
    from nemo_dcr.codec.payload import Identity

    base, target = golden_tensors()
    return encode(base, target, Identity(**IDENTITY), encoding=encoding, key=key)


# ----------------------------------------------------------------------------- regeneration (manual only)


def regenerate() -> None:
    GOLDEN_DIR.mkdir(exist_ok=True)
    for fname, (encoding, key) in CASES.items():
        (GOLDEN_DIR / fname).write_bytes(produce(encoding, key))


@pytest.mark.skipif(os.environ.get("NEMO_DCR_REGEN_GOLDEN") != "1", reason="set NEMO_DCR_REGEN_GOLDEN=1 to rewrite")
def test_regenerate_golden_files():
    regenerate()


# ----------------------------------------------------------------------------- tests


def golden(fname: str) -> bytes:
    path = GOLDEN_DIR / fname
    assert path.exists(), f"missing {path}; see the module docstring to regenerate"
    return path.read_bytes()


@pytest.mark.parametrize("fname", sorted(CASES))
def test_encoder_output_equals_golden_bytes(fname):
    encoding, key = CASES[fname]
    got, want = produce(encoding, key), golden(fname)
    if got != want:
        first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        raise AssertionError(f"{fname}: {len(got)} bytes vs golden {len(want)}, first difference at byte {first}")


@pytest.mark.parametrize("fname", sorted(CASES))
def test_golden_preamble_and_header_by_hand(fname):
    encoding, key = CASES[fname]
    data = golden(fname)
    # the first 8 bytes spelled out
    assert data[:4] == b"NDCR"
    assert data[4:6] == b"\x01\x00"                                    # format_version u16 LE = 1
    assert data[6:8] == (b"\x01\x00" if key else b"\x00\x00")          # flags
    p = Parsed(data, key)
    assert p.h_len == int.from_bytes(data[8:16], "little") and p.h_raw == int.from_bytes(data[16:24], "little")
    assert p.comp[:4] == b"\x28\xb5\x2f\xfd"                            # a zstd frame
    assert len(p.raw) == p.h_raw
    h = p.header
    assert set(h) == {"format", "model", "run", "base_version", "target_version", "base_checksum",
                      "encodings", "records"}
    assert h["format"] == "nemo_dcr.delta"
    assert (h["model"], h["run"], h["base_version"], h["target_version"]) == (
        IDENTITY["model"], IDENTITY["run"], IDENTITY["base_version"], IDENTITY["target_version"])
    base, target = golden_tensors()
    assert [r["name"] for r in h["records"]] == list(base)
    assert [r["encoding"] for r in h["records"]] == EXPECTED_ENCODINGS[encoding]
    assert sorted(h["encodings"]) == sorted(set(EXPECTED_ENCODINGS[encoding])) == h["encodings"]
    # payload length: 24 + H + sum(lengths) (+ 32)
    assert len(data) == 24 + p.h_len + sum(r["length"] for r in h["records"]) + (32 if key else 0)
    if key:
        assert p.mac == hmac.new(key, data[:-32], hashlib.sha256).digest()
    else:
        assert p.mac == b""
    total = 0
    for r, body in zip(h["records"], p.bodies):
        t = base[r["name"]]
        dname = next(n for n, s in SPEC.items() if s[0] == t.dtype)
        assert set(r) == {"name", "dtype", "shape", "numel", "encoding", "changed", "length", "crc",
                          "base_checksum", "target_checksum", "params"}
        assert (r["dtype"], r["shape"], r["numel"]) == (dname, list(t.shape), t.numel())
        assert r["changed"] == int(np.count_nonzero(ibits(t) != ibits(target[r["name"]])))
        assert r["crc"] == hashlib.blake2b(body, digest_size=8).hexdigest()
        assert r["base_checksum"] == f"{spec_checksum(ibits(t)):016x}"
        assert r["target_checksum"] == f"{spec_checksum(ibits(target[r['name']])):016x}"
        total += int(r["base_checksum"], 16)
        if r["encoding"] == "reference":
            assert r["params"]["pos_width"] == 4
            assert body[:4] == b"\x28\xb5\x2f\xfd" and body[r["params"]["pos_len"] :][:4] == b"\x28\xb5\x2f\xfd"
        else:
            assert r["params"] == {}
        if r["encoding"] == "raw":
            nb = t.element_size()
            assert body == ibits(target[r["name"]]).astype(np.dtype(UINT[nb * 8]).newbyteorder("<")).tobytes()
    assert h["base_checksum"] == f"{total % 2**64:016x}"


@pytest.mark.parametrize("fname", sorted(CASES))
def test_golden_decodes_to_target_with_independent_reader(fname):
    _, key = CASES[fname]
    p = Parsed(golden(fname), key)
    base, target = golden_tensors()
    for r, body in zip(p.header["records"], p.bodies):
        b, t = ibits(base[r["name"]]), ibits(target[r["name"]])
        changes = spec_decode_record(r, body, [int(x) for x in b])
        got = b.copy()
        for i, v in changes.items():
            assert v != b[i]
            got[i] = v
        assert len(changes) == r["changed"]
        assert np.array_equal(got, t), r["name"]


@pytest.mark.parametrize("fname", sorted(CASES))
def test_golden_decodes_and_applies_with_codec(fname):
    from nemo_dcr.codec import apply, decode, inspect

    _, key = CASES[fname]
    data = golden(fname)
    base, target = golden_tensors()
    snap = {k: ibits(v) for k, v in base.items()}
    hdr = inspect(data, key=key)
    assert (hdr.base_version, hdr.target_version) == (41, 42)
    decode(data, base, key=key)
    for k in base:
        assert np.array_equal(ibits(base[k]), snap[k])
    touched = apply(base, data, key=key)
    want = {k: int(np.count_nonzero(snap[k] != ibits(target[k]))) for k in base}
    assert touched == {k: v for k, v in want.items() if v}
    for k in base:
        assert np.array_equal(ibits(base[k]), ibits(target[k])), k


def test_golden_files_differ_only_where_expected():
    """The HMAC file is the dcr file with flag bit 0 and a MAC appended, nothing else."""
    plain, auth = golden("golden_dcr.bin"), golden("golden_dcr_hmac.bin")
    assert auth[:6] == plain[:6] and auth[8:-32] == plain[8:]
    assert auth[6:8] == b"\x01\x00" and plain[6:8] == b"\x00\x00"


def test_golden_dcr_covers_the_coding():
    """The golden dcr records use every part of section 4.4 the reference encoder can produce."""
    p = Parsed(golden("golden_dcr.bin"), None)
    base, _ = golden_tensors()
    seen = set()
    for r, body in zip(p.header["records"], p.bodies):
        if r["encoding"] == "dcr":
            _, nbits, shift, ebits = SPEC[r["dtype"]]
            spec_decode_dcr(body, [int(x) for x in ibits(base[r["name"]])], nbits, shift, ebits, seen)
    assert {"set", "complement_set", "full_set", "set_k=0", "set_k>0", "groups>1", "m_off=0", "m_off>0",
            "k_val>0", "mixed_signs", "literal"} <= seen, seen
