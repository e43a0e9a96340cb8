"""Encode, decode and apply whole payloads (docs/wire_format.md).

``decode`` validates every rule against the receiver's tensors and returns the changes without
writing anything; ``apply`` writes only after the whole payload decoded cleanly.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
import torch

from ..kernels import count_equal, read_bits, write_bits
from ..kernels.traffic import on_host, to_host
from ..kernels.workers import map_records
from ..types import DeltaInputError, SparseDelta, UnsupportedDtypeError, bits_view, spec_of
from ..verify.checksum import tensor_checksum, updated_checksum
from .auth import MIN_KEY_BYTES
from .dcr import DcrIndexes
from .device_base import DeviceBase
from .errors import (
    AuthenticationError,
    BaseChecksumMismatchError,
    DtypeMismatchError,
    MalformedRecordError,
    MissingTensorError,
    RecordChecksumError,
    ShapeMismatchError,
    TargetChecksumMismatchError,
    TrailingBytesError,
    TruncatedPayloadError,
)
from .header import (
    FLAG_AUTH,
    MAX_HEADER_BYTES,
    PREAMBLE,
    PayloadHeader,
    RecordInfo,
    check_identity,
    header_limit,
    pack_preamble_and_header,
    parse_header,
    read_preamble,
)
from .records import decode_record, encode_record

MAC_BYTES = 32


@dataclass(frozen=True)
class Identity:
    """Who and which versions a payload is about."""

    model: str = ""
    run: str = ""
    base_version: int = 0
    target_version: int = 1


@dataclass(frozen=True)
class DecodedPayload:
    """A validated payload: its header and the changes of each record (receiver's index space)."""

    header: PayloadHeader
    deltas: tuple[SparseDelta, ...]


def _hex(x: int) -> str:
    return f"{x:016x}"


def _crc(body) -> str:
    return hashlib.blake2b(body, digest_size=8).hexdigest()


def _check_key(key: bytes | None) -> None:
    if key is not None and len(key) < MIN_KEY_BYTES:
        raise ValueError(f"HMAC key must be at least {MIN_KEY_BYTES} bytes, got {len(key)}")


def _flat_bits(t: torch.Tensor) -> np.ndarray:
    """Host bits of the whole tensor: a view of host memory, else one (counted) copy."""
    return bits_view(to_host(t.detach()).contiguous())


def _changes(x: SparseDelta | tuple[RecordInfo, memoryview]) -> int:
    """Changed elements of a delta or a (record, body) pair: what a record costs a worker."""
    return x.nnz if isinstance(x, SparseDelta) else x[0].changed


def _base_of(base: Mapping[str, np.ndarray], d: SparseDelta) -> np.ndarray:
    """The receiver's flat bits of ``d``'s tensor, refused unless they match ``d``'s dtype and size."""
    if d.name not in base:
        raise DeltaInputError(f"SparseDelta {d.name!r}: no base bits of that tensor (base has {len(base)} tensors)")
    bits = base[d.name]
    want = spec_of(d.dtype).uint
    if not isinstance(bits, np.ndarray) or bits.dtype != want or bits.size != d.numel:
        got = f"{bits.dtype}[{bits.size}]" if isinstance(bits, np.ndarray) else type(bits).__name__
        raise DeltaInputError(f"SparseDelta {d.name!r}: base bits are {got}, the delta's dtype {d.dtype!r} and "
                              f"shape {d.shape} need {want}[{d.numel}]")
    return bits


def encode_deltas(
    deltas: Sequence[SparseDelta],
    base: Mapping[str, np.ndarray],
    identity: Identity = Identity(),
    encoding: str = "dcr",
    key: bytes | None = None,
    base_checksums: Mapping[str, int] | None = None,
    indexes: DcrIndexes | None = None,
    threads: int = 1,
    *,
    old_from_base: bool = False,
) -> bytes:
    """Encode change sets against the receiver's base bits.

    Args:
        deltas: one :class:`SparseDelta` per tensor (empty ones become ``same`` records).
        base: flat base bits of each named tensor (what the receiver holds).
        identity: model/run and the version pair.
        encoding: ``dcr``, ``reference`` or ``raw`` (per record, ``raw`` wins when smaller).
        key: HMAC key; authenticates the payload when given.
        base_checksums: known checksums of the base tensors (computed when missing).
        indexes: kept ``dcr`` class indexes of the base tensors (the sender's; built on first
            use, rebuilt when stale).  The owner updates them from each acknowledged delta
            (:meth:`DcrIndexes.update`); without them every ``dcr`` record ranks its whole base.
        threads: worker threads over the records (``dcr.threads``; :func:`~nemo_dcr.kernels.workers.map_records`):
            the same bytes as one thread.
        old_from_base: every delta's ``old_bits`` were read from ``base`` at its positions (as
            :meth:`nemo_dcr.refit.mirror.SenderMirror.changes` makes them, from the bits it then
            encodes against), so they are not read again; otherwise the base's bits are read here
            and any ``old_bits`` given are ignored.  The receiver checks every record's target
            checksum on its own bits, so wrong old bits cost a refused payload, never wrong weights.
    """
    _check_key(key)
    check_identity(identity.model, identity.run)

    def record(d: SparseDelta) -> tuple[RecordInfo, bytes]:
        spec, bits = spec_of(d.validate().dtype), _base_of(base, d)
        base_ck = (base_checksums or {}).get(d.name)
        base_ck = tensor_checksum(bits) if base_ck is None else base_ck
        if old_from_base and d.old_bits is None:
            raise DeltaInputError(f"SparseDelta {d.name!r}: old_from_base needs its old_bits")
        old = np.ascontiguousarray(d.old_bits) if old_from_base else read_bits(bits, d.positions)
        if count_equal(old, d.new_bits):  # rule 12: a receiver refuses a record with a no-op change
            i = int(np.flatnonzero(old == d.new_bits)[0])
            raise DeltaInputError(f"SparseDelta {d.name!r}: the change at position {int(d.positions[i])} (entry {i}) "
                                  f"sets the element to its base bits 0x{int(old[i]):x}; every change must differ "
                                  "from the base")
        index = indexes.get(d.name, bits, spec, base_ck) if indexes is not None and encoding == "dcr" and d.nnz \
            else None
        enc, body, params = encode_record(encoding, bits, d.positions, d.new_bits, spec, index, old)
        target_ck = updated_checksum(base_ck, d.positions, old, d.new_bits)
        return RecordInfo(d.name, d.dtype, tuple(int(s) for s in d.shape), d.numel, enc, d.nnz,
                          len(body), _crc(body), _hex(base_ck), _hex(target_ck), params), body

    if len({d.name for d in deltas}) < len(deltas):
        threads = 1  # two records of one tensor share its kept index: in their order, on one thread
    done = map_records(record, deltas, threads, _changes)
    infos, bodies = [i for i, _ in done], [b for _, b in done]
    total = sum(int(r.base_checksum, 16) for r in infos) & ((1 << 64) - 1)
    header = PayloadHeader(identity.model, identity.run, identity.base_version, identity.target_version,
                           _hex(total), tuple(sorted({r.encoding for r in infos})), tuple(infos))
    out = pack_preamble_and_header(header, key is not None) + b"".join(bodies)
    if key is not None:
        out += hmac.new(key, out, hashlib.sha256).digest()
    return out


def diff_tensors(base: Mapping[str, torch.Tensor], target: Mapping[str, torch.Tensor]) -> list[SparseDelta]:
    """Changed elements of ``target`` vs ``base`` (same names, dtypes, shapes), by integer views."""
    if set(base) != set(target):
        raise ValueError(f"tensor names differ: only in base {sorted(set(base) - set(target))[:5]}, "
                         f"only in target {sorted(set(target) - set(base))[:5]}")
    out = []
    for name, b in base.items():
        t = target[name]
        if b.dtype != t.dtype or b.shape != t.shape:
            raise ValueError(f"{name}: base {b.dtype}{tuple(b.shape)} vs target {t.dtype}{tuple(t.shape)}")
        bb, tb = _flat_bits(b), _flat_bits(t)
        pos = np.flatnonzero(bb != tb).astype(np.int64)
        out.append(SparseDelta(name, spec_of(b.dtype).name, tuple(b.shape), pos, tb[pos], bb[pos]))
    return out


def encode(base: Mapping[str, torch.Tensor], target: Mapping[str, torch.Tensor], identity: Identity = Identity(),
           encoding: str = "dcr", key: bytes | None = None) -> bytes:
    """Payload turning ``base`` into ``target`` (every tensor gets a record)."""
    deltas = diff_tensors(base, target)
    bits = {n: _flat_bits(t) for n, t in base.items()}
    return encode_deltas(deltas, bits, identity, encoding, key)


def _split(payload, key: bytes | None, receiver: Mapping | None = None) -> tuple[PayloadHeader, list[memoryview]]:
    """Preamble, MAC, header and record bodies (rules 1-8, 11); the header is bounded by what
    ``receiver`` holds (rule 3) when given, and authenticated before it is parsed (rule 5)."""
    _check_key(key)
    payload = memoryview(payload)
    limit = MAX_HEADER_BYTES if receiver is None else header_limit(receiver)
    flags, h_len, h_raw = read_preamble(payload, limit, "" if receiver is None else f"{len(receiver)} tensors")
    authenticated = bool(flags & FLAG_AUTH)
    if authenticated != (key is not None):
        raise AuthenticationError("payload is authenticated but no key was given" if authenticated
                                  else "a key was given but the payload carries no MAC")
    end = len(payload) - (MAC_BYTES if authenticated else 0)
    if end < PREAMBLE.size + h_len:
        raise TruncatedPayloadError("payload too short for its header and MAC")
    if authenticated:
        want = hmac.new(key, payload[:end], hashlib.sha256).digest()
        if not hmac.compare_digest(want, bytes(payload[end:])):
            raise AuthenticationError("MAC does not match: wrong key or tampered payload")
    header = parse_header(payload[PREAMBLE.size : PREAMBLE.size + h_len], h_raw)
    offset, bodies = PREAMBLE.size + h_len, []
    for r in header.records:
        if offset + r.length > end:
            raise TruncatedPayloadError(f"body of {r.length} bytes runs past the payload end", r.name)
        body = payload[offset : offset + r.length]
        if _crc(body) != r.crc:
            raise RecordChecksumError("body does not match its crc", r.name)
        bodies.append(body)
        offset += r.length
    if offset != end:
        raise TrailingBytesError(f"{end - offset} bytes after the last record")
    return header, bodies


def inspect(payload, key: bytes | None = None, receiver: Mapping | None = None) -> PayloadHeader:
    """Structurally validated header of a payload (no base needed).

    Args:
        payload: the payload.
        key: HMAC key (the MAC is checked before the header is parsed).
        receiver: names of the tensors the receiver holds (a mapping): bounds the header (rule 3).
    """
    return _split(payload, key, receiver)[0]


def _check_against(r: RecordInfo, base: Mapping[str, torch.Tensor]) -> tuple:
    """The receiver's tensor of record ``r`` and its dtype facts (rules 9-10)."""
    if r.name not in base:
        raise MissingTensorError(f"receiver has no such tensor (it has {len(base)} tensors)", r.name)
    t = base[r.name]
    try:
        spec = spec_of(t.dtype)
    except UnsupportedDtypeError:
        raise DtypeMismatchError(f"payload dtype {r.dtype}, receiver holds unsupported {t.dtype}", r.name) from None
    if spec.name != r.dtype:
        raise DtypeMismatchError(f"payload dtype {r.dtype}, receiver holds {spec.name}", r.name)
    if tuple(t.shape) != r.shape:
        raise ShapeMismatchError(f"payload shape {list(r.shape)}, receiver holds {list(t.shape)}", r.name)
    return t, spec


def _base_bits(r: RecordInfo, t: torch.Tensor, spec, have: int | None, kept) -> "np.ndarray | DeviceBase":
    """What record ``r`` decodes against: a device tensor whose checksum ``have`` is known is read
    only at the changed positions (:class:`DeviceBase`) when the record needs no more (``same``,
    ``reference``, or ``dcr`` with the ``kept`` current class index); otherwise the whole tensor's
    host bits (a view of host memory, or one counted copy from a device)."""
    if not on_host(t) and have is not None and (r.encoding in ("same", "reference") or
                                                (r.encoding == "dcr" and kept is not None)):
        return DeviceBase(t, spec)
    return _flat_bits(t)


def decode(payload, base: Mapping[str, torch.Tensor], key: bytes | None = None,
           base_checksums: Mapping[str, int] | None = None, indexes: DcrIndexes | None = None,
           threads: int = 1) -> DecodedPayload:
    """Validate a payload against the receiver's tensors and decode it; writes nothing.

    ``indexes``: kept ``dcr`` class indexes of the receiver's tensors (built on first use,
    rebuilt when stale); the owner updates them after a committed apply
    (:meth:`DcrIndexes.update`) and never after a rolled-back one.  A device tensor with a known
    checksum is read only where the record changes it, when the record allows (:func:`_base_bits`).
    ``threads``: worker threads over the records (``dcr.threads``): the same result and the same
    first error as one thread.
    """
    return decode_parts([payload], base, key, base_checksums, indexes, threads)[0]


def decode_parts(payloads: Sequence, base: Mapping[str, torch.Tensor], key: bytes | None = None,
                 base_checksums: Mapping[str, int] | None = None, indexes: DcrIndexes | None = None,
                 threads: int = 1) -> list[DecodedPayload]:
    """:func:`decode` of each of ``payloads`` (the parts of one version), their records handed to
    the worker threads together: a part whose one large record keeps a worker busy (an embedding
    table) leaves the other workers the records of the other parts, not nothing to do.

    The result and the first error are :func:`decode`'s, part after part, whatever ``threads``:
    when a part's preamble, MAC, header or record crcs are refused, the records of the parts
    before it are decoded first (their error comes first), the later parts are not looked at.
    """
    split, refused = [], None
    for payload in payloads:
        try:
            split.append(_split(payload, key, base))
        except Exception as exc:  # raised once the earlier parts' records were decoded
            refused = exc
            break

    def record(rb: tuple[RecordInfo, memoryview]) -> SparseDelta:
        r, body = rb
        t, spec = _check_against(r, base)
        have = (base_checksums or {}).get(r.name)
        kept = indexes.kept(r.name, t.numel(), spec, have) if indexes is not None and have is not None else None
        bits = _base_bits(r, t, spec, have, kept)
        have = tensor_checksum(bits) if have is None else have
        if have != int(r.base_checksum, 16):
            raise BaseChecksumMismatchError(f"receiver checksum {_hex(have)}, payload base {r.base_checksum}", r.name)
        index = None if r.encoding != "dcr" or indexes is None else \
            kept if isinstance(bits, DeviceBase) else indexes.get(r.name, bits, spec, have)
        pos, new, old = decode_record(r, body, bits, spec, index)
        noops = count_equal(old, new)
        if pos.size != r.changed or noops:
            raise MalformedRecordError(f"decoded {pos.size} changes ({noops} no-ops), header says {r.changed}", r.name)
        if updated_checksum(have, pos, old, new) != int(r.target_checksum, 16):
            raise TargetChecksumMismatchError("decoded tensor would not match the target checksum", r.name)
        return SparseDelta(r.name, r.dtype, r.shape, pos, new, old)

    deltas = map_records(record, [rb for header, bodies in split for rb in zip(header.records, bodies)], threads,
                         _changes)
    if refused is not None:
        raise refused
    out, start = [], 0
    for header, _ in split:
        out.append(DecodedPayload(header, tuple(deltas[start : start + len(header.records)])))
        start += len(header.records)
    return out


def apply(base: Mapping[str, torch.Tensor], payload, key: bytes | None = None,
          base_checksums: Mapping[str, int] | None = None) -> dict[str, int]:
    """Decode ``payload`` against ``base`` and write the changes in place.

    Every record is validated before the first write (rule 13).  Returns the touched tensors
    and how many elements of each changed.
    """
    decoded = decode(payload, base, key, base_checksums)
    writes = [d for d in decoded.deltas if d.nnz]
    for d in writes:  # every target is checked writable before the first write: no partial apply
        if not base[d.name].is_contiguous():
            raise ValueError(f"{d.name}: in-place apply needs a contiguous tensor")
    for d in writes:
        write_bits(base[d.name], d.positions, d.new_bits)
    return {d.name: d.nnz for d in writes}
