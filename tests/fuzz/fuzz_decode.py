"""Mutation fuzzer for the payload decoder (docs/wire_format.md).

Usage::

    python tests/fuzz/fuzz_decode.py [ITERATIONS=2000] [SEED=0]

Valid payloads (every encoding, with and without an HMAC key) are mutated at random: bit flips,
byte edits, truncation, insertion, deletion, chunk swaps, preamble field edits, header JSON edits
re-packed with zstd (MAC recomputed), and record body edits with the crc (and MAC) recomputed
so the per-encoding decoders are reached. Each mutant is applied to a fresh copy of the base.

An outcome is acceptable when either
  * a ``DeltaFormatError`` subclass is raised and every receiver tensor is bit-identical to the
    base (nothing was written), or
  * apply succeeds and every receiver tensor is bit-identical to the target.
Anything else (another exception type, a partial write, a wrong result) is a failure. Prints
the count of each outcome and the failures; exits 1 if there were any.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import random
import struct
import sys
import traceback
from collections import Counter

import numpy as np
import torch
import zstandard

from nemo_dcr.codec import apply, encode
from nemo_dcr.codec.errors import DeltaFormatError

KEY = b"fuzz-hmac-key-0123456789abcdef!!"
PRE = struct.Struct("<4sHHQQ")
INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32}


def ibits(t: torch.Tensor) -> np.ndarray:
    w = t.element_size()
    return t.contiguous().reshape(-1).view(INT_VIEW[w]).numpy().view(UINT[w]).copy()


def make_tensors(seed: int = 0) -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(seed)
    base = {
        "w.bf16": (torch.randn(24, 40, generator=g) * 0.02).to(torch.bfloat16),
        "w.fp32": torch.randn(300, generator=g) * 0.1,
        "w.fp8": torch.randn(12, 30, generator=g).to(torch.float8_e4m3fn),
        "w.e5m2": torch.randn(100, generator=g).to(torch.float8_e5m2),
        "w.same": torch.randn(9, generator=g).to(torch.float16),
        "w.scalar": torch.tensor(0.5, dtype=torch.float32),
    }
    rng = np.random.default_rng(seed)
    target = {}
    for name, t in base.items():
        b = ibits(t)
        if name == "w.same":
            new = b
        else:
            mask = rng.random(b.size) < 0.04
            mask[rng.integers(b.size)] = True
            step = rng.integers(1, 3, b.size).astype(np.int64)
            mod = 1 << (8 * t.element_size())
            new = np.where(mask, (b.astype(np.int64) + step) % mod, b).astype(b.dtype)
            new[5 % b.size] ^= b.dtype.type(1 << (8 * t.element_size() - 1)) if mask[5 % b.size] else 0
        width = t.element_size()
        signed = {1: np.uint8, 2: np.int16, 4: np.int32}[width]
        target[name] = torch.from_numpy(new.view(signed).copy()).view(t.dtype).reshape(t.shape)
    return base, target


def make_corpus(seed: int = 0):
    base, target = make_tensors(seed)
    corpus = []
    for encoding in ("dcr", "reference", "raw"):
        for key in (None, KEY):
            corpus.append((encoding, key, encode(base, target, encoding=encoding, key=key)))
    return base, target, corpus


# ----------------------------------------------------------------------------- re-packing


def split(payload: bytes, authenticated: bool):
    _, version, flags, h_len, _ = PRE.unpack_from(payload)
    obj = json.loads(zstandard.ZstdDecompressor().decompress(payload[24 : 24 + h_len]))
    bodies, off = [], 24 + h_len
    for r in obj["records"]:
        bodies.append(payload[off : off + r["length"]])
        off += r["length"]
    return version, flags, obj, bodies


def repack(obj, bodies, key, version=1, flags=None, fix=True) -> bytes:
    if fix:
        for r, b in zip(obj["records"], bodies):
            r["length"] = len(b)
            r["crc"] = hashlib.blake2b(b, digest_size=8).hexdigest()
    raw = json.dumps(obj, separators=(",", ":")).encode()
    comp = zstandard.ZstdCompressor(level=3).compress(raw)
    flags = (1 if key else 0) if flags is None else flags
    out = PRE.pack(b"NDCR", version, flags, len(comp), len(raw)) + comp + b"".join(bodies)
    return out + hmac.new(key, out, hashlib.sha256).digest() if key else out


def _remac(data: bytes, key) -> bytes:
    return data[:-32] + hmac.new(key, data[:-32], hashlib.sha256).digest() if key else data


# ----------------------------------------------------------------------------- mutations


def _random_value(rng: random.Random):
    return rng.choice([0, -1, 1, 2**31, 2**62, 2**64, -(2**63), 1.5, True, None, "", "x", "ff" * 8, [], {}, [0],
                       {"a": 1}, "dcr", "raw", "same", "reference", "bf16", "fp8_e4m3", [1, 2, 3]])


def _mutate_json(node, rng: random.Random):
    """Edit one random leaf/key of a JSON tree in place; returns the (possibly new) root."""
    if isinstance(node, dict) and node and rng.random() < 0.8:
        k = rng.choice(sorted(node))
        r = rng.random()
        if r < 0.1:
            del node[k]
        elif r < 0.15:
            node[k + "_x"] = _random_value(rng)
        elif r < 0.5 or not isinstance(node[k], (dict, list)):
            v = node[k]
            if isinstance(v, int) and not isinstance(v, bool) and rng.random() < 0.6:
                node[k] = v + rng.choice([-1, 1, -v, 2**32, 7])
            elif isinstance(v, str) and v and rng.random() < 0.6:
                i = rng.randrange(len(v))
                node[k] = v[:i] + rng.choice("0123456789abcdefz.") + v[i + 1 :]
            else:
                node[k] = _random_value(rng)
        else:
            node[k] = _mutate_json(node[k], rng)
        return node
    if isinstance(node, list) and node and rng.random() < 0.8:
        i = rng.randrange(len(node))
        r = rng.random()
        if r < 0.1:
            node.pop(i)
        elif r < 0.2:
            node.insert(i, json.loads(json.dumps(node[i])))
        elif r < 0.3:
            rng.shuffle(node)
        else:
            node[i] = _mutate_json(node[i], rng)
        return node
    return _random_value(rng)


def mutate(payload: bytes, key, rng: random.Random) -> tuple[str, bytes]:
    data = bytearray(payload)
    n = len(data)
    kind = rng.choice(["flip", "flip", "byte", "truncate", "extend", "delete", "insert", "swap", "preamble",
                       "json", "json", "body", "body", "body"])
    if kind == "flip":
        for _ in range(rng.choice([1, 1, 2, 8])):
            i = rng.randrange(n * 8)
            data[i // 8] ^= 1 << (i % 8)
    elif kind == "byte":
        data[rng.randrange(n)] = rng.randrange(256)
    elif kind == "truncate":
        data = data[: rng.randrange(n)]
    elif kind == "extend":
        data += bytes(rng.randrange(256) for _ in range(rng.randint(1, 40)))
    elif kind == "delete":
        i = rng.randrange(n)
        del data[i : i + rng.randint(1, 16)]
    elif kind == "insert":
        i = rng.randrange(n)
        data[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
    elif kind == "swap":
        i, j = sorted(rng.sample(range(n), 2))
        ln = rng.randint(1, max(1, min(16, j - i)))
        a, b = data[i : i + ln], data[j : j + ln]
        data[i : i + ln], data[j : j + ln] = b, a
    elif kind == "preamble":
        magic, version, flags, h_len, h_raw = PRE.unpack_from(data)
        field = rng.randrange(4)
        vals = [version, flags, h_len, h_raw]
        vals[field] = rng.choice([0, 1, 2, 3, 0xFFFF, h_len + rng.randint(-5, 5), h_raw + rng.randint(-5, 5),
                                  64 << 20, (64 << 20) + 1, 2**64 - 1, 2**63]) % (2**16 if field < 2 else 2**64)
        data[:24] = PRE.pack(magic, *vals)
        if rng.random() < 0.5:
            data = bytearray(_remac(bytes(data), key))
    elif kind == "json":
        version, flags, obj, bodies = split(payload, key is not None)
        obj = _mutate_json(obj, rng)
        fix = rng.random() < 0.5
        if not isinstance(obj, dict) or not isinstance(obj.get("records"), list):
            fix = False
        try:
            data = bytearray(repack(obj, bodies, key, fix=fix))
        except (TypeError, AttributeError, KeyError):  # the mutated tree broke our own re-packer
            data = bytearray(repack(obj, bodies, key, fix=False))
    elif kind == "body":
        version, flags, obj, bodies = split(payload, key is not None)
        idx = [i for i, b in enumerate(bodies) if b]
        i = rng.choice(idx)
        body = bytearray(bodies[i])
        op = rng.random()
        if op < 0.6:
            for _ in range(rng.choice([1, 1, 2, 4])):
                j = rng.randrange(len(body) * 8)
                body[j // 8] ^= 1 << (7 - j % 8)
        elif op < 0.8:
            body = body[: rng.randrange(len(body))]
        else:
            j = rng.randrange(len(body) + 1)
            body[j:j] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 4)))
        bodies[i] = bytes(body)
        data = bytearray(repack(obj, bodies, key, fix=True))
    return kind, bytes(data)


# ----------------------------------------------------------------------------- driver


def check_one(base: dict, target: dict, payload: bytes, key) -> tuple[str, str | None]:
    """``(outcome, failure)``: outcome is the exception class name or ``ok``."""
    recv = {k: v.clone() for k, v in base.items()}
    try:
        apply(recv, payload, key=key)
    except DeltaFormatError as exc:
        changed = [k for k in base if not np.array_equal(ibits(recv[k]), ibits(base[k]))]
        if changed:
            return type(exc).__name__, f"{type(exc).__name__} raised but tensors were written: {changed}"
        return type(exc).__name__, None
    except Exception as exc:  # noqa: BLE001 - anything else is the finding
        return type(exc).__name__, "".join(traceback.format_exception(exc))
    wrong = [k for k in base if not np.array_equal(ibits(recv[k]), ibits(target[k]))]
    if wrong:
        return "ok", f"apply succeeded but tensors differ from the target: {wrong}"
    return "ok", None


def run(iterations: int, seed: int = 0):
    """Returns ``(counts, failures)``; failures are ``(iteration, mutation, encoding, keyed, message, payload)``."""
    rng = random.Random(seed)
    base, target, corpus = make_corpus()
    counts, failures = Counter(), []
    for it in range(iterations):
        encoding, key, payload = corpus[rng.randrange(len(corpus))]
        kind, mutant = mutate(payload, key, rng)
        outcome, failure = check_one(base, target, mutant, key)
        counts[outcome] += 1
        if failure:
            failures.append((it, kind, encoding, key is not None, failure, mutant))
    return counts, failures


def main(argv: list[str]) -> int:
    iterations = int(argv[1]) if len(argv) > 1 else 2000
    seed = int(argv[2]) if len(argv) > 2 else 0
    counts, failures = run(iterations, seed)
    for name, c in counts.most_common():
        print(f"{c:8d}  {name}")
    print(f"{len(failures)} failures in {iterations} iterations (seed {seed})")
    shown = set()
    for it, kind, encoding, keyed, msg, _ in failures:
        sig = msg.strip().splitlines()[-1]
        if sig in shown:
            continue
        shown.add(sig)
        print(f"--- iteration {it}: mutation {kind}, encoding {encoding}, keyed {keyed}\n{msg}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
