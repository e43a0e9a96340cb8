"""Preamble and header of a payload (docs/wire_format.md sections 1-3): build and validate."""

from __future__ import annotations

import copy
import json
import re
import struct
from dataclasses import dataclass, field

import zstandard

from ..types import DTYPES
from .errors import (
    BadMagicError,
    HeaderTooLargeError,
    LimitExceededError,
    MalformedHeaderError,
    TruncatedPayloadError,
    UnknownFlagsError,
    UnsupportedVersionError,
)
from .frames import decompress_exact

MAGIC = b"NDCR"
FORMAT_VERSION = 1
FLAG_AUTH = 1
PREAMBLE = struct.Struct("<4sHHQQ")
MAX_HEADER_BYTES = 64 << 20
MAX_RECORDS = 1_000_000
MAX_DIMS = 8
MAX_NUMEL = 1 << 62
MAX_IDENTITY_CHARS = 256
"""``model`` and ``run`` are at most this many characters (rule 6)."""
HEADER_FIXED_BYTES = 16 << 10
RECORD_FIXED_BYTES = 1024
ESCAPED_CHAR_BYTES = 12
"""Header bound at a receiver (rule 3): ``HEADER_FIXED_BYTES`` plus, per tensor it holds,
``RECORD_FIXED_BYTES`` and ``ESCAPED_CHAR_BYTES`` per character of its name (the longest JSON
escape of a character, a surrogate pair ``\\udXXX\\udXXX``). Every header a conforming encoder
writes for those tensors fits; parsing cost is then proportional to what the receiver holds."""
FORMAT_NAME = "nemo_dcr.delta"


@dataclass(frozen=True, slots=True)
class RecordInfo:
    """Header entry of one record (section 3)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    numel: int
    encoding: str
    changed: int
    length: int
    crc: str
    base_checksum: str
    target_checksum: str
    params: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        """The record's JSON object (keys in field order, as ``dataclasses.asdict`` gives them)."""
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape), "numel": self.numel,
                "encoding": self.encoding, "changed": self.changed, "length": self.length, "crc": self.crc,
                "base_checksum": self.base_checksum, "target_checksum": self.target_checksum,
                "params": copy.deepcopy(self.params) if self.params else {}}


@dataclass(frozen=True)
class PayloadHeader:
    """The header object (section 2)."""

    model: str
    run: str
    base_version: int
    target_version: int
    base_checksum: str
    encodings: tuple[str, ...]
    records: tuple[RecordInfo, ...]

    def to_json(self) -> dict:
        return {"format": FORMAT_NAME, "model": self.model, "run": self.run, "base_version": self.base_version,
                "target_version": self.target_version, "base_checksum": self.base_checksum,
                "encodings": list(self.encodings), "records": [r.to_json() for r in self.records]}


def header_limit(names) -> int:
    """Largest header JSON (bytes) a receiver holding tensors named ``names`` accepts (rule 3)."""
    return HEADER_FIXED_BYTES + sum(RECORD_FIXED_BYTES + ESCAPED_CHAR_BYTES * len(n) for n in names)


def check_identity(model: str, run: str) -> None:
    """``model`` and ``run`` within :data:`MAX_IDENTITY_CHARS` (raises ``ValueError`` naming the field)."""
    for field_name, value in (("model", model), ("run", run)):
        if len(value) > MAX_IDENTITY_CHARS:
            raise ValueError(f"{field_name} has {len(value)} characters; at most {MAX_IDENTITY_CHARS}")


def pack_preamble_and_header(header: PayloadHeader, authenticated: bool) -> bytes:
    raw = json.dumps(header.to_json(), separators=(",", ":")).encode()
    comp = zstandard.ZstdCompressor(level=3).compress(raw)
    flags = FLAG_AUTH if authenticated else 0
    return PREAMBLE.pack(MAGIC, FORMAT_VERSION, flags, len(comp), len(raw)) + comp


def read_preamble(payload, max_header_bytes: int = MAX_HEADER_BYTES,
                  receiver: str = "") -> tuple[int, int, int]:
    """``(flags, header_len, header_raw_len)`` after checking rules 1-3.

    Args:
        payload: the payload bytes.
        max_header_bytes: the receiver's bound (:func:`header_limit`), when lower than 64 MiB.
        receiver: what the receiver holds, for the message.
    """
    if len(payload) < 4 or bytes(payload[:4]) != MAGIC:
        if len(payload) < 4 and MAGIC.startswith(bytes(payload)):
            raise TruncatedPayloadError(f"payload of {len(payload)} bytes is shorter than the preamble")
        raise BadMagicError(f"payload starts with {bytes(payload[:4])!r}, expected {MAGIC!r}")
    if len(payload) < PREAMBLE.size:
        raise TruncatedPayloadError(f"payload of {len(payload)} bytes is shorter than the {PREAMBLE.size}-byte preamble")
    _, version, flags, h_len, h_raw = PREAMBLE.unpack_from(payload)
    if version != FORMAT_VERSION:
        raise UnsupportedVersionError(f"format version {version}; this decoder reads version {FORMAT_VERSION}")
    if flags & ~FLAG_AUTH:
        raise UnknownFlagsError(f"reserved flag bits set: {flags:#06x}")
    if h_raw > min(MAX_HEADER_BYTES, max_header_bytes):
        raise HeaderTooLargeError(f"header of {h_raw} bytes exceeds {min(MAX_HEADER_BYTES, max_header_bytes)}"
                                  + (f", the bound for a receiver holding {receiver}" if receiver else ""))
    if PREAMBLE.size + h_len > len(payload):
        raise TruncatedPayloadError(f"header of {h_len} bytes runs past the payload end ({len(payload)} bytes)")
    return flags, h_len, h_raw


