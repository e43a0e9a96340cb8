"""Fuzz targets: the payload decoder, the header parser and the store transport's envelope.

Each target takes the fuzzer's bytes and either returns (the input was handled correctly) or
raises. A :class:`SilentChange` means an input was accepted and its result differs from what an
independent reader computes (``tests/spec_reader.py``, written from docs/wire_format.md; for
the envelope, the frame layout documented in ``nemo_dcr/transport/store.py`` read with
``struct``/``hmac``), or a refused input changed something. Any other exception escaping a target
is a crash. Used by ``tests/fuzz/atheris_main.py`` (coverage-guided, libFuzzer through atheris).

Inputs are structure-aware where the format has integrity checks a random mutation almost never
passes: the first byte of a ``payload`` input picks a mode (bit 0: with an HMAC key; bit 1: the
rest is a whole payload, taken as is; bit 2: recompute record crcs and the MAC; bit 3: also make
each record's ``changed`` and ``target_checksum`` match what the independent reader decodes, so a
mutated body is accepted exactly when the codec decodes it as the spec does). Otherwise the rest
is ``u32 n`` + the header JSON (``n`` bytes, compressed by the target) + the record bodies.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
import sys
import warnings
from pathlib import Path

import numpy as np
import torch
import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nemo_dcr import codec  # noqa: E402
from nemo_dcr.codec import header as codec_header  # noqa: E402
from nemo_dcr.codec.errors import DeltaFormatError  # noqa: E402
from nemo_dcr.transport import Envelope, MessageKind  # noqa: E402
from nemo_dcr.transport.base import TransportError, TransportTimeout  # noqa: E402
from nemo_dcr.transport.store import StoreTransport, StoreWarning  # noqa: E402
from tests.spec_reader import Parsed, ibits, spec_checksum, spec_decode_record, spec_header_problem  # noqa: E402

KEY = b"fuzz-hmac-key-0123456789abcdef!!"
PRE = struct.Struct("<4sHHQQ")
KEYED, WHOLE, FIX, FIX_CHECKSUMS = 1, 2, 4, 8


class SilentChange(AssertionError):
    """An accepted input decoded to something the independent reader disagrees with (or a refused
    input wrote something)."""


def _tensors(seed: int = 0) -> tuple[dict, dict]:
    """Small tensors of every dtype (the independent reader works element by element)."""
    g = torch.Generator().manual_seed(seed)
    base = {"w.bf16": (torch.randn(8, 24, generator=g) * 0.02).to(torch.bfloat16),
            "w.fp32": torch.randn(64, generator=g) * 0.1,
            "w.fp8": torch.randn(6, 16, generator=g).to(torch.float8_e4m3fn),
            "w.e5m2": torch.randn(40, generator=g).to(torch.float8_e5m2),
            "w.same": torch.randn(9, generator=g).to(torch.float16),
            "w.scalar": torch.tensor(0.5, dtype=torch.float32)}
    rng, target = np.random.default_rng(seed), {}
    for name, t in base.items():
        b = ibits(t).astype(np.int64)
        mask = rng.random(b.size) < (0 if name == "w.same" else 0.1)
        if name != "w.same":
            mask[rng.integers(b.size)] = True
        new = np.where(mask, (b + rng.integers(1, 4, b.size)) % (1 << (8 * t.element_size())), b)
        signed = {1: np.uint8, 2: np.int16, 4: np.int32}[t.element_size()]
        target[name] = torch.from_numpy(new.astype(ibits(t).dtype).view(signed)).view(t.dtype).reshape(t.shape)
    return base, target


BASE, TARGET = _tensors()
BASE_BITS = {n: ibits(t) for n, t in BASE.items()}
BASE_LISTS = {n: [int(x) for x in b] for n, b in BASE_BITS.items()}
BASE_CHECKSUMS = {n: spec_checksum(b) for n, b in BASE_BITS.items()}


# ----------------------------------------------------------------------------- payload


def payload_seeds() -> list[bytes]:
    """Valid payloads of every encoding, with and without a key, in each input mode."""
    out = []
    for enc in ("dcr", "reference", "raw"):
        for key in (None, KEY):
            p = codec.encode(BASE, TARGET, codec.Identity(base_version=0, target_version=1), enc, key)
            keyed = KEYED if key else 0
            out.append(bytes([WHOLE | keyed]) + p)
            parsed = Parsed(p, key)
            bodies = p[24 + parsed.h_len : parsed.end]
            for mode in (FIX, FIX | FIX_CHECKSUMS):
                out.append(bytes([mode | keyed]) + len(parsed.raw).to_bytes(4, "little") + parsed.raw + bodies)
    return out


def build_payload(data: bytes) -> tuple[bytes, bytes | None]:
    """(payload, key) of a ``payload`` input (see the module docstring)."""
    mode = data[0] if data else 0
    key = KEY if mode & KEYED else None
    if mode & WHOLE or len(data) < 5:
        return data[1:], key
    n = int.from_bytes(data[1:5], "little")
    raw, bodies = data[5 : 5 + n], data[5 + n :]
    if mode & (FIX | FIX_CHECKSUMS):
        raw = _fixed_header(raw, bodies, mode)
    comp = zstandard.ZstdCompressor(level=1).compress(raw)
    out = PRE.pack(b"NDCR", 1, 1 if key else 0, len(comp), len(raw)) + comp + bodies
    if key is not None:
        out += hmac.new(key, out, hashlib.sha256).digest() if mode & FIX else bytes(32)
    return out, key


def _fixed_header(raw: bytes, bodies: bytes, mode: int) -> bytes:
    """The header JSON with each record's crc (and, with FIX_CHECKSUMS, its changed count and target
    checksum as the independent reader decodes the body) recomputed; as is when it is no such JSON."""
    try:
        obj = json.loads(raw)
        records = obj["records"]
        off = 0
        for r in records:
            body = bodies[off : off + r["length"]]
            off += r["length"]
            r["crc"] = hashlib.blake2b(body, digest_size=8).hexdigest()
            if mode & FIX_CHECKSUMS and r.get("name") in BASE_LISTS:
                try:
                    changes = spec_decode_record(r, body, BASE_LISTS[r["name"]])
                except Exception:  # the spec reader refuses it too: leave the record as it is
                    continue
                bits = BASE_BITS[r["name"]].copy()
                for i, v in changes.items():
                    bits[i] = v
                r["changed"], r["target_checksum"] = len(changes), f"{spec_checksum(bits):016x}"
        return json.dumps(obj, separators=(",", ":")).encode()
    except Exception:  # not a header the fix applies to: the input as it is
        return raw


def spec_result(payload: bytes, key: bytes | None) -> dict[str, np.ndarray]:
    """What the independent reader makes of an accepted payload: the receiver's bits after it.

    Raises:
        AssertionError (or anything else): the reader refuses the payload.
    """
    p = Parsed(payload, key)
    assert p.magic == b"NDCR" and p.version == 1 and p.flags == (1 if key else 0)
    assert len(p.raw) == p.h_raw and (problem := spec_header_problem(p.header)) is None, problem
    assert len(payload) == p.end + (32 if key else 0)
    if key:
        assert p.mac == hmac.new(key, payload[:-32], hashlib.sha256).digest()
    out = {n: b.copy() for n, b in BASE_BITS.items()}
    for r, body in zip(p.header["records"], p.bodies):
        name = r["name"]
        assert name in BASE and list(BASE[name].shape) == r["shape"] and BASE_CHECKSUMS[name] == int(r["base_checksum"], 16)
        assert BASE[name].dtype == {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
                                    "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[r["dtype"]]
        assert r["crc"] == hashlib.blake2b(body, digest_size=8).hexdigest()
        changes = spec_decode_record(r, body, BASE_LISTS[name])
        assert len(changes) == r["changed"] and all(v != BASE_LISTS[name][i] for i, v in changes.items())
        for i, v in changes.items():
            out[name][i] = v
        assert spec_checksum(out[name]) == int(r["target_checksum"], 16)
    return out


def run_payload(data: bytes) -> str:
    """Apply the payload to a fresh copy of the base; check the outcome against the spec reader."""
    payload, key = build_payload(data)
    receiver = {n: t.clone() for n, t in BASE.items()}
    try:
        codec.apply(receiver, payload, key)
    except DeltaFormatError:
        if any(not np.array_equal(ibits(receiver[n]), BASE_BITS[n]) for n in BASE):
            raise SilentChange("a refused payload wrote into the receiver") from None
        return "refused"
    try:
        want = spec_result(payload, key)
    except Exception as exc:
        raise SilentChange(f"the codec accepted a payload the spec reader refuses: {exc!r}") from None
    for n in BASE:
        if not np.array_equal(ibits(receiver[n]), want[n]):
            raise SilentChange(f"{n}: the codec's result differs from the spec reader's")
    return "accepted"


# ----------------------------------------------------------------------------- header


def header_seeds() -> list[bytes]:
    return [Parsed(codec.encode(BASE, TARGET, encoding=enc), None).raw for enc in ("dcr", "reference", "raw")]


def run_header(data: bytes) -> str:
    """Parse header JSON ``data`` (compressed here); accepted exactly when the spec's rules hold."""
    comp = zstandard.ZstdCompressor(level=1).compress(data)
    try:
        got = codec_header.parse_header(comp, len(data))
    except DeltaFormatError:
        got = None
    try:
        obj = json.loads(data.decode("utf-8"))
        problem = spec_header_problem(obj)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        obj, problem = None, f"not UTF-8 JSON: {type(exc).__name__}"
    if got is None:
        if problem is None:
            raise SilentChange("the codec refused a header the spec accepts")
        return "refused"
    if problem is not None:
        raise SilentChange(f"the codec accepted a header the spec refuses ({problem})")
    same = (got.model, got.run, got.base_version, got.target_version, got.base_checksum, list(got.encodings)) == (
        obj["model"], obj["run"], obj["base_version"], obj["target_version"], obj["base_checksum"], obj["encodings"])
    recs = [(r.name, r.dtype, list(r.shape), r.numel, r.encoding, r.changed, r.length, r.crc, r.base_checksum,
             r.target_checksum, r.params) for r in got.records]
    if not same or recs != [tuple(r[k] for k in ("name", "dtype", "shape", "numel", "encoding", "changed", "length",
                                                  "crc", "base_checksum", "target_checksum", "params"))
                            for r in obj["records"]]:
        raise SilentChange("the parsed header differs from the JSON")
    return "accepted"


