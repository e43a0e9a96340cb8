"""Corrupted, truncated and malicious payloads (docs/wire_format.md rules 1-13, section 4).

Each case must raise the exception class the spec lists for the rule it breaks, and leave every
receiver tensor bit-identical to before the call (compared via integer views of a snapshot).
Payloads are taken apart and re-built here with ``struct``/``zstandard``/``json``/``hashlib``
only, so a malformed payload does not depend on the codec's own writer.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import hmac
import importlib.util
import json
import random
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
import zstandard

from nemo_dcr.codec import apply, decode, encode, header_limit, inspect
from nemo_dcr.codec.errors import (
    AuthenticationError,
    BadMagicError,
    BaseChecksumMismatchError,
    DeltaFormatError,
    DtypeMismatchError,
    HeaderTooLargeError,
    LimitExceededError,
    MalformedHeaderError,
    MalformedRecordError,
    MissingTensorError,
    PositionOutOfBoundsError,
    RecordChecksumError,
    ShapeMismatchError,
    TargetChecksumMismatchError,
    TrailingBytesError,
    TruncatedPayloadError,
    UnknownEncodingError,
    UnknownFlagsError,
    UnsupportedVersionError,
)

KEY = b"corrupt-test-key-0123456789abcdef"
OTHER_KEY = b"corrupt-test-key-0123456789abcdeF"
PRE = struct.Struct("<4sHHQQ")
MAX_HEADER = 64 << 20
ENCODINGS = ("dcr", "reference", "raw")
KEYS = {"plain": None, "hmac": KEY}

# wire dtype -> (bits, exponent shift, exponent bits), spec section 4.4
SPEC = {"bf16": (16, 7, 8), "fp16": (16, 10, 5), "fp32": (32, 23, 8), "fp8_e4m3": (8, 3, 4), "fp8_e5m2": (8, 2, 5)}
INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
SIGNED = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}


# ----------------------------------------------------------------------------- tensors and fixtures


def ibits(t: torch.Tensor) -> np.ndarray:
    w = t.element_size()
    return t.contiguous().reshape(-1).view(INT_VIEW[w]).numpy().view(UINT[w]).copy()


def from_bits(bits: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    w = like.element_size()
    arr = np.ascontiguousarray(bits, dtype=UINT[w]).view(SIGNED[w]).copy()
    return torch.from_numpy(arr).view(like.dtype).reshape(like.shape)


@functools.lru_cache(maxsize=None)
def _tensors():
    g = torch.Generator().manual_seed(1234)
    base = {
        "a.bf16": (torch.randn(32, 64, generator=g) * 0.02).to(torch.bfloat16),
        "b.fp32": torch.randn(500, generator=g) * 0.1,
        "c.fp8": torch.randn(16, 40, generator=g).to(torch.float8_e4m3fn),
        "d.same": torch.randn(10, generator=g).to(torch.float16),
    }
    rng = np.random.default_rng(99)
    target = {}
    for name, t in base.items():
        b = ibits(t)
        if name != "d.same":
            pos = np.sort(rng.choice(b.size, max(3, b.size // 40), replace=False))
            new = b.copy()
            mod = 1 << (8 * t.element_size())
            new[pos] = ((b[pos].astype(np.int64) + rng.choice([-2, -1, 1, 2], pos.size)) % mod).astype(b.dtype)
            b = new
        target[name] = from_bits(b, t)
    return base, target


def fresh_base() -> dict:
    return {k: v.clone() for k, v in _tensors()[0].items()}


def target_tensors() -> dict:
    return _tensors()[1]


@functools.lru_cache(maxsize=None)
def payload(encoding: str, keyname: str = "plain") -> bytes:
    base, target = _tensors()
    data = encode(base, target, encoding=encoding, key=KEYS[keyname])
    encs = [r.encoding for r in inspect(data, key=KEYS[keyname]).records]
    assert encs == [encoding] * 3 + ["same"], encs  # the fixture really exercises the encoding
    return data


# ----------------------------------------------------------------------------- taking payloads apart


class Parts:
    """A payload taken apart with struct/zstd/json (no codec code)."""

    def __init__(self, data: bytes):
        self.magic, self.version, self.flags, self.h_len, self.h_raw = PRE.unpack_from(data)
        self.comp = data[24 : 24 + self.h_len]
        self.obj = json.loads(zstandard.ZstdDecompressor().decompress(self.comp))
        self.bodies, off = [], 24 + self.h_len
        self.bounds = [0, 4, 6, 8, 16, 24, 24 + self.h_len]
        for r in self.obj["records"]:
            self.bodies.append(data[off : off + r["length"]])
            off += r["length"]
            self.bounds.append(off)
        self.end = off
        self.mac = data[off:]

    def record(self, name: str) -> dict:
        return next(r for r in self.obj["records"] if r["name"] == name)

    def index(self, name: str) -> int:
        return [r["name"] for r in self.obj["records"]].index(name)


def crc(body: bytes) -> str:
    return hashlib.blake2b(body, digest_size=8).hexdigest()


def build(obj, bodies, key=None, *, version=1, flags=None, raw=None, comp=None, raw_len=None, fix=True,
          magic=b"NDCR") -> bytes:
    """Re-pack a payload; ``fix`` recomputes record lengths and crcs from ``bodies``."""
    if fix:
        for r, b in zip(obj["records"], bodies):
            r["length"] = len(b)
            r["crc"] = crc(b)
    if raw is None:
        raw = json.dumps(obj, separators=(",", ":")).encode()
    if comp is None:
        comp = zstandard.ZstdCompressor(level=3).compress(raw)
    flags = (1 if key else 0) if flags is None else flags
    out = PRE.pack(magic, version, flags, len(comp), len(raw) if raw_len is None else raw_len) + comp
    out += b"".join(bodies)
    return out + hmac.new(key, out, hashlib.sha256).digest() if key else out


def with_body(data: bytes, name: str, body: bytes, key=None, edit=None) -> bytes:
    """``data`` with the body of record ``name`` replaced (length and crc recomputed)."""
    p = Parts(data)
    obj, bodies = copy.deepcopy(p.obj), list(p.bodies)
    bodies[p.index(name)] = body
    if edit:
        edit(next(r for r in obj["records"] if r["name"] == name))
    return build(obj, bodies, key)


def with_header(data: bytes, edit, key=None, **kw) -> bytes:
    p = Parts(data)
    obj = copy.deepcopy(p.obj)
    obj = edit(obj) or obj
    return build(obj, list(p.bodies), key, **kw)


# ----------------------------------------------------------------------------- the check


def expect(exc, data, key=None, receiver=None, also_decode=True):
    """``apply`` raises exactly ``exc`` (or a subclass when ``exc`` is DeltaFormatError), writes nothing."""
    recv = fresh_base() if receiver is None else receiver
    snap = {k: ibits(v) for k, v in recv.items()}
    calls = [apply] + ([decode] if also_decode else [])
    for fn in calls:
        with pytest.raises(DeltaFormatError) as info:
            if fn is apply:
                fn(recv, data, key=key)
            else:
                fn(data, recv, key=key)
        if exc is DeltaFormatError:
            assert isinstance(info.value, DeltaFormatError)
        else:
            assert type(info.value) is exc, f"{fn.__name__}: expected {exc.__name__}, got {info.value!r}"
        for k in snap:
            assert np.array_equal(ibits(recv[k]), snap[k]), f"{k} was written by a failed {fn.__name__}"
    return info.value


def apply_ok(data, key=None, receiver=None):
    recv = fresh_base() if receiver is None else receiver
    apply(recv, data, key=key)
    for k, t in target_tensors().items():
        assert np.array_equal(ibits(recv[k]), ibits(t)), k


def outcome_is_safe(data, key=None):
    """Either a DeltaFormatError with nothing written, or success with exactly the target."""
    recv = fresh_base()
    snap = {k: ibits(v) for k, v in recv.items()}
    try:
        apply(recv, data, key=key)
    except DeltaFormatError as e:
        for k in snap:
            assert np.array_equal(ibits(recv[k]), snap[k]), f"{k} written before {e!r}"
        return type(e)
    for k, t in target_tensors().items():
        assert np.array_equal(ibits(recv[k]), ibits(t)), f"silent corruption of {k}"
    return None


def test_fixture_payloads_are_valid():
    for enc in ENCODINGS:
        for keyname, key in KEYS.items():
            apply_ok(payload(enc, keyname), key)
    # and the re-packer reproduces a valid payload
    p = Parts(payload("dcr"))
    apply_ok(build(copy.deepcopy(p.obj), list(p.bodies)))
    apply_ok(build(copy.deepcopy(p.obj), list(p.bodies), KEY), KEY)


# ----------------------------------------------------------------------------- truncation, flips, keys

COMBOS = [(e, k) for e in ENCODINGS for k in KEYS]


@pytest.mark.parametrize("encoding,keyname", COMBOS)
def test_truncation_at_every_boundary_and_random_points(encoding, keyname):
    data, key = payload(encoding, keyname), KEYS[keyname]
    p = Parts(data)
    rng = random.Random(7)
    cuts = set(p.bounds) | {len(data) - 32, len(data) - 1, 1, 2, 3} | {rng.randrange(len(data)) for _ in range(25)}
    for k in sorted(c for c in cuts if 0 <= c < len(data)):
        cut = data[:k]
        if key is not None and k >= 24 and k - 32 >= 24 + p.h_len:
            exc = AuthenticationError  # the MAC is checked before anything after the preamble
        else:
            exc = TruncatedPayloadError
        expect(exc, cut, key)
        if k >= 24 and key is None:
            with pytest.raises(TruncatedPayloadError):
                inspect(cut)


@pytest.mark.parametrize("encoding,keyname", COMBOS)
def test_preamble_bit_flips(encoding, keyname):
    data, key = payload(encoding, keyname), KEYS[keyname]
    p = Parts(data)
    for bit in range(24 * 8):
        byte = bit // 8
        mutant = bytearray(data)
        mutant[byte] ^= 1 << (bit % 8)
        mutant = bytes(mutant)
        _, version, flags, h_len, h_raw = PRE.unpack_from(mutant)
        if byte < 4:
            exc = BadMagicError
        elif byte < 6:
            exc = UnsupportedVersionError
        elif byte < 8:
            exc = AuthenticationError if flags ^ p.flags == 1 else UnknownFlagsError
        elif byte < 16:
            if 24 + h_len > len(mutant) or (key is not None and len(mutant) - 32 < 24 + h_len):
                exc = TruncatedPayloadError
            else:
                exc = AuthenticationError if key is not None else DeltaFormatError
        else:
            if h_raw > min(MAX_HEADER, header_limit(fresh_base())):  # the receiver's bound (rule 3)
                exc = HeaderTooLargeError
            else:
                exc = AuthenticationError if key is not None else MalformedHeaderError
        expect(exc, mutant, key, also_decode=False)


@pytest.mark.parametrize("encoding,keyname", COMBOS)
def test_header_body_and_mac_bit_flips(encoding, keyname):
    data, key = payload(encoding, keyname), KEYS[keyname]
    p = Parts(data)
    rng = random.Random(f"{encoding}/{keyname}")

    def flipped(bitpos):
        m = bytearray(data)
        m[bitpos // 8] ^= 1 << (bitpos % 8)
        return bytes(m)

    # header: with a MAC, AuthenticationError; without, any DeltaFormatError or (if the flip only hit
    # free text such as padding of the frame) exactly the target - never anything else
    for _ in range(40):
        m = flipped(rng.randrange(24 * 8, (24 + p.h_len) * 8))
        if key is not None:
            expect(AuthenticationError, m, key, also_decode=False)
        else:
            outcome_is_safe(m)
    # record bodies: RecordChecksumError, unless the MAC catches it first
    for i, r in enumerate(p.obj["records"]):
        if not r["length"]:
            continue
        start = p.bounds[6 + i] * 8
        for _ in range(15):
            m = flipped(rng.randrange(start, start + r["length"] * 8))
            err = expect(AuthenticationError if key else RecordChecksumError, m, key, also_decode=False)
            if key is None:
                assert err.record == r["name"]
    # the MAC itself
    if key is not None:
        for _ in range(20):
            expect(AuthenticationError, flipped(rng.randrange((len(data) - 32) * 8, len(data) * 8)), key,
                   also_decode=False)


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_keys_wrong_missing_unexpected(encoding):
    plain, auth = payload(encoding), payload(encoding, "hmac")
    expect(AuthenticationError, auth, OTHER_KEY)   # wrong key
    expect(AuthenticationError, auth, None)        # missing key
    expect(AuthenticationError, plain, KEY)        # unexpected key (payload has no MAC)
    # stripping the MAC and clearing the flag does not get past a keyed receiver
    stripped = bytearray(auth[:-32])
    stripped[6] = 0
    expect(AuthenticationError, bytes(stripped), KEY)
    # a MAC over the right bytes with another key
    forged = auth[:-32] + hmac.new(OTHER_KEY, auth[:-32], hashlib.sha256).digest()
    expect(AuthenticationError, forged, KEY)
    # keys shorter than 16 bytes are refused as an API error, before anything is written
    recv = fresh_base()
    with pytest.raises(ValueError):
        apply(recv, auth, key=b"short")
    apply_ok(auth, KEY)


@pytest.mark.parametrize("keyname", KEYS)
def test_version_flags_magic_trailing(keyname):
    key = KEYS[keyname]
    data = payload("dcr", keyname)
    p = Parts(data)

    def pre(**kw):
        vals = dict(magic=p.magic, version=p.version, flags=p.flags, h_len=p.h_len, h_raw=p.h_raw)
        vals.update(kw)
        m = PRE.pack(vals["magic"], vals["version"], vals["flags"], vals["h_len"], vals["h_raw"]) + data[24:]
        return m

    for v in (0, 2, 0x100, 0xFFFF):
        expect(UnsupportedVersionError, pre(version=v), key)
    for f in (2, 4, 0x8000, 0xFFFE):
        expect(UnknownFlagsError, pre(flags=p.flags | f), key)
    for magic in (b"NDCS", b"ndcr", b"\x00\x00\x00\x00", b"PK\x03\x04"):
        expect(BadMagicError, pre(magic=magic), key)
    expect(BadMagicError, b"XY", key)
    expect(TruncatedPayloadError, b"ND", key)
    expect(TruncatedPayloadError, b"", key)
    expect(HeaderTooLargeError, pre(h_raw=MAX_HEADER + 1), key)
    # trailing bytes: outside the MAC they break the MAC; inside a valid MAC they are TrailingBytesError
    expect(AuthenticationError if key else TrailingBytesError, data + b"\x00", key)
    if key:
        body = data[:-32] + b"\x00"
        expect(TrailingBytesError, body + hmac.new(key, body, hashlib.sha256).digest(), key)
    else:
        expect(TrailingBytesError, data + b"extra bytes", key)


# ----------------------------------------------------------------------------- header re-packing


def _del(key):
    def f(o):
        del o[key]
    return f


def _set(key, value):
    def f(o):
        o[key] = value
    return f


def _rec(fn, i=0):
    def f(o):
        fn(o["records"][i])
    return f


def _fix_sum(o):
    o["base_checksum"] = f"{sum(int(r['base_checksum'], 16) for r in o['records']) % 2**64:016x}"


HEADER_KEYS = ["format", "model", "run", "base_version", "target_version", "base_checksum", "encodings", "records"]
RECORD_KEYS = ["name", "dtype", "shape", "numel", "encoding", "changed", "length", "crc", "base_checksum",
               "target_checksum", "params"]
HEADER_CASES = {
    "unknown_top_key": (_set("comment", "hi"), MalformedHeaderError),
    "unknown_record_key": (_rec(_set("zstd_level", 3)), MalformedHeaderError),
    **{f"missing_{k}": (_del(k), MalformedHeaderError) for k in HEADER_KEYS},
    **{f"missing_record_{k}": (_rec(_del(k)), MalformedHeaderError) for k in RECORD_KEYS},
    "format_int": (_set("format", 1), MalformedHeaderError),
    "format_other": (_set("format", "nemo_dcr.delta2"), MalformedHeaderError),
    "model_null": (_set("model", None), MalformedHeaderError),
    "run_int": (_set("run", 5), MalformedHeaderError),
    "base_version_str": (_set("base_version", "0"), MalformedHeaderError),
    "base_version_bool": (_set("base_version", False), MalformedHeaderError),
    "base_version_negative": (lambda o: o.update(base_version=-1, target_version=0), MalformedHeaderError),
    "target_version_float": (_set("target_version", 1.0), MalformedHeaderError),
    "target_version_bool": (_set("target_version", True), MalformedHeaderError),
    "versions_equal": (lambda o: o.update(base_version=3, target_version=3), MalformedHeaderError),
    "versions_decrease": (lambda o: o.update(base_version=4, target_version=3), MalformedHeaderError),
    "base_checksum_int": (_set("base_checksum", 0), MalformedHeaderError),
    "base_checksum_wrong": (lambda o: o.update(base_checksum=f"{(int(o['base_checksum'], 16) + 1) % 2**64:016x}"),
                            MalformedHeaderError),
    "base_checksum_upper": (lambda o: o.update(base_checksum=o["base_checksum"].upper()), MalformedHeaderError),
    "base_checksum_short": (lambda o: o.update(base_checksum=o["base_checksum"][1:]), MalformedHeaderError),
    "encodings_str": (_set("encodings", "dcr"), MalformedHeaderError),
    "encodings_items_int": (_set("encodings", [1]), MalformedHeaderError),
    "records_dict": (_set("records", {}), MalformedHeaderError),
    "record_not_object": (lambda o: o["records"].__setitem__(0, ["a.bf16"]), MalformedHeaderError),
    "record_name_int": (_rec(_set("name", 1)), MalformedHeaderError),
    "record_dtype_null": (_rec(_set("dtype", None)), MalformedHeaderError),
    "record_dtype_unknown": (_rec(_set("dtype", "fp64")), MalformedHeaderError),
    "record_dtype_torch_name": (_rec(_set("dtype", "bfloat16")), MalformedHeaderError),
    "record_shape_str": (_rec(_set("shape", "32,64")), MalformedHeaderError),
    "record_shape_float": (_rec(_set("shape", [32.0, 64])), MalformedHeaderError),
    "record_shape_bool": (_rec(lambda r: r.update(shape=[True, 2048], numel=2048)), MalformedHeaderError),
    "record_shape_negative": (_rec(lambda r: r.update(shape=[-32, -64])), MalformedHeaderError),
    "record_shape_9_dims": (_rec(lambda r: r.update(shape=[1] * 8 + [2048])), LimitExceededError),
    "record_numel_str": (_rec(_set("numel", "2048")), MalformedHeaderError),
    "record_numel_wrong": (_rec(_set("numel", 2047)), MalformedHeaderError),
    "record_numel_huge": (_rec(lambda r: r.update(shape=[2**31, 2**31], numel=2**62)), MalformedHeaderError),
    "record_encoding_int": (_rec(_set("encoding", 3)), MalformedHeaderError),
    "record_changed_float": (_rec(lambda r: r.update(changed=float(r["changed"]))), MalformedHeaderError),
    "record_changed_negative": (_rec(_set("changed", -1)), MalformedHeaderError),
    "record_changed_over_numel": (_rec(_set("changed", 2049)), MalformedHeaderError),
    "record_length_str": (_rec(lambda r: r.update(length=str(r["length"]))), MalformedHeaderError),
    "record_length_negative": (_rec(_set("length", -1)), MalformedHeaderError),
    "record_crc_int": (_rec(_set("crc", 0)), MalformedHeaderError),
    "record_crc_short": (_rec(lambda r: r.update(crc=r["crc"][:15])), MalformedHeaderError),
    "record_target_checksum_null": (_rec(_set("target_checksum", None)), MalformedHeaderError),
    "record_target_checksum_nonhex": (_rec(_set("target_checksum", "z" * 16)), MalformedHeaderError),
    "record_params_list": (_rec(_set("params", [])), MalformedHeaderError),
    "duplicate_names": (lambda o: o["records"][1].update(name=o["records"][0]["name"]), MalformedHeaderError),
    "too_many_records": (lambda o: o.update(records=[0] * 1_000_001), LimitExceededError),
    "top_level_list": (lambda o: [o], MalformedHeaderError),
    "top_level_string": (lambda o: "nemo_dcr.delta", MalformedHeaderError),
}


def expect_header(exc, data, key):
    """``inspect`` (no receiver) raises ``exc``; a receiver refuses a header larger than its bound
    (rule 3) before parsing it, so ``apply``/``decode`` raise ``HeaderTooLargeError`` for those."""
    with pytest.raises(exc):
        inspect(data, key=key)
    too_large = PRE.unpack_from(data)[4] > header_limit(fresh_base())
    expect(HeaderTooLargeError if too_large else exc, data, key)


@pytest.mark.parametrize("case", sorted(HEADER_CASES))
@pytest.mark.parametrize("keyname", KEYS)
def test_malformed_headers(case, keyname):
    edit, exc = HEADER_CASES[case]
    key = KEYS[keyname]
    data = with_header(payload("dcr"), edit, key, fix=False)
    expect_header(exc, data, key)


@pytest.mark.parametrize("keyname", KEYS)
def test_header_frame_problems(keyname):
    key = KEYS[keyname]
    p = Parts(payload("reference"))
    raw = json.dumps(p.obj, separators=(",", ":")).encode()
    bodies = list(p.bodies)
    z = zstandard.ZstdCompressor(level=3)
    # raw length off by one either way
    expect(MalformedHeaderError, build(copy.deepcopy(p.obj), bodies, key, raw=raw, raw_len=len(raw) - 1), key)
    expect(MalformedHeaderError, build(copy.deepcopy(p.obj), bodies, key, raw=raw, raw_len=len(raw) + 1), key)
    expect(MalformedHeaderError, build(copy.deepcopy(p.obj), bodies, key, raw=raw, raw_len=0), key)
    # not a zstd frame / truncated frame
    expect(MalformedHeaderError, build(copy.deepcopy(p.obj), bodies, key, raw=raw, comp=raw), key)
    comp = z.compress(raw)
    expect(MalformedHeaderError, build(copy.deepcopy(p.obj), bodies, key, raw=raw, comp=comp[:-3]), key)
    # not UTF-8, not JSON
    for bad in (b"\xff\xfe" + raw, b"{not json", b"", b"null", b"[]", b'"str"', b"1"):
        expect(MalformedHeaderError, build(copy.deepcopy(p.obj), bodies, key, raw=bad), key)
    # the declared raw length is a limit: a frame that inflates beyond it is refused, and so is a
    # declared length over 64 MiB
    big = raw + b" " * 100
    expect(MalformedHeaderError, build(copy.deepcopy(p.obj), bodies, key, raw=raw, comp=z.compress(big)), key)
    expect(HeaderTooLargeError, build(copy.deepcopy(p.obj), bodies, key, raw=raw, comp=comp, raw_len=MAX_HEADER + 1),
           key)
    # valid header with padding whitespace is still fine (JSON allows it)
    apply_ok(build(copy.deepcopy(p.obj), bodies, key, raw=b"  " + raw + b"\n"), key)


@pytest.mark.parametrize("keyname", KEYS)
def test_header_section_with_bytes_after_the_frame(keyname):
    """Rule 3: the header section is exactly one zstd frame; nothing may follow it inside header_len."""
    key = KEYS[keyname]
    p = Parts(payload("dcr"))
    raw = json.dumps(p.obj, separators=(",", ":")).encode()
    z = zstandard.ZstdCompressor(level=3)
    for after in (b"smuggled bytes", b"\x00", z.compress(b""), z.compress(b" ")):
        expect(MalformedHeaderError, build(copy.deepcopy(p.obj), list(p.bodies), key, raw=raw,
                                           comp=z.compress(raw) + after), key)
    # the JSON split over two frames (each part alone is not the header): refused as well
    half = len(raw) // 2
    expect(MalformedHeaderError, build(copy.deepcopy(p.obj), list(p.bodies), key, raw=raw,
                                       comp=z.compress(raw[:half]) + z.compress(raw[half:])), key)


def _huge_content_size(frame: bytes) -> bytes:
    """The same zstd frame, but its header declares a content size of about 2**62 bytes."""
    assert frame[:4] == b"\x28\xb5\x2f\xfd"
    fhd = frame[4]
    fcs_len = {0: 1 if fhd & 0x20 else 0, 1: 2, 2: 4, 3: 8}[fhd >> 6]
    wd_len = 0 if fhd & 0x20 else 1
    dict_len = {0: 0, 1: 1, 2: 2, 3: 4}[fhd & 3]
    head = 5 + wd_len + dict_len
    new_fhd = (fhd & 0x3F) | 0xC0  # 8-byte Frame_Content_Size
    return frame[:4] + bytes([new_fhd]) + frame[5:head] + (2**62).to_bytes(8, "little") + frame[head + fcs_len :]


def test_huge_content_size_helper_declares_what_it_says():
    frame = zstandard.ZstdCompressor(level=3).compress(b"x" * 1000)
    assert zstandard.get_frame_parameters(_huge_content_size(frame)).content_size == 2**62


@pytest.mark.parametrize("keyname", KEYS)
def test_header_frame_declaring_huge_content_size(keyname):
    """The declared content size is checked before anything is allocated (found by the fuzzer)."""
    key = KEYS[keyname]
    p = Parts(payload("dcr"))
    raw = json.dumps(p.obj, separators=(",", ":")).encode()
    comp = _huge_content_size(zstandard.ZstdCompressor(level=3).compress(raw))
    expect(MalformedHeaderError, build(copy.deepcopy(p.obj), list(p.bodies), key, raw=raw, comp=comp), key)
    # ... also when header_raw_len declares the same huge size (then it is over the 64 MiB limit)
    expect(HeaderTooLargeError, build(copy.deepcopy(p.obj), list(p.bodies), key, raw=raw, comp=comp,
                                      raw_len=2**62), key)


def test_reference_section_declaring_huge_content_size():
    """Section 4.3 frames: the declared content size is checked before anything is allocated."""
    b, t, gaps, xor, nbits = _ref_fixture("b.fp32")
    body, params = ref_body(gaps, xor, 4, nbits)
    pos = _huge_content_size(body[: params["pos_len"]])
    body2 = pos + body[params["pos_len"] :]
    params2 = dict(params, pos_len=len(pos))
    expect(MalformedRecordError, with_body(payload("reference"), "b.fp32", body2,
                                           edit=lambda r: r.update(params=params2)))


@pytest.mark.parametrize("keyname", KEYS)
def test_header_deeply_nested_json(keyname):
    """json.loads' RecursionError is a MalformedHeaderError, not an escaping exception."""
    key = KEYS[keyname]
    for raw in (b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 100_000 + b"1" + b"}" * 100_000):
        expect_header(MalformedHeaderError, build({"records": []}, [], key, raw=raw), key)
    # nested deep inside an otherwise valid header
    p = Parts(payload("dcr"))
    raw = json.dumps(p.obj, separators=(",", ":")).encode()
    raw = raw.replace(b'"run":""', b'"run":' + b"[" * 100_000 + b"]" * 100_000, 1)
    expect_header(MalformedHeaderError, build(copy.deepcopy(p.obj), list(p.bodies), key, raw=raw), key)


