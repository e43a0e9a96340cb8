"""An independent reader of the delta wire format, written from docs/wire_format.md.

It imports nothing from ``nemo_dcr``: ``struct`` + ``zstandard`` + ``json`` + pure Python bit
reading, element by element, with every MUST of the spec as an assertion. The golden tests decode
the golden payloads with it, and the fuzzers (tests/fuzz) compare every payload the codec accepts
with what it computes.
"""

from __future__ import annotations

import json
import struct

import numpy as np
import torch
import zstandard

# name -> (torch dtype, bits, exponent shift, exponent bits) as listed in spec section 4.4
SPEC = {
    "bf16": (torch.bfloat16, 16, 7, 8),
    "fp16": (torch.float16, 16, 10, 5),
    "fp32": (torch.float32, 32, 23, 8),
    "fp8_e4m3": (torch.float8_e4m3fn, 8, 3, 4),
    "fp8_e5m2": (torch.float8_e5m2, 8, 2, 5),
}
UINT = {8: np.uint8, 16: np.uint16, 32: np.uint32}
INT_VIEW = {8: torch.uint8, 16: torch.int16, 32: torch.int32}


def ibits(t: torch.Tensor) -> np.ndarray:
    """Flat unsigned integer bits of a tensor (a copy)."""
    nbits = t.element_size() * 8
    return t.contiguous().reshape(-1).view(INT_VIEW[nbits]).numpy().view(UINT[nbits]).copy()


class Parsed:
    """Preamble, header JSON, record bodies and MAC of a payload, split by the layout of section 1."""

    def __init__(self, data: bytes, key: bytes | None):
        self.magic, self.version, self.flags, self.h_len, self.h_raw = struct.unpack_from("<4sHHQQ", data, 0)
        self.comp = data[24 : 24 + self.h_len]
        self.raw = zstandard.ZstdDecompressor().decompress(self.comp, max_output_size=self.h_raw)
        self.header = json.loads(self.raw.decode("utf-8"))
        off = 24 + self.h_len
        self.bodies = []
        for r in self.header["records"]:
            self.bodies.append(data[off : off + r["length"]])
            off += r["length"]
        self.end = off
        self.mac = data[off:]


def spec_checksum(bits: np.ndarray) -> int:
    """Section 5, in pure Python integers."""
    m = (1 << 64) - 1
    total = 0
    for i, b in enumerate(int(x) for x in bits):
        x = ((i * 0x9E3779B97F4A7C15) & m) ^ (((b + 1) * 0xD6E8FEB86659FD93) & m)
        x ^= x >> 30
        x = (x * 0xBF58476D1CE4E5B9) & m
        x ^= x >> 27
        x = (x * 0x94D049BB133111EB) & m
        x ^= x >> 31
        total = (total + x) & m
    return total


def _key(b: int, nbits: int) -> int:
    sign, ones = 1 << (nbits - 1), (1 << nbits) - 1
    return (~b & ones) if b & sign else (b | sign)


def _unkey(k: int, nbits: int) -> int:
    sign, ones = 1 << (nbits - 1), (1 << nbits) - 1
    return (k & ~sign & ones) if k & sign else (~k & ones)


class _Bytes:
    def __init__(self, data: bytes):
        self.data, self.pos = data, 0

    def varint(self) -> int:
        """Unsigned LEB128, at most 10 bytes."""
        v = 0
        for i in range(10):
            byte = self.data[self.pos]
            self.pos += 1
            v |= (byte & 0x7F) << (7 * i)
            if not byte & 0x80:
                return v
        raise AssertionError("varint longer than 10 bytes")

    def byte(self) -> int:
        self.pos += 1
        return self.data[self.pos - 1]


class _Bits:
    def __init__(self, bits: list[int]):
        self.bits, self.pos = bits, 0

    def unary(self) -> int:
        q = 0
        while self.bits[self.pos] == 0:
            q += 1
            self.pos += 1
        self.pos += 1
        return q

    def fixed(self, k: int) -> int:
        v = 0
        for _ in range(k):
            v = (v << 1) | self.bits[self.pos]
            self.pos += 1
        return v

    def done(self) -> bool:
        return self.pos == len(self.bits)