def _header_error(message: str, record=None) -> MalformedHeaderError:
    return MalformedHeaderError(message)


def parse_header(comp, raw_len: int) -> PayloadHeader:
    """Decompress and validate the header JSON (rules 3, 6-8)."""
    raw = decompress_exact(comp, raw_len, _header_error, "header")
    try:
        text = raw.decode("utf-8")
        del raw  # peak memory: the text or the bytes, not both, next to the parsed objects
        obj = json.loads(text)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
        raise MalformedHeaderError(f"header is not UTF-8 JSON within limits: {str(exc)[:200]}") from None
    del text
    return _header_from_json(obj)


_HEADER_TYPES = {"format": str, "model": str, "run": str, "base_version": int, "target_version": int,
                 "base_checksum": str, "encodings": list, "records": list}
_RECORD_TYPES = {"name": str, "dtype": str, "shape": list, "numel": int, "encoding": str, "changed": int,
                 "length": int, "crc": str, "base_checksum": str, "target_checksum": str, "params": dict}


def _check_keys(obj, types: dict, where: str) -> None:
    if not isinstance(obj, dict):
        raise MalformedHeaderError(f"{where} is not a JSON object")
    if obj.keys() != types.keys():
        missing, unknown = set(types) - set(obj), set(obj) - set(types)
        raise MalformedHeaderError(f"{where}: missing keys {sorted(missing)}, unknown keys {sorted(unknown)}")
    for k, t in types.items():
        if not isinstance(obj[k], t) or (t is int and isinstance(obj[k], bool)):
            raise MalformedHeaderError(f"{where}: key {k!r} must be {t.__name__}, got {type(obj[k]).__name__}")


_HEX16 = re.compile("[0-9a-f]{16}")


def _check_hex(value: str, where: str) -> int:
    if not _HEX16.fullmatch(value):
        raise MalformedHeaderError(f"{where}: {value!r} is not 16 lowercase hex digits")
    return int(value, 16)


def _header_from_json(obj) -> PayloadHeader:
    _check_keys(obj, _HEADER_TYPES, "header")
    if obj["format"] != FORMAT_NAME:
        raise MalformedHeaderError(f"header format {obj['format']!r}, expected {FORMAT_NAME!r}")
    try:
        check_identity(obj["model"], obj["run"])
    except ValueError as exc:
        raise MalformedHeaderError(f"header: {exc}") from None
    if not 0 <= obj["base_version"] < obj["target_version"]:
        raise MalformedHeaderError(f"versions {obj['base_version']} -> {obj['target_version']} must increase from >= 0")
    if len(obj["records"]) > MAX_RECORDS:
        raise LimitExceededError(f"{len(obj['records'])} records exceed the limit of {MAX_RECORDS}")
    raw_records, records = obj["records"], []
    for i in range(len(raw_records)):  # each JSON object is dropped once converted: never both whole
        records.append(_record_from_json(raw_records[i], i))
        raw_records[i] = None
    records = tuple(records)
    names = [r.name for r in records]
    if len(set(names)) != len(names):
        raise MalformedHeaderError("record names are not unique")
    total = sum(_check_hex(r.base_checksum, r.name) for r in records) & ((1 << 64) - 1)
    if _check_hex(obj["base_checksum"], "header") != total:
        raise MalformedHeaderError("header base_checksum is not the sum of the records' base checksums")
    if not all(isinstance(e, str) for e in obj["encodings"]):
        raise MalformedHeaderError("encodings must be a list of strings")
    return PayloadHeader(obj["model"], obj["run"], obj["base_version"], obj["target_version"],
                         obj["base_checksum"], tuple(obj["encodings"]), records)


def _record_from_json(r, i: int) -> RecordInfo:
    _check_keys(r, _RECORD_TYPES, f"record #{i}")
    where = f"record {r['name']!r}"
    shape = r["shape"]
    if len(shape) > MAX_DIMS:
        raise LimitExceededError(f"{where}: {len(shape)} dims exceed the limit of {MAX_DIMS}")
    if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape):
        raise MalformedHeaderError(f"{where}: shape {shape} must be non-negative ints")
    numel = 1
    for s in shape:
        numel *= s
    if numel != r["numel"] or numel >= MAX_NUMEL:
        raise MalformedHeaderError(f"{where}: numel {r['numel']} does not match shape {shape} (or is too large)")
    if r["dtype"] not in DTYPES:
        raise MalformedHeaderError(f"{where}: unknown dtype {r['dtype']!r}; known: {', '.join(DTYPES)}")
    if not 0 <= r["changed"] <= numel or r["length"] < 0:
        raise MalformedHeaderError(f"{where}: changed={r['changed']} / length={r['length']} out of range")
    for k in ("crc", "base_checksum", "target_checksum"):
        _check_hex(r[k], where)
    return RecordInfo(r["name"], r["dtype"], tuple(shape), numel, r["encoding"], r["changed"],
                      r["length"], r["crc"], r["base_checksum"], r["target_checksum"], r["params"])