@pytest.mark.parametrize("keyname", KEYS)
def test_header_integer_with_too_many_digits(keyname):
    """json.loads' ValueError for integers over 4300 digits is a MalformedHeaderError."""
    key = KEYS[keyname]
    p = Parts(payload("dcr"))
    raw = json.dumps(p.obj, separators=(",", ":")).encode()
    for field in (b'"target_version":1', b'"numel":'):
        assert field in raw
        bad = raw.replace(field, field + b"1" + b"0" * 5000, 1)
        expect(MalformedHeaderError, build(copy.deepcopy(p.obj), list(p.bodies), key, raw=bad), key)


@pytest.mark.parametrize("keyname", KEYS)
def test_record_lengths_and_order(keyname):
    key = KEYS[keyname]
    p = Parts(payload("dcr"))
    last = max(i for i, r in enumerate(p.obj["records"]) if r["length"])
    # the last body one byte shorter than declared (crc of the shorter body): one trailing byte
    obj = copy.deepcopy(p.obj)
    obj["records"][last]["length"] -= 1
    obj["records"][last]["crc"] = crc(p.bodies[last][:-1])
    expect(TrailingBytesError, build(obj, list(p.bodies), key, fix=False), key)
    # one byte longer than the payload holds
    obj = copy.deepcopy(p.obj)
    obj["records"][last]["length"] += 1
    expect(TruncatedPayloadError, build(obj, list(p.bodies), key, fix=False), key)
    # a huge length
    obj = copy.deepcopy(p.obj)
    obj["records"][0]["length"] = 2**62
    expect(TruncatedPayloadError, build(obj, list(p.bodies), key, fix=False), key)
    # records listed in another order than the bodies: crc mismatch on the first swapped body
    obj = copy.deepcopy(p.obj)
    obj["records"][0], obj["records"][1] = obj["records"][1], obj["records"][0]
    expect(RecordChecksumError, build(obj, list(p.bodies), key, fix=False), key)
    # ... and consistent when the bodies are reordered too
    obj = copy.deepcopy(p.obj)
    obj["records"].reverse()
    apply_ok(build(obj, list(reversed(p.bodies)), key, fix=False), key)
    # a record dropped (with its body): the base checksum sum no longer matches
    obj = copy.deepcopy(p.obj)
    del obj["records"][0]
    expect(MalformedHeaderError, build(obj, list(p.bodies[1:]), key), key)
    # ... fixed sum: valid payload that changes only the other tensors
    _fix_sum(obj)
    recv = fresh_base()
    apply(recv, build(obj, list(p.bodies[1:]), key), key=key)
    assert np.array_equal(ibits(recv["a.bf16"]), ibits(_tensors()[0]["a.bf16"]))
    assert np.array_equal(ibits(recv["b.fp32"]), ibits(target_tensors()["b.fp32"]))