# ----------------------------------------------------------------------------- store envelope

RUN = "fuzz-run"
URL = "memory://nemo-dcr-fuzz-envelope"
FRAME = struct.Struct("<4sB16siiQ")  # the store frame (nemo_dcr/transport/store.py), read independently
HEAD = struct.Struct("<4sBqiiBii")  # the envelope head (nemo_dcr/transport/base.py)
RUN_ID = hashlib.sha256(RUN.encode()).digest()[:16]


def _frame(seq: int, env: Envelope) -> bytes:
    return FRAME.pack(b"NDCS", 1, RUN_ID, 0, 1, seq) + env.to_bytes()


def envelope_seeds() -> list[bytes]:
    frame = _frame(1, Envelope(MessageKind.DELTA, 3, 0, part=2, last=True, body=b"payload", receiver=1))
    return [bytes([mode]) + frame for mode in (0b011, 0b111, 0b001, 0b010, 0b0001_0011, 0b0010_0011)]


def run_envelope(data: bytes) -> str:
    """Receive message #0 from rank 0, then put the input into the box and receive again.

    Mode byte: bit 0 append a valid MAC to the rest (else the rest is the whole object); bit 1 put
    it at the next expected name (#1), else at a name chosen by bits 4-6 (a replay of #0, a later
    message, stray names, a temp file); bit 2 receive from rank 0 only (else from anyone).
    """
    mode, obj = (data[0], data[1:]) if data else (0, b"")
    if mode & 1:
        obj += hmac.new(KEY, obj, hashlib.sha256).digest()
    sender, receiver = StoreTransport(URL, 0, KEY, run=RUN), StoreTransport(URL, 1, KEY, run=RUN)
    receiver.sweep_s, receiver.tmp_stale_s = 0.0, 0.0
    sender.send(1, Envelope(MessageKind.DELTA, 1, 0, body=b"first"))
    names = ["0000000000000000.env", "0000000000000007.env", "x.env", ".tmp-abc", "1.env", "-1.env", "a/b.env"]
    name = "0000000000000001.env" if mode & 2 else names[(mode >> 4) % len(names)]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", StoreWarning)
            assert receiver.recv(src=0, timeout=1).body == b"first"
            receiver.fs.pipe_file(f"{URL[len('memory://'):]}/to-1/run-{RUN_ID.hex()}/from-0/{name}", obj)
            env = receiver.recv(src=0 if mode & 4 else None, timeout=0)
    except (TransportTimeout, TransportError):
        return "refused"
    finally:
        for path in receiver.fs.find(receiver.root):
            receiver.fs.rm(path)
    _check_envelope(obj, env)
    return "accepted"


def _check_envelope(obj: bytes, env: Envelope) -> None:
    frame, mac = obj[:-32], obj[-32:]
    ok = len(obj) >= FRAME.size + HEAD.size + 32 and hmac.compare_digest(mac, hmac.new(KEY, frame, hashlib.sha256).digest())
    if ok:
        magic, version, run, sender, receiver, seq = FRAME.unpack_from(frame)
        ok = (magic, version, run, sender, receiver, seq) == (b"NDCS", 1, RUN_ID, 0, 1, 1)
    if ok:
        m, kind, version, sender, part, last, receiver, shard = HEAD.unpack_from(frame, FRAME.size)
        ok = m == b"NDCE" and last in (0, 1) and shard >= 0 and (
            int(env.kind), env.version, env.sender, env.part, env.last, env.receiver, env.shard, env.body) == (
            kind, version, sender, part, bool(last), receiver, shard, frame[FRAME.size + HEAD.size:])
    if not ok:
        raise SilentChange(f"delivered {env!r} from an object the frame layout does not accept")


TARGETS = {"payload": (run_payload, payload_seeds), "header": (run_header, header_seeds),
           "envelope": (run_envelope, envelope_seeds)}