def set_k(m: int, size: int) -> int:
    """Rice parameter of a coded set: ``m`` ranks coded out of ``size`` (section 4.4, integers only)."""
    return max(0, ((((size - m) // m) * 45426) >> 16).bit_length() - 1)


def spec_decode_dcr(body: bytes, base: list[int], nbits: int, shift: int, ebits: int,
                    seen: set | None = None) -> dict[int, int]:
    """Section 4.4, element by element, checking every MUST. Returns {position: new bits}.

    ``seen`` collects which parts of the coding the body used (to keep the golden data covering them).
    """
    seen = set() if seen is None else seen
    n_classes = 1 << ebits
    rd = _Bytes(body)
    # group table
    lo, n_groups = rd.varint(), rd.varint()
    assert 1 <= n_groups <= n_classes
    widths = [rd.varint() for _ in range(n_groups)]
    assert all(w >= 1 for w in widths) and lo + sum(widths) <= n_classes
    group_of = {}
    c = lo
    for g, w in enumerate(widths):
        for _ in range(w):
            group_of[c] = g
            c += 1
    cls = [(b >> shift) & (n_classes - 1) for b in base]
    # per group: its elements ordered by class, then by increasing flat index (rank = list index)
    members = [[] for _ in widths]
    for i in sorted(range(len(base)), key=lambda i: (cls[i], i)):
        if cls[i] in group_of:
            members[group_of[cls[i]]].append(i)
    table = []
    for g in range(n_groups):
        n, n_neg, m_off, n_nz, k_val = rd.varint(), 0, 0, 0, None
        assert n <= len(members[g])
        if n:
            n_neg = rd.varint()
            if n_neg == n + 1:  # literal group: reference exponent and Rice parameter
                e_ref, k_lit = rd.varint(), rd.byte()
                assert e_ref < n_classes and k_lit + shift + 1 <= 63
                table.append((n, "literal", e_ref, k_lit, None))
                continue
            m_off, n_nz = rd.varint(), rd.varint()
            assert n_neg <= n and n_nz <= n
            assert n_nz < n  # m_off is the minimum of |d| - 1: some change has exactly m_off
            if n_nz:
                k_val = rd.byte()
                assert k_val <= 63
        table.append((n, n_neg, m_off, n_nz, k_val))
    # two stream lengths, then Q || R || zero padding, and nothing after
    q_len, r_len = rd.varint(), rd.varint()
    rest = body[rd.pos :]
    assert len(rest) == (q_len + r_len + 7) // 8
    allbits = [(byte >> (7 - j)) & 1 for byte in rest for j in range(8)]
    assert not any(allbits[q_len + r_len :])
    q, r = _Bits(allbits[:q_len]), _Bits(allbits[q_len : q_len + r_len])

    def rice(k: int) -> int:
        v = (q.unary() << k) | r.fixed(k)
        assert v < 1 << 64
        return v

    def coded_set(count: int, size: int) -> list[int]:
        if count == 0:
            return []
        if count == size:
            seen.add("full_set")
            return list(range(size))
        m = count if 2 * count <= size else size - count
        k = set_k(m, size)
        seen.add("set" if m == count else "complement_set")
        seen.add("set_k>0" if k else "set_k=0")
        ranks, prev = [], -1
        for _ in range(m):
            gap = rice(k)
            assert gap < size
            prev += gap + 1
            assert prev < size
            ranks.append(prev)
        return ranks if m == count else [x for x in range(size) if x not in set(ranks)]

    out = {}
    for g, (n, n_neg, m_off, n_nz, k_val) in enumerate(table):
        if not n:
            continue
        # signs and magnitudes index the group's changes "in increasing position order" (flat index);
        # this differs from rank order only when a group's changes lie in more than one class
        changes = sorted(members[g][rank] for rank in coded_set(n, len(members[g])))
        if n_neg == "literal":  # per change: zigzag(e_new - e_ref) << (shift + 1) | sign << shift | mantissa
            seen.add("literal")
            e_ref, k_lit = m_off, n_nz
            for pos in changes:
                v = rice(k_lit + shift + 1)
                zz = v >> (shift + 1)
                e = e_ref + (zz // 2 if zz % 2 == 0 else -(zz + 1) // 2)
                assert 0 <= e < n_classes
                new = (((v >> shift) & 1) << (nbits - 1)) | (e << shift) | (v & ((1 << shift) - 1))
                assert new != base[pos]
                out[pos] = new
            continue
        neg = set(coded_set(n_neg, n))
        nz = coded_set(n_nz, n)
        seen.update({"groups>1" if n_groups > 1 else "groups=1", "m_off>0" if m_off else "m_off=0"})
        if n_nz:
            seen.add("k_val>0" if k_val else "k_val=0")
        if 0 < n_neg < n:
            seen.add("mixed_signs")
        mag = [m_off + 1] * n  # |d|
        for j in nz:
            mag[j] = rice(k_val) + 2 + m_off
        for j, pos in enumerate(changes):
            assert 0 < mag[j] < 1 << nbits
            d = -mag[j] if j in neg else mag[j]
            old = base[pos]
            s = -d if old & (1 << (nbits - 1)) else d
            out[pos] = _unkey((_key(old, nbits) + s) % (1 << nbits), nbits)
    assert q.done() and r.done()  # Q holds exactly the needed codes and ends with the last one; R too
    return out


def spec_decode_record(r: dict, body: bytes, base: list[int]) -> dict[int, int]:
    _, nbits, shift, ebits = SPEC[r["dtype"]]
    uint = np.dtype(UINT[nbits]).newbyteorder("<")
    if r["encoding"] == "same":
        assert body == b""
        return {}
    if r["encoding"] == "raw":
        new = np.frombuffer(body, dtype=uint)
        return {i: int(v) for i, v in enumerate(new) if int(v) != base[i]}
    if r["encoding"] == "reference":
        p = r["params"]
        w = p["pos_width"]
        assert p["pos_len"] + p["val_len"] == len(body)
        dz = zstandard.ZstdDecompressor()
        gaps = np.frombuffer(dz.decompress(body[: p["pos_len"]], max_output_size=r["changed"] * w), f"<u{w}")
        xor = np.frombuffer(dz.decompress(body[p["pos_len"] :], max_output_size=r["changed"] * nbits // 8), uint)
        pos = np.cumsum(gaps.astype(np.int64))
        return {int(i): base[int(i)] ^ int(x) for i, x in zip(pos, xor)}
    assert r["encoding"] == "dcr"
    return spec_decode_dcr(body, base, nbits, shift, ebits)


HEADER_KEYS = {"format": str, "model": str, "run": str, "base_version": int, "target_version": int,
               "base_checksum": str, "encodings": list, "records": list}
RECORD_KEYS = {"name": str, "dtype": str, "shape": list, "numel": int, "encoding": str, "changed": int,
               "length": int, "crc": str, "base_checksum": str, "target_checksum": str, "params": dict}


def _typed(obj, keys: dict) -> bool:
    return isinstance(obj, dict) and set(obj) == set(keys) and all(
        isinstance(obj[k], t) and not (t is int and isinstance(obj[k], bool)) for k, t in keys.items())


def _hex16(v) -> bool:
    return isinstance(v, str) and len(v) == 16 and all(c in "0123456789abcdef" for c in v)


def spec_header_problem(obj) -> str | None:
    """The first rule of sections 2-3 (rules 6-8 and the record table) the header JSON breaks; None: valid."""
    if not _typed(obj, HEADER_KEYS):
        return "rule 6: header keys and types"
    if obj["format"] != "nemo_dcr.delta" or not 0 <= obj["base_version"] < obj["target_version"]:
        return "rule 6: format or versions"
    if len(obj["model"]) > 256 or len(obj["run"]) > 256 or len(obj["records"]) > 10**6:
        return "rule 6: limits"
    if not all(isinstance(e, str) for e in obj["encodings"]) or not _hex16(obj["base_checksum"]):
        return "section 2: encodings or base_checksum"
    total = 0
    for r in obj["records"]:
        if not _typed(r, RECORD_KEYS) or r["dtype"] not in SPEC or len(r["shape"]) > 8:
            return "rule 8: record keys, types, dtype, dims"
        if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in r["shape"]):
            return "rule 8: shape"
        numel = 1
        for s in r["shape"]:
            numel *= s
        if numel != r["numel"] or numel >= 1 << 62 or not 0 <= r["changed"] <= numel or r["length"] < 0:
            return "rule 8: numel, changed, length"
        if not all(_hex16(r[k]) for k in ("crc", "base_checksum", "target_checksum")):
            return "section 3: hex fields"
        total += int(r["base_checksum"], 16)
    if len({r["name"] for r in obj["records"]}) != len(obj["records"]):
        return "rule 8: unique names"
    if total % (1 << 64) != int(obj["base_checksum"], 16):
        return "rule 7: base_checksum"
    return None