# ----------------------------------------------------------------------------- receiver mismatches


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_receiver_mismatches(encoding):
    data = payload(encoding)
    last = "c.fp8"  # the last record with changes; earlier records are valid and must not be written
    recv = fresh_base()
    del recv[last]
    expect(MissingTensorError, data, receiver=recv)
    recv = fresh_base()
    recv[last] = recv[last].view(torch.uint8).view(torch.float8_e5m2)  # same bits, other dtype
    expect(DtypeMismatchError, data, receiver=recv)
    recv = fresh_base()
    recv[last] = recv[last].reshape(40, 16).clone()
    expect(ShapeMismatchError, data, receiver=recv)
    recv = fresh_base()
    recv[last] = recv[last].reshape(-1).clone()
    expect(ShapeMismatchError, data, receiver=recv)
    # the base differs in one element (one bit) of one tensor
    for name in ("a.bf16", last, "d.same"):
        for pos in (0, 7):
            recv = fresh_base()
            b = ibits(recv[name])
            b[pos] ^= 1
            recv[name] = from_bits(b, recv[name])
            err = expect(BaseChecksumMismatchError, data, receiver=recv)
            assert err.record == name
    # a receiver that already holds the target
    recv = {k: v.clone() for k, v in target_tensors().items()}
    expect(BaseChecksumMismatchError, data, receiver=recv)
    # a record naming a tensor the receiver does not have (header rewritten, everything else valid)
    expect(MissingTensorError, with_header(data, _rec(_set("name", "not.there"), 2)))


