"""Codec benchmark on real RL deltas: bytes per changed element and throughput per encoding.

Usage:
    python benchmarks/codec.py [RUN_DIR] [--steps K] [--lr LR] [--json OUT]

RUN_DIR holds checkpoints ``step_0 .. step_K`` (``nemo-dcr make-deltas`` writes them); when it
has none they are generated first.  For each consecutive pair and each encoding it prints the
density, bytes per changed element, the ratio to ``reference`` and to dense, the two entropy
estimates, and encode/decode throughput in MB/s of model scanned, all measured in this run.
Every payload is applied to a copy of the base and compared bitwise with the target.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from nemo_dcr import codec
from nemo_dcr.checkpoint import load_checkpoint
from nemo_dcr.codec.stats import TensorStats, entropy_bits, layer_type, summarize
from nemo_dcr.types import bits_view, spec_of

ENCODINGS = ("reference", "dcr")


def step_dirs(run: Path) -> list[Path]:
    steps = sorted(run.glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
    return steps


def bits_equal(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(np.array_equal(bits_view(a[n]), bits_view(b[n])) for n in a)


def measure_pair(base: dict, target: dict) -> dict:
    """One base->target step: sizes, entropies, throughput, round-trip check per encoding."""
    model_mb = sum(t.numel() * t.element_size() for t in base.values()) / 1e6
    row = {"model_mb": model_mb, "encodings": {}}
    deltas = codec.diff_tensors(base, target)
    bits = {n: bits_view(t) for n, t in base.items()}
    stats = []
    for d in deltas:
        spec = spec_of(d.dtype)
        alike, cond = entropy_bits(bits[d.name], d.positions, d.new_bits, spec)
        stats.append(TensorStats(d.name, layer_type(d.name), d.numel, d.nnz, d.numel * spec.width, alike, cond))
    for enc in ENCODINGS:
        t0 = time.perf_counter()
        payload = codec.encode(base, target, codec.Identity(base_version=0, target_version=1), enc)
        t_enc = time.perf_counter() - t0
        copy = {n: t.clone() for n, t in base.items()}
        t0 = time.perf_counter()
        codec.apply(copy, payload)
        t_dec = time.perf_counter() - t0
        for r in codec.inspect(payload).records:
            next(s for s in stats if s.name == r.name).encoded_bytes[enc] = r.length
        row["encodings"][enc] = {"bytes": len(payload), "encode_MBps": model_mb / t_enc,
                                 "decode_MBps": model_mb / t_dec, "bit_exact": bits_equal(copy, target)}
    summary = summarize(stats)
    row["summary"] = summary
    changed = summary["total"]["changed"]
    for enc, e in row["encodings"].items():
        e["bytes_per_changed"] = e["bytes"] / max(changed, 1)
        e["ratio_to_reference"] = row["encodings"]["reference"]["bytes"] / e["bytes"]
        e["ratio_to_dense"] = summary["total"]["dense_bytes"] / e["bytes"]
    return row


def print_row(i: int, row: dict) -> None:
    t = row["summary"]["total"]
    print(f"step {i}->{i + 1}: density {100 * t['density']:.3f}% ({t['changed']:,} of {t['numel']:,}), "
          f"entropy/changed: alike {t['entropy_alike_per_changed']:.3f} B, "
          f"conditioned {t['entropy_cond_per_changed']:.3f} B")
    for enc, e in row["encodings"].items():
        print(f"  {enc:<10} {e['bytes']:>11,} B  {e['bytes_per_changed']:.3f} B/changed  "
              f"x{e['ratio_to_reference']:.2f} vs reference  x{e['ratio_to_dense']:.0f} vs dense  "
              f"encode {e['encode_MBps']:.0f} MB/s  decode+apply {e['decode_MBps']:.0f} MB/s  "
              f"bit_exact={e['bit_exact']}")
    for kind, s in row["summary"]["by_layer_type"].items():
        b = s["bytes_per_changed"]
        print(f"    {kind:<14} density {100 * s['density']:7.3f}%  dcr {b.get('dcr', 0):.3f}  "
              f"reference {b.get('reference', 0):.3f}  H_alike {s['entropy_alike_per_changed']:.3f}  "
              f"H_cond {s['entropy_cond_per_changed']:.3f} B/changed")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", nargs="?", default="runs/codec_bench")
    ap.add_argument("--steps", type=int, default=3, help="steps to generate when RUN has none")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--json", help="write all figures to this JSON file")
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    run = Path(args.run)
    if len(step_dirs(run)) < 2:
        from nemo_dcr.tools.demo.task import make_deltas

        make_deltas(run, steps=args.steps, lr=args.lr)
    steps = step_dirs(run)
    rows = []
    prev = load_checkpoint(steps[0])
    for i in range(len(steps) - 1):
        cur = load_checkpoint(steps[i + 1])
        rows.append(measure_pair(prev, cur))
        print_row(i, rows[-1])
        prev = cur
    after_first = rows[1:] or rows
    ok = all(e["bit_exact"] for r in rows for e in r["encodings"].values())
    ratio = min(r["encodings"]["dcr"]["ratio_to_reference"] for r in after_first)
    worst = max(r["encodings"]["dcr"]["bytes_per_changed"] for r in after_first)
    print(f"SUMMARY: {len(rows)} steps, all bit-exact={ok}, dcr vs reference (steps after the first): "
          f"worst ratio x{ratio:.2f}, worst {worst:.3f} B/changed")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
