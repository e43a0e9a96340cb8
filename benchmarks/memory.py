"""Peak memory of decode, apply and header parsing on worst-case payloads, per changed element.

Usage:
    python benchmarks/memory.py [--numel N] [--only KIND,...] [--undo-limit-mb M] [--json OUT]

Worst case: every element of an embedding-sized bf16 tensor (default 49152 x 576 = 28.3M
elements, SmolLM2's) moves one ULP away from zero, the change that codes smallest (a few hundred
bytes with ``dcr``). Each measurement runs in a fresh process: it loads the base and the payload,
resets the kernel's peak-RSS mark (``/proc/self/clear_refs``), runs the step and reads the peak
(``VmHWM``); the figure is the peak minus the RSS just before, divided by the changed elements.

Steps (``--only``):
  decode-reference, decode-dcr  ``codec.decode`` against the base (output held: positions and bits)
  apply-reference               ``apply_version`` on a ``TensorEngine`` (decode + undo log + write + verify)
  resync-reference              the same with ``resync=True``, the whole tensor (undo log of a resync)
                                (the engines hold at most ``--undo-limit-mb`` of old bits, default
                                256, and spill the rest to a temporary file)
  header                        ``codec.inspect`` of a small unauthenticated payload whose header
                                decompresses to the 64 MiB limit, and ``codec.decode`` of it
                                against a receiver (bounded by what the receiver holds)
Linux only (``/proc``). Compiled kernels are built (or loaded from their cache) before the measured step.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

EMBEDDING = 49152 * 576
KINDS = ("decode-reference", "decode-dcr", "apply-reference", "resync-reference", "header")


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def measure(fn) -> tuple[int, float, object]:
    """(peak RSS above the RSS before, seconds, result) of ``fn()`` in this process."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # peak RSS mark := current RSS
    before = _status("VmRSS:")
    t0 = time.perf_counter()
    out = fn()
    seconds = time.perf_counter() - t0
    return _status("VmHWM:") - before, seconds, out