@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int32, torch.float64, torch.bool])
def test_receiver_tensor_of_unsupported_dtype(encoding, dtype):
    """Rule 9: a receiver tensor of a dtype outside the table is a DtypeMismatchError, nothing written."""
    recv = fresh_base()
    recv["c.fp8"] = torch.zeros(16, 40, dtype=dtype)
    err = expect(DtypeMismatchError, payload(encoding), receiver=recv)
    assert err.record == "c.fp8"
    recv = fresh_base()
    recv["d.same"] = torch.zeros(10, dtype=dtype)  # also for a record without changes
    expect(DtypeMismatchError, payload(encoding), receiver=recv)


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_apply_is_all_or_nothing_with_a_non_contiguous_tensor(encoding):
    """Rule 13: a target that cannot be written in place (here the last record's, not contiguous) is
    refused before any tensor is written. It is an API error (ValueError naming the tensor), not a
    format error: the payload itself is valid, and ``decode`` (which writes nothing) accepts it."""
    recv = fresh_base()
    storage = torch.zeros(16, 80, dtype=torch.float8_e4m3fn)
    storage.view(torch.uint8)[:, ::2] = recv["c.fp8"].view(torch.uint8)
    recv["c.fp8"] = storage[:, ::2]  # same values, not contiguous
    assert not recv["c.fp8"].is_contiguous()
    snap = {k: ibits(v) for k, v in recv.items()}
    snap_storage = storage.view(torch.uint8).clone()
    decoded = decode(payload(encoding), recv)
    assert [d.name for d in decoded.deltas if d.nnz] == ["a.bf16", "b.fp32", "c.fp8"]
    with pytest.raises(ValueError, match="c.fp8") as info:
        apply(recv, payload(encoding))
    assert not isinstance(info.value, DeltaFormatError)
    for k in snap:
        assert np.array_equal(ibits(recv[k]), snap[k]), f"{k} written before the failure"
    assert torch.equal(storage.view(torch.uint8), snap_storage)


# ----------------------------------------------------------------------------- crafted record bodies


def _key(b: int, nbits: int) -> int:
    sign, ones = 1 << (nbits - 1), (1 << nbits) - 1
    return (~b & ones) if b & sign else (b | sign)


def _unkey(k: int, nbits: int) -> int:
    sign, ones = 1 << (nbits - 1), (1 << nbits) - 1
    return (k & ~sign & ones) if k & sign else (~k & ones)


def _step(old: int, new: int, nbits: int) -> int:
    """``d`` of section 4.4: the key step in the magnitude direction (> 0 moves away from zero)."""
    s = _key(new, nbits) - _key(old, nbits)
    return -s if old & (1 << (nbits - 1)) else s


def _stepped(old: int, d: int, nbits: int) -> int:
    """New bits of ``old`` moved by ``d`` (inverse of :func:`_step`)."""
    s = -d if old & (1 << (nbits - 1)) else d
    return _unkey((_key(old, nbits) + s) % (1 << nbits), nbits)


def _varint(v: int) -> bytes:
    out = bytearray()
    while True:
        b, v = v & 0x7F, v >> 7
        out.append(b | (0x80 if v else 0))
        if not v:
            return bytes(out)


def _rice(values, k):
    q, r = [], []
    for v in values:
        q += [0] * (v >> k) + [1]
        r += [(v >> (k - 1 - j)) & 1 for j in range(k)]
    return q, r


def set_k(m: int, size: int) -> int:
    """Rice parameter of a coded set, from the counts (section 4.4)."""
    return max(0, ((((size - m) // m) * 45426) >> 16).bit_length() - 1)


def coded_set(members, size: int) -> dict | None:
    """The stream item of a subset ``members`` (sorted) of ``range(size)``: None when nothing is written."""
    members = [int(x) for x in members]
    if len(members) in (0, size):
        return None
    side = members if 2 * len(members) <= size else sorted(set(range(size)) - set(members))
    gaps = [r - p - 1 for p, r in zip([-1] + side[:-1], side)]
    return {"gaps": gaps, "k": set_k(len(side), size), "members": members, "size": size}


def group_members(base_bits: np.ndarray, dtype: str, lo: int, widths: list[int]) -> list[np.ndarray]:
    """Flat positions of each group's elements, ordered by class then flat index (rank = index)."""
    _, shift, ebits = SPEC[dtype]
    cls = (base_bits.astype(np.int64) >> shift) & ((1 << ebits) - 1)
    order = np.lexsort((np.arange(cls.size), cls))
    out, c = [], lo
    for w in widths:
        out.append(order[(cls[order] >= c) & (cls[order] < c + w)])
        c += w
    return out


def dcr_parts(base_bits: np.ndarray, target_bits: np.ndarray, dtype: str, k_val=1, grouping="per_class",
              lo=None, widths=None, step_order="position") -> dict:
    """A dcr body, from the spec (section 4.4), as editable parts.

    ``grouping``: ``per_class`` (one group per class from the lowest to the highest changed class),
    ``one`` (one group over that range) or ``all`` (one group over every class); or explicit
    ``lo``/``widths``. ``k_val``: the Rice parameter of the step values, one for all groups or a list.
    ``step_order``: how the group's changes are ordered for signs and magnitudes: ``position`` (the
    spec's words, increasing flat position) or ``rank`` (class, then position).
    Table fields and stream items are separate, so an edit of one does not change the other.
    """
    nbits, shift, ebits = SPEC[dtype]
    cls = (base_bits.astype(np.int64) >> shift) & ((1 << ebits) - 1)
    changed = base_bits != target_bits
    if widths is None:
        c_lo, c_hi = int(cls[changed].min()), int(cls[changed].max())
        lo, widths = {"per_class": (c_lo, [1] * (c_hi - c_lo + 1)), "one": (c_lo, [c_hi - c_lo + 1]),
                      "all": (0, [1 << ebits])}[grouping]
    groups = []
    for g, mem in enumerate(group_members(base_bits, dtype, lo, widths)):
        ch = changed[mem]
        n, size = int(ch.sum()), int(mem.size)
        kv = k_val[g] if isinstance(k_val, (list, tuple)) else k_val
        grp = {"n": n, "size": size, "n_neg": 0, "m_off": 0, "n_nz": 0, "k_val": None,
               "ranks": None, "neg": None, "nz": None, "vals": None, "changes": []}
        if n:
            pos = mem[ch] if step_order == "rank" else np.sort(mem[ch])
            d = [_step(int(base_bits[i]), int(target_bits[i]), nbits) for i in pos]
            mag = [abs(x) - 1 for x in d]
            m_off = min(mag)
            neg = [j for j, x in enumerate(d) if x < 0]
            nz = [j for j, x in enumerate(mag) if x > m_off]
            grp.update(n_neg=len(neg), m_off=m_off, n_nz=len(nz), k_val=kv if nz else None,
                       ranks=coded_set(np.flatnonzero(ch), size), neg=coded_set(neg, n), nz=coded_set(nz, n),
                       vals=[mag[j] - m_off - 1 for j in nz] if nz else None, changes=[int(i) for i in pos])
        groups.append(grp)
    return {"nbits": nbits, "ebits": ebits, "lo": lo, "n_groups": None, "widths": list(widths), "groups": groups,
            "q_edit": None, "r_edit": None, "lengths": None, "pad": None, "tail": b""}


def dcr_streams(parts: dict) -> tuple[list[int], list[int]]:
    q, r = [], []
    for grp in parts["groups"]:
        for item in ("ranks", "neg", "nz"):
            if grp[item] is not None:
                a, b = _rice(grp[item]["gaps"], grp[item]["k"])
                q, r = q + a, r + b
        if grp["vals"] is not None:
            a, b = _rice(grp["vals"], grp["k_val"])
            q, r = q + a, r + b
    if parts["q_edit"]:
        q = parts["q_edit"](q)
    if parts["r_edit"]:
        r = parts["r_edit"](r)
    return q, r


def assemble(parts: dict) -> bytes:
    """Group table || two stream lengths || Q || R || zero padding (|| ``tail``)."""
    n_groups = len(parts["widths"]) if parts["n_groups"] is None else parts["n_groups"]
    out = bytearray(_varint(parts["lo"]) + _varint(n_groups))
    for w in parts["widths"]:
        out += _varint(w)
    for grp in parts["groups"]:
        out += _varint(grp["n"])
        if grp["n"]:
            out += _varint(grp["n_neg"]) + _varint(grp["m_off"]) + _varint(grp["n_nz"])
            if grp["n_nz"]:
                out.append(1 if grp["k_val"] is None else grp["k_val"])
    q, r = dcr_streams(parts)
    q_len, r_len = parts["lengths"] or (len(q), len(r))
    out += _varint(q_len) + _varint(r_len)
    bits = q + r
    bits += parts["pad"] if parts["pad"] is not None else [0] * ((-len(bits)) % 8)
    if bits:
        out += np.packbits(np.array(bits, dtype=np.uint8)).tobytes()
    return bytes(out) + parts["tail"]


def read_table(body: bytes) -> tuple[int, list[int], list[dict]]:
    """``lo``, widths and per-group fields of a dcr body (the group table only)."""
    pos = 0

    def varint():
        nonlocal pos
        v, shift = 0, 0
        while True:
            b = body[pos]
            pos += 1
            v |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                return v

    lo, n_groups = varint(), varint()
    widths = [varint() for _ in range(n_groups)]
    groups = []
    for _ in range(n_groups):
        g = {"n": varint(), "k_val": None}
        if g["n"]:
            g["n_neg"], g["m_off"], g["n_nz"] = varint(), varint(), varint()
            if g["n_nz"]:
                g["k_val"] = body[pos]
                pos += 1
        groups.append(g)
    return lo, widths, groups


# edits of parts -------------------------------------------------------------


def _group(parts, what="changed"):
    """The first group with the property ``what``."""
    tests = {
        "changed": lambda g: g["n"] > 0,
        "ranks": lambda g: g["ranks"] is not None,
        "ranks2": lambda g: g["ranks"] is not None and len(g["ranks"]["gaps"]) >= 2,
        "neg": lambda g: g["neg"] is not None,
        "nz": lambda g: g["nz"] is not None,
        "nz2": lambda g: g["nz"] is not None and len(g["nz"]["gaps"]) >= 2,
        "vals": lambda g: g["vals"] is not None,
        "no_vals": lambda g: g["n"] > 0 and g["vals"] is None,
        "n2": lambda g: g["n"] >= 2,
    }
    return next(g for g in parts["groups"] if tests[what](g))


def _on(what, fn):
    def edit(parts):
        fn(_group(parts, what), parts)
    return edit


def _recode(grp, item, members):
    """Replace a coded set by the one of ``members`` (same size), with its count in the table."""
    size = grp[item]["size"] if grp[item] is not None else (grp["size"] if item == "ranks" else grp["n"])
    grp[item] = coded_set(sorted(members), size)
    grp[{"ranks": "n", "neg": "n_neg", "nz": "n_nz"}[item]] = len(members)


def _members(grp, item):
    if grp[item] is not None:
        return list(grp[item]["members"])
    full = {"ranks": grp["n"] == grp["size"], "neg": grp["n_neg"] == grp["n"], "nz": grp["n_nz"] == grp["n"]}[item]
    return list(range(grp["size"] if item == "ranks" else grp["n"])) if full else []


def _flip_first_direction(grp, parts):
    neg = _members(grp, "neg")
    _recode(grp, "neg", sorted(set(neg) ^ {0}))


def _move_last_change(grp, parts):
    ranks = _members(grp, "ranks")
    free = sorted(set(range(grp["size"])) - set(ranks))
    _recode(grp, "ranks", ranks[:-1] + [free[-1]])


def _field(field, value):
    def f(grp, parts):
        grp[field] = value(grp, parts) if callable(value) else value
    return f


def _gap(item, index, value):
    def f(grp, parts):
        grp[item]["gaps"][index] = value(grp) if callable(value) else value
    return f


def _table(**kw):
    def f(parts):
        for k, v in kw.items():
            parts[k] = v(parts) if callable(v) else v
    return f


def _streams(q=None, r=None):
    """Edit the finished Q / R bit lists."""
    def f(parts):
        parts["q_edit"], parts["r_edit"] = q, r
    return f


def _empty_group():
    return {"n": 0, "size": 0, "n_neg": 0, "m_off": 0, "n_nz": 0, "k_val": None, "ranks": None, "neg": None,
            "nz": None, "vals": None, "changes": []}


def _too_many_groups(parts):
    top = 1 << parts["ebits"]
    parts["lo"], parts["widths"] = 0, [1] * (top + 1)
    parts["groups"] = [_empty_group() for _ in range(top + 1)]


def _zero_width(parts):
    parts["widths"].insert(0, 0)
    parts["groups"].insert(0, _empty_group())


def _widths_overflow(parts):
    parts["widths"][-1] += (1 << parts["ebits"]) - parts["lo"] - sum(parts["widths"]) + 1


def _drop_first_group(parts):
    parts["lo"] += parts["widths"].pop(0)
    assert parts["groups"].pop(0)["n"]


def _drop_last_q_code(q):
    assert q and q[-1] == 1
    ones = [i for i, b in enumerate(q[:-1]) if b]
    return q[: ones[-1] + 1] if ones else []


def _stream_lengths(dq, dr):
    def f(parts):
        q, r = dcr_streams(parts)
        parts["lengths"] = (len(q) + dq, len(r) + dr)
    return f


def _nonzero_padding(parts):
    for _ in range(8):  # one more remainder bit per coded value until the streams leave padding
        q, r = dcr_streams(parts)
        if (len(q) + len(r)) % 8:
            parts["pad"] = [0] * ((-(len(q) + len(r))) % 8 - 1) + [1]
            return
        _group(parts, "vals")["k_val"] += 1
    raise AssertionError("no padding")


def _step_to(extra):
    """The first coded magnitude set to ``|d| = 2**bits + extra`` (Rice parameter ``bits``)."""
    def f(grp, parts):
        grp["k_val"] = parts["nbits"]
        grp["vals"][0] = (1 << parts["nbits"]) + extra - 2 - grp["m_off"]
    return f


def _m_off_only(extra):
    """A group whose steps all have ``|d| = m_off + 1 = 2**bits + extra`` (no coded magnitudes)."""
    def f(grp, parts):
        grp.update(n_nz=0, nz=None, vals=None, k_val=None, m_off=(1 << parts["nbits"]) + extra - 1)
    return f


DCR_CASES = {
    # group table
    "lo_at_class_count": (_table(lo=lambda p: 1 << p["ebits"]), MalformedRecordError),
    "lo_huge": (_table(lo=2**64), MalformedRecordError),
    "n_groups_zero": (_table(n_groups=0, widths=[], groups=[]), MalformedRecordError),
    "n_groups_over_class_count": (_too_many_groups, MalformedRecordError),
    "width_zero": (_zero_width, MalformedRecordError),
    "widths_overflow": (_widths_overflow, MalformedRecordError),
    "width_huge": (lambda p: p["widths"].__setitem__(-1, 2**63), MalformedRecordError),
    # per-group fields
    "n_over_group_size": (_on("changed", _field("n", lambda g, p: g["size"] + 1)), MalformedRecordError),
    "n_huge": (_on("changed", _field("n", 2**64)), MalformedRecordError),
    "n_neg_over_n": (_on("changed", _field("n_neg", lambda g, p: g["n"] + 2)), MalformedRecordError),  # n + 1 marks a literal group
    "n_nz_over_n": (_on("changed", _field("n_nz", lambda g, p: g["n"] + 1)), MalformedRecordError),
    "k_val_64": (_on("vals", _field("k_val", 64)), MalformedRecordError),
    "k_val_255": (_on("vals", _field("k_val", 255)), MalformedRecordError),
    # Q: too few codes, too many, not ending with the last code
    "q_one_code_short": (_streams(q=_drop_last_q_code), MalformedRecordError),
    "q_one_code_extra": (_streams(q=lambda q: q + [1]), MalformedRecordError),
    "q_trailing_zero": (_streams(q=lambda q: q + [0]), MalformedRecordError),
    "q_last_terminator_cleared": (_streams(q=lambda q: q[:-1] + [0]), MalformedRecordError),
    # R: not exactly sum(count * k) bits
    "r_one_bit_extra": (_streams(r=lambda r: r + [0]), MalformedRecordError),
    "r_one_bit_short": (_streams(r=lambda r: r[:-1]), MalformedRecordError),
    # stream lengths vs body
    "lengths_boundary_moved_into_r": (_stream_lengths(-1, 1), MalformedRecordError),
    "lengths_boundary_moved_into_q": (_stream_lengths(1, -1), MalformedRecordError),
    "body_shorter_than_streams": (_stream_lengths(0, 8), MalformedRecordError),
    "body_longer_than_streams": (_stream_lengths(-8, 0), MalformedRecordError),
    "lengths_huge": (_table(lengths=(2**63, 2**63)), MalformedRecordError),
    "byte_after_streams": (_table(tail=b"\x00"), MalformedRecordError),
    "nonzero_padding": (_nonzero_padding, MalformedRecordError),
    # gaps and ranks inside their sets
    "rank_gap_beyond_group": (_on("ranks", _gap("ranks", 0, lambda g: g["ranks"]["size"])), MalformedRecordError),
    "rank_beyond_group": (_on("ranks2", _gap("ranks", -1, lambda g: g["ranks"]["size"] - 1)), MalformedRecordError),
    "sign_gap_beyond_changes": (_on("neg", _gap("neg", 0, lambda g: g["n"])), MalformedRecordError),
    "magnitude_gap_beyond_changes": (_on("nz", _gap("nz", 0, lambda g: g["n"])), MalformedRecordError),
    "magnitude_rank_beyond_changes": (_on("nz2", _gap("nz", -1, lambda g: g["n"] - 1)), MalformedRecordError),
    # Rice values over 64 bits, steps outside the key space
    "rice_overflow_k63": (_on("vals", lambda g, p: (g.update(k_val=63), g["vals"].__setitem__(0, 2**64))),
                          MalformedRecordError),
    "rice_overflow_k60": (_on("vals", lambda g, p: (g.update(k_val=60), g["vals"].__setitem__(0, 2**64 + 5))),
                          MalformedRecordError),
    "step_beyond_key_space": (_on("vals", _step_to(0)), MalformedRecordError),
    "m_off_beyond_key_space": (_on("changed", _m_off_only(0)), MalformedRecordError),
    "m_off_huge_with_coded_magnitudes": (_on("vals", _field("m_off", 2**64)), MalformedRecordError),
    "m_off_huge_without_coded_magnitudes": (_on("changed", _m_off_only(2**64)), MalformedRecordError),
    # a consistent body that decodes fewer changes than the header's `changed`
    "group_range_misses_a_changed_class": (_drop_first_group, MalformedRecordError),
    # consistent bodies for another change set: only the target checksum refuses them
    "step_value_changed": (_on("vals", lambda g, p: g["vals"].__setitem__(0, g["vals"][0] + 1)),
                           TargetChecksumMismatchError),
    "step_direction_flipped": (_on("changed", _flip_first_direction), TargetChecksumMismatchError),
    "other_position_same_count": (_on("ranks", _move_last_change), TargetChecksumMismatchError),
    "step_just_inside_key_space": (_on("vals", _step_to(-1)), TargetChecksumMismatchError),
    "m_off_just_inside_key_space": (_on("changed", _m_off_only(-1)), TargetChecksumMismatchError),
}
DCR_DTYPES = {"a.bf16": "bf16", "b.fp32": "fp32", "c.fp8": "fp8_e4m3"}


@pytest.fixture(scope="module", params=sorted(DCR_DTYPES))
def dcr_target(request):
    name = request.param
    base, target = _tensors()
    return name, DCR_DTYPES[name], ibits(base[name]), ibits(target[name])


def test_crafted_dcr_body_equals_the_codec_body(dcr_target):
    """With the codec's groups and Rice parameters, the crafting writes the codec's bytes exactly."""
    name, dtype, b, t = dcr_target
    p = Parts(payload("dcr"))
    body = p.bodies[p.index(name)]
    lo, widths, groups = read_table(body)
    parts = dcr_parts(b, t, dtype, k_val=[g["k_val"] for g in groups], lo=lo, widths=widths)
    assert assemble(parts) == body


@pytest.mark.parametrize("grouping", ["per_class", "one", "all"])
@pytest.mark.parametrize("k_val", [0, 1, 5, 20, 63])
def test_crafted_valid_dcr_bodies_are_accepted(dcr_target, grouping, k_val):
    """Any grouping of the classes and any Rice parameter of the magnitudes decodes."""
    name, dtype, b, t = dcr_target
    # signs and magnitudes follow the codec's order of a group's changes (see the test below)
    body = assemble(dcr_parts(b, t, dtype, k_val, grouping, step_order="rank"))
    apply_ok(with_body(payload("dcr"), name, body))
    apply_ok(with_body(payload("dcr", "hmac"), name, body, KEY), KEY)


@pytest.mark.parametrize("grouping", ["one", "all"])
def test_crafted_dcr_groups_of_several_changed_classes_need_rank_order(dcr_target, grouping):
    """Section 4.4 orders a group's sign and magnitude sets by rank (class, then position):
    a body that lists them in plain position order decodes to other bits and is refused."""
    name, dtype, b, t = dcr_target
    parts = dcr_parts(b, t, dtype, 1, grouping, step_order="position")
    assert parts["groups"][0]["changes"] != sorted(parts["groups"][0]["changes"], key=lambda i: (
        (int(b[i]) >> SPEC[dtype][1]) & ((1 << SPEC[dtype][2]) - 1), i))  # the two orders do differ here
    expect(TargetChecksumMismatchError, with_body(payload("dcr"), name, assemble(parts)))


@pytest.mark.parametrize("grouping", ["per_class", "one"])
def test_crafted_dcr_trivial_and_complement_sets_are_accepted(grouping):
    """Sets written as nothing (n = size, n_neg = 0 or n, n_nz = 0), complement-coded ranks, m_off > 0."""
    base = fresh_base()
    b = ibits(base["c.fp8"])
    t = b.copy()
    nbits, shift, ebits = SPEC["fp8_e4m3"]
    cls = (b >> shift) & 0xF
    big = [int(c) for c in np.argsort(-np.bincount(cls, minlength=16), kind="stable")[:3]]
    for c, frac, d in ((big[0], 0.75, 1), (big[1], 1.0, -1), (big[2], 1.0, 3)):
        members = np.flatnonzero(cls == c)
        for i in members[: int(np.ceil(members.size * frac))]:
            t[i] = _stepped(int(b[i]), d, nbits)
    tgt = dict(target_tensors())
    tgt["c.fp8"] = from_bits(t, base["c.fp8"])
    data = encode(fresh_base(), tgt, encoding="dcr")
    parts = dcr_parts(b, t, "fp8_e4m3", grouping=grouping, step_order="rank")
    gs = [g for g in parts["groups"] if g["n"]]
    if grouping == "per_class":
        assert any(g["n"] < g["size"] < 2 * g["n"] for g in gs)                      # complement coding
        assert any(g["n"] == g["size"] and g["ranks"] is None for g in gs)           # n = size
        assert any(g["n_neg"] == g["n"] and g["neg"] is None for g in gs)            # all towards zero
        assert any(g["n_neg"] == 0 and g["n_nz"] == 0 and g["k_val"] is None for g in gs)
        assert any(g["m_off"] == 2 and g["n_nz"] == 0 for g in gs)                   # |d| = 3 everywhere
    body = assemble(parts)
    recv = fresh_base()
    apply(recv, with_body(data, "c.fp8", body))
    assert np.array_equal(ibits(recv["c.fp8"]), t)
    # and a complement-coded set is bounds-checked like a direct one
    if grouping == "per_class":
        g = next(g for g in parts["groups"] if g["n"] < g["size"] < 2 * g["n"])
        g["ranks"]["gaps"][-1] = g["size"]
        expect(MalformedRecordError, with_body(data, "c.fp8", assemble(parts)))


DCR_CASE_PARAMS = sorted(DCR_CASES)


@pytest.mark.parametrize("case", DCR_CASE_PARAMS)
@pytest.mark.parametrize("keyname", KEYS)
def test_crafted_malicious_dcr_bodies(dcr_target, case, keyname):
    name, dtype, b, t = dcr_target
    key = KEYS[keyname]
    edit, exc = DCR_CASES[case]
    parts = dcr_parts(b, t, dtype)
    apply_ok(with_body(payload("dcr", keyname), name, assemble(parts), key), key)  # valid before the edit
    edit(parts)
    body = assemble(parts)
    err = expect(exc, with_body(payload("dcr", keyname), name, body, key), key)
    assert err.record == name


@pytest.mark.parametrize("keyname", KEYS)
def test_crafted_dcr_varints_truncation_and_counts(dcr_target, keyname):
    name, dtype, b, t = dcr_target
    key = KEYS[keyname]
    data = payload("dcr", keyname)
    parts = dcr_parts(b, t, dtype)
    good = assemble(parts)
    table_len = len(good) - (sum(len(s) for s in dcr_streams(parts)) + 7) // 8
    # truncated or overlong (> 10 bytes) varints, empty body, body cut inside the table, the stream
    # lengths or the streams
    for bad in (b"", b"\x80", b"\xff" * 11, b"\x81\x80\x80\x80\x80\x80\x80\x80\x80\x80\x01",
                _varint(parts["lo"]) + b"\xff" * 11, *(good[:k] for k in range(1, table_len + 1)),
                good[: len(good) // 2], good[:-1]):
        expect(MalformedRecordError, with_body(data, name, bad, key), key)
    # a 10-byte varint is still a varint: the same body with `lo` spelled in 10 bytes decodes
    lo10 = bytes([(parts["lo"] & 0x7F) | 0x80]) + b"\x80" * 8 + b"\x00"
    apply_ok(with_body(data, name, lo10 + good[len(_varint(parts["lo"])):], key), key)
    # header `changed` disagrees with the body
    changed = int(np.count_nonzero(b != t))
    for c in (changed - 1, changed + 1, 0):
        expect(MalformedRecordError, with_body(data, name, good, key, edit=lambda r, c=c: r.update(changed=c)), key)
    # a valid body for fewer changes: with the header count it is a count mismatch, with the count
    # fixed the target checksum catches it
    fewer = t.copy()
    fewer[np.flatnonzero(b != t)[-1]] = b[np.flatnonzero(b != t)[-1]]
    body = assemble(dcr_parts(b, fewer, dtype))
    expect(MalformedRecordError, with_body(data, name, body, key), key)
    expect(TargetChecksumMismatchError,
           with_body(data, name, body, key, edit=lambda r: r.update(changed=changed - 1)), key)
    # a group range that misses a changed class, with the count fixed: the target checksum catches it
    p2 = dcr_parts(b, t, dtype)
    missing = _group(p2)["n"]
    _drop_first_group(p2)
    expect(TargetChecksumMismatchError,
           with_body(data, name, assemble(p2), key, edit=lambda r: r.update(changed=changed - missing)), key)
    # target checksum in the header altered
    expect(TargetChecksumMismatchError, with_body(
        data, name, good, key,
        edit=lambda r: r.update(target_checksum=f"{(int(r['target_checksum'], 16) ^ 1):016x}")), key)
    apply_ok(with_body(data, name, good, key), key)


# reference ----------------------------------------------------------------


def ref_body(gaps, xor, width, nbits, pos_tail=b"", val_tail=b""):
    z = zstandard.ZstdCompressor(level=1)
    pos = z.compress(np.asarray(gaps, dtype=np.uint64).astype(f"<u{width}").tobytes()) + pos_tail
    val = z.compress(np.asarray(xor, dtype=np.uint64).astype(np.dtype(UINT[nbits // 8]).newbyteorder("<")).tobytes())
    val += val_tail
    return pos + val, {"pos_width": width, "pos_len": len(pos), "val_len": len(val)}


REF_CASES = {
    "gap_zero_after_first": (lambda g, x, n: (g.__setitem__(1, 0), (g, x))[1], PositionOutOfBoundsError),
    "gap_equal_numel": (lambda g, x, n: (g.__setitem__(-1, n), (g, x))[1], PositionOutOfBoundsError),
    "gap_huge": (lambda g, x, n: (g.__setitem__(0, 2**32 - 1), (g, x))[1], PositionOutOfBoundsError),
    "last_position_equal_numel": (lambda g, x, n: (g.__setitem__(-1, n - sum(g[:-1])), (g, x))[1],
                                  PositionOutOfBoundsError),
    "xor_zero": (lambda g, x, n: (x.__setitem__(0, 0), (g, x))[1], MalformedRecordError),
    "xor_changed": (lambda g, x, n: (x.__setitem__(0, x[0] ^ (2 if x[0] == 1 else 1)), (g, x))[1],
                    TargetChecksumMismatchError),
    "position_moved": (lambda g, x, n: (g.__setitem__(0, g[0] + 1), g.__setitem__(1, g[1] - 1), (g, x))[2]
                       if g[1] > 1 else (g.__setitem__(0, g[0] + 1), (g, x))[1], TargetChecksumMismatchError),
    "one_gap_short": (lambda g, x, n: (g[:-1], x), MalformedRecordError),
    "one_gap_extra": (lambda g, x, n: (g + [1], x), MalformedRecordError),
    "one_value_extra": (lambda g, x, n: (g, x + [1]), MalformedRecordError),
}


def _ref_fixture(name):
    base, target = _tensors()
    b, t = ibits(base[name]), ibits(target[name])
    pos = np.flatnonzero(b != t)
    gaps = [int(g) for g in np.diff(pos, prepend=0)]
    xor = [int(v) for v in (b[pos] ^ t[pos])]
    return b, t, gaps, xor, base[name].element_size() * 8


@pytest.mark.parametrize("name", ["a.bf16", "b.fp32", "c.fp8"])
@pytest.mark.parametrize("case", sorted(REF_CASES))
@pytest.mark.parametrize("keyname", KEYS)
def test_crafted_malicious_reference_bodies(name, case, keyname):
    key = KEYS[keyname]
    b, t, gaps, xor, nbits = _ref_fixture(name)
    # sanity: the crafting reproduces a valid body
    body, params = ref_body(gaps, xor, 4, nbits)
    apply_ok(with_body(payload("reference", keyname), name, body, key, edit=lambda r: r.update(params=params)), key)
    fn, exc = REF_CASES[case]
    g2, x2 = fn(list(gaps), list(xor), b.size)
    body, params = ref_body(g2, x2, 4, nbits)
    err = expect(exc, with_body(payload("reference", keyname), name, body, key,
                                edit=lambda r: r.update(params=params)), key)
    assert err.record == name


@pytest.mark.parametrize("keyname", KEYS)
def test_crafted_reference_params_and_sections(keyname):
    key = KEYS[keyname]
    name = "b.fp32"
    data = payload("reference", keyname)
    b, t, gaps, xor, nbits = _ref_fixture(name)
    body, params = ref_body(gaps, xor, 4, nbits)

    def send(body, params, changed=None):
        def edit(r):
            r["params"] = params
            if changed is not None:
                r["changed"] = changed
        return with_body(data, name, body, key, edit=edit)

    apply_ok(send(body, params), key)
    bad_params = [
        dict(params, pos_width=8),
        dict(params, pos_width=2),
        dict(params, pos_width=True),
        dict(params, pos_len=params["pos_len"] + 1),
        dict(params, val_len=params["val_len"] - 1),
        dict(params, pos_len=-1, val_len=params["val_len"] + params["pos_len"] + 1),
        dict(params, pos_len=float(params["pos_len"])),
        dict(params, extra=0),
        {k: v for k, v in params.items() if k != "val_len"},
        {},
    ]
    for p in bad_params:
        expect(MalformedRecordError, send(body, p), key)
    # 8-byte positions for a small tensor are refused (pos_width MUST be 4 below 2**31 elements)
    b8, p8 = ref_body(gaps, xor, 8, nbits)
    expect(MalformedRecordError, send(b8, p8), key)
    # sections that are not zstd frames, or hold the wrong number of bytes
    z = zstandard.ZstdCompressor(level=1)
    garbage = b"\x00" * params["pos_len"]
    expect(MalformedRecordError, send(garbage + body[params["pos_len"]:], params), key)
    expect(MalformedRecordError, send(body[: params["pos_len"]] + b"\x01" * params["val_len"], params), key)
    short = z.compress(b"\x01\x00\x00")
    expect(MalformedRecordError, send(short + body[params["pos_len"]:], dict(params, pos_len=len(short))), key)
    # decompression bomb: a frame far larger than changed*width
    bomb = z.compress(b"\x01\x00\x00\x00" * 1_000_000)
    expect(MalformedRecordError, send(bomb + body[params["pos_len"]:], dict(params, pos_len=len(bomb))), key)
    # header count disagrees with the sections
    expect(MalformedRecordError, send(body, params, changed=len(gaps) + 1), key)
    expect(MalformedRecordError, send(body, params, changed=len(gaps) - 1), key)


@pytest.mark.parametrize("keyname", KEYS)
def test_crafted_reference_section_with_bytes_after_the_frame(keyname):
    """Section 4.3: each section is exactly one zstd frame; bytes or a second frame after it are refused."""
    key = KEYS[keyname]
    b, t, gaps, xor, nbits = _ref_fixture("b.fp32")
    empty = zstandard.ZstdCompressor(level=1).compress(b"")
    for tails in ({"pos_tail": b"junk"}, {"val_tail": b"junk"}, {"pos_tail": empty}, {"val_tail": empty},
                  {"val_tail": b"\x00"}):
        body, params = ref_body(gaps, xor, 4, nbits, **tails)
        expect(MalformedRecordError, with_body(payload("reference", keyname), "b.fp32", body, key,
                                               edit=lambda r, p=params: r.update(params=p)), key)


# raw / same / unknown --------------------------------------------------------


@pytest.mark.parametrize("keyname", KEYS)
def test_crafted_raw_same_and_unknown_records(keyname):
    key = KEYS[keyname]
    data = payload("raw", keyname)
    name = "c.fp8"
    base, target = _tensors()
    good = ibits(target[name]).tobytes()
    apply_ok(with_body(data, name, good, key), key)
    expect(MalformedRecordError, with_body(data, name, good[:-1], key), key)
    expect(MalformedRecordError, with_body(data, name, good + b"\x00", key), key)
    expect(MalformedRecordError, with_body(data, name, b"", key), key)
    other = bytearray(good)
    other[0] ^= 0x01
    other = bytes(other)
    changed = int(np.count_nonzero(np.frombuffer(other, np.uint8) != ibits(base[name])))
    expect(TargetChecksumMismatchError, with_body(data, name, other, key, edit=lambda r: r.update(changed=changed)),
           key)
    expect(MalformedRecordError, with_body(data, name, good, key, edit=lambda r: r.update(changed=r["changed"] + 1)),
           key)
    # `same` with changes or a body
    expect(MalformedRecordError, with_body(data, "d.same", b"", key, edit=lambda r: r.update(changed=1)), key)
    expect(MalformedRecordError, with_body(data, "d.same", b"\x00", key), key)
    # a `same` record for a tensor that does change: the target checksum catches it
    expect(TargetChecksumMismatchError, with_body(data, name, b"", key, edit=lambda r: r.update(encoding="same",
                                                                                                changed=0)), key)
    # unknown / misspelled encodings
    for enc in ("lz4", "DCR", "", "dense"):
        expect(UnknownEncodingError, with_body(data, name, good, key, edit=lambda r, e=enc: r.update(encoding=e)), key)


# ----------------------------------------------------------------------------- fuzz smoke


def _load_fuzzer():
    path = Path(__file__).resolve().parents[1] / "fuzz" / "fuzz_decode.py"
    spec = importlib.util.spec_from_file_location("nemo_dcr_fuzz_decode", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_fuzz_smoke():
    fuzz = _load_fuzzer()
    counts, failures = fuzz.run(300, seed=12345)
    assert sum(counts.values()) == 300
    # the mutations reach deep into the decoder, not only the outer checks
    reached = set(counts)
    assert {"AuthenticationError", "MalformedHeaderError", "RecordChecksumError"} <= reached, counts
    assert reached & {"MalformedRecordError", "TargetChecksumMismatchError", "PositionOutOfBoundsError"}, counts
    assert not failures, "\n\n".join(f"iteration {it} ({kind}, {enc}, keyed={keyed}):\n{msg}"
                                     for it, kind, enc, keyed, msg, _ in failures[:3])