def worst_case(numel: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(base, target): every element one ULP further from zero (bits + 1 in sign-magnitude)."""
    g = torch.Generator().manual_seed(seed)
    base = (torch.randn(numel, generator=g) * 0.02).to(torch.bfloat16)
    return base, (base.view(torch.int16) + 1).view(torch.bfloat16)


def attack_header(records: int = 270_000) -> bytes:
    """A small unauthenticated payload whose header JSON is ~55 MB of tiny ``same`` records."""
    import hashlib

    import zstandard

    from nemo_dcr.codec import header as h

    crc = hashlib.blake2b(b"", digest_size=8).hexdigest()
    rec = ('{"name":"t%d","dtype":"bf16","shape":[1],"numel":1,"encoding":"same","changed":0,"length":0,'
           '"crc":"' + crc + '","base_checksum":"0000000000000000","target_checksum":"0000000000000000",'
           '"params":{}}')
    body = ",".join(rec % i for i in range(records))
    raw = ('{"format":"%s","model":"","run":"","base_version":0,"target_version":1,'
           '"base_checksum":"0000000000000000","encodings":["same"],"records":[%s]}' % (h.FORMAT_NAME, body)).encode()
    comp = zstandard.ZstdCompressor(level=19).compress(raw)
    return h.PREAMBLE.pack(h.MAGIC, h.FORMAT_VERSION, 0, len(comp), len(raw)) + comp


def prepare(workdir: Path, numel: int, kinds) -> dict:
    """Write the base bits and the payloads the steps need; returns facts about them."""
    from nemo_dcr import codec

    base, target = worst_case(numel)
    np.save(workdir / "base.npy", base.view(torch.int16).numpy())
    facts = {"numel": numel, "changed": int((base.view(torch.int16) != target.view(torch.int16)).sum())}
    for enc in ("reference", "dcr"):
        if any(k.endswith(enc) and not k.startswith("resync") for k in kinds):
            payload = codec.encode({"e": base}, {"e": target}, encoding=enc)
            (workdir / f"{enc}.ndcr").write_bytes(payload)
            facts[f"{enc}_bytes"] = len(payload)
    if "resync-reference" in kinds:
        resync = codec.encode({"e": torch.zeros_like(target)}, {"e": target}, codec.Identity(target_version=2),
                              encoding="reference")
        (workdir / "resync.ndcr").write_bytes(resync)
        facts["resync_bytes"] = len(resync)
    if "header" in kinds:
        (workdir / "header.ndcr").write_bytes(attack_header())
        facts["header_payload_bytes"] = (workdir / "header.ndcr").stat().st_size
    return facts


def child(kind: str, workdir: Path, undo_limit: int) -> dict:
    """One step in this (fresh) process; prints nothing, returns its figures."""
    from nemo_dcr import codec
    from nemo_dcr.apply import TensorEngine, apply_version
    from nemo_dcr.verify.checksum import tensor_checksum

    from nemo_dcr.codec.warm import warm

    warm()  # compiled kernels built (or loaded from the cache) before the measured step
    bits = np.load(workdir / "base.npy")
    base = torch.from_numpy(bits).view(torch.bfloat16)
    if kind == "header":
        payload = (workdir / "header.ndcr").read_bytes()
        out = {}
        for name, fn in (("inspect", lambda: codec.inspect(payload)),
                         ("decode", lambda: codec.decode(payload, {"e": base}))):
            extra, seconds, refused = measure(lambda: _refusal(fn))
            out[name] = {"peak_extra_bytes": extra, "seconds": seconds, "refused": refused}
        return out
    enc = kind.split("-", 1)[1]
    if kind.startswith("decode"):
        payload = (workdir / f"{enc}.ndcr").read_bytes()
        ck = {"e": tensor_checksum(bits.view(np.uint16))}
        fn = lambda: codec.decode(payload, {"e": base}, base_checksums=ck)  # noqa: E731
    elif kind.startswith("apply"):
        payload = (workdir / f"{enc}.ndcr").read_bytes()
        engine = TensorEngine({"e": base}, undo_limit_bytes=undo_limit)
        fn = lambda: apply_version(engine, {0: [payload]})  # noqa: E731
    else:
        payload = (workdir / "resync.ndcr").read_bytes()
        engine = TensorEngine({"e": base}, undo_limit_bytes=undo_limit)
        fn = lambda: apply_version(engine, {0: [payload]}, resync=True)  # noqa: E731
    extra, seconds, result = measure(fn)
    figures = {"peak_extra_bytes": extra, "seconds": seconds}
    if hasattr(result, "undo_bytes"):
        figures["undo_bytes_in_memory"] = result.undo_bytes
        figures["undo_bytes_spilled"] = result.undo_spilled_bytes
    return figures


def _refusal(fn) -> str | None:
    """``fn()``; the refusal it raised (None: accepted)."""
    from nemo_dcr.codec import DeltaFormatError

    try:
        fn()
    except DeltaFormatError as exc:
        return f"{type(exc).__name__}: {str(exc)[:120]}"
    return None


def run_child(kind: str, workdir: Path, undo_limit: int) -> dict:
    """Run :func:`child` in a fresh interpreter (its own peak-RSS mark)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, __file__, "--child", kind, "--dir", str(workdir),
                           "--undo-limit", str(undo_limit)],
                          capture_output=True, text=True, env=env)
    if proc.returncode:
        raise RuntimeError(f"{kind} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--numel", type=int, default=EMBEDDING)
    p.add_argument("--only", default=",".join(KINDS), help=f"comma-separated subset of {', '.join(KINDS)}")
    p.add_argument("--undo-limit-mb", type=float, default=256, help="engines' undo log memory bound (MiB)")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--undo-limit", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, Path(args.dir), args.undo_limit)))
        return 0
    kinds = [k for k in args.only.split(",") if k]
    unknown = set(kinds) - set(KINDS)
    if unknown:
        p.error(f"unknown steps {sorted(unknown)}; known: {', '.join(KINDS)}")
    with tempfile.TemporaryDirectory() as tmp:
        facts = prepare(Path(tmp), args.numel, kinds)
        print(json.dumps(facts), flush=True)
        results = {"facts": facts}
        for kind in kinds:
            r = run_child(kind, Path(tmp), int(args.undo_limit_mb * (1 << 20)))
            if "peak_extra_bytes" in r:
                r["bytes_per_changed"] = round(r["peak_extra_bytes"] / facts["changed"], 2)
            results[kind] = r
            print(f"{kind}: {json.dumps(r)}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
