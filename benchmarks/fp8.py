"""FP8 rollout weights on real RL steps: FP8 density, scale changes, bytes vs BF16 delta and FP8 dense refit.

Usage:
    python benchmarks/fp8.py RUN_DIR [--encodings dcr,reference] [--repeat N] [--json OUT]

RUN_DIR holds checkpoints ``step_0 .. step_K`` (``nemo-dcr make-deltas --steps K --lr LR --out RUN_DIR``).
The FP8 engine starts as the full quantization of ``step_0`` (default :class:`nemo_dcr.quant.Fp8Plan`:
128x128 e4m3 blocks for the linear layers, embeddings / norms / lm_head kept BF16). For every step
it measures, in this run:

* BF16 density of the FP8 weights and FP8 density (fraction of FP8 bytes that changed);
* scale changes (blocks whose ``weight_scale_inv`` changed) and amax rescans;
* payload bytes of the FP8 delta (FP8 weights + scales + the kept BF16 tensors' changes) and of the
  BF16 delta of the same step, per encoding, and the FP8 dense refit (every engine tensor whole);
* seconds to build the FP8 delta vs a full re-quantization of the model (same run, best of N).

Every FP8 payload is decoded, checked (``quant.check_fp8_payload``), applied to the engine and the
engine compared bit for bit with the full re-quantization of the step's target.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from nemo_dcr import codec, quant
from nemo_dcr.checkpoint import load_checkpoint
from nemo_dcr.types import bits_view


def step_dirs(run: Path) -> list[Path]:
    return sorted(run.glob("step_*"), key=lambda p: int(p.name.split("_")[1]))


def payload_bytes(deltas, base, encoding: str, names=None) -> int:
    """Payload size, or the summed record sizes of ``names`` when given."""
    payload = codec.encode_deltas(deltas, {n: bits_view(t) for n, t in base.items()}, encoding=encoding)
    if names is None:
        return len(payload)
    return sum(r.length for r in codec.inspect(payload).records if r.name in names)


def best_of(repeat: int, fn):
    """``(result, best seconds)`` of ``repeat`` calls (the machine is shared: take the fastest)."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return out, best


def fp8_step(plan, engine, amax, base, target, encodings, repeat):
    """One refit of the FP8 engine: build, encode, check, apply; returns figures and the new state."""
    bf16_deltas = [d for d in codec.diff_tensors(base, target) if d.nnz]
    (deltas, new_amax, stats), t_delta = best_of(repeat, lambda: plan.deltas(bf16_deltas, target, amax))
    fp8_names = set(plan.fp8) | set(plan.scale_names.values())
    row = {"t_fp8_delta": t_delta, "bytes": {}}
    for enc in encodings:
        row["bytes"][f"fp8_delta_{enc}"] = payload_bytes(deltas, engine, enc)
        row["bytes"][f"fp8_delta_{enc}_fp8_part"] = payload_bytes(deltas, engine, enc, fp8_names)
        row["bytes"][f"bf16_delta_{enc}"] = payload_bytes(bf16_deltas, base, enc)
        row["bytes"][f"bf16_delta_{enc}_fp8_part"] = payload_bytes(bf16_deltas, base, enc, set(plan.fp8))
    payload = codec.encode_deltas(deltas, {n: bits_view(t) for n, t in engine.items()})
    row["blocks_checked"] = quant.check_fp8_payload(engine, codec.decode(payload, engine).deltas, plan)
    codec.apply(engine, payload)
    (full, full_amax), row["t_full_quantize"] = best_of(repeat, lambda: plan.quantize_model(target))
    row["bit_exact"] = all(np.array_equal(bits_view(engine[n]), bits_view(full[n])) for n in full) and all(
        np.array_equal(new_amax[n].numpy(), full_amax[n].numpy()) for n in plan.fp8)
    row.update(counts(plan, stats, bf16_deltas, full))
    return row, new_amax


def counts(plan, stats, bf16_deltas, engine) -> dict:
    """Densities and block counts of one step, summed over the FP8 weights."""
    numel = sum(s[0] * s[1] for s in plan.fp8.values())
    blocks = sum(plan.scheme.grid(s)[0] * plan.scheme.grid(s)[1] for s in plan.fp8.values())
    total = lambda key: sum(getattr(s, key) for s in stats.values())  # noqa: E731
    return {
        "fp8_numel": numel, "blocks": blocks,
        "bf16_changed_fp8_weights": total("bf16_changed"), "fp8_changed": total("fp8_changed"),
        "bf16_changed_all": sum(d.nnz for d in bf16_deltas),
        "scale_changes": total("blocks_rescaled"), "blocks_touched": total("blocks_touched"),
        "rescans": total("blocks_rescanned"),
        "fp8_dense_bytes": sum(t.numel() * t.element_size() for t in engine.values()),
        "fp8_dense_bytes_fp8_part": sum(engine[n].numel() * engine[n].element_size()
                                        for n in (*plan.fp8, *plan.scale_names.values())),
    }


def print_row(i: int, r: dict, encodings) -> None:
    b = r["bytes"]
    print(f"step {i}->{i + 1}: bit_exact={r['bit_exact']}  FP8 weights: BF16 density "
          f"{100 * r['bf16_changed_fp8_weights'] / r['fp8_numel']:.3f}%, FP8 density "
          f"{100 * r['fp8_changed'] / r['fp8_numel']:.3f}% ({r['fp8_changed']:,} bytes), scale changes "
          f"{r['scale_changes']:,}/{r['blocks']:,} blocks ({100 * r['scale_changes'] / r['blocks']:.2f}%), "
          f"touched {r['blocks_touched']:,}, rescans {r['rescans']:,}")
    for part, dense in (("", r["fp8_dense_bytes"]), ("_fp8_part", r["fp8_dense_bytes_fp8_part"])):
        label = "whole model   " if not part else "FP8 weights   "
        cells = []
        for enc in encodings:
            f, bf = b[f"fp8_delta_{enc}{part}"], b[f"bf16_delta_{enc}{part}"]
            cells.append(f"{enc}: FP8 delta {f:>11,} B  BF16 delta {bf:>11,} B  (x{bf / f:.2f})  "
                         f"dense/FP8 delta x{dense / f:.1f}")
        print(f"  {label} FP8 dense {dense:>12,} B | " + " | ".join(cells))
    print(f"  time (best of N): FP8 delta {r['t_fp8_delta']:.2f} s vs full re-quantization "
          f"{r['t_full_quantize']:.2f} s (x{r['t_full_quantize'] / r['t_fp8_delta']:.1f})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run")
    ap.add_argument("--encodings", default="dcr,reference")
    ap.add_argument("--repeat", type=int, default=3, help="timings are the best of this many runs")
    ap.add_argument("--json", help="write all figures to this JSON file")
    args = ap.parse_args()
    encodings = args.encodings.split(",")
    steps = step_dirs(Path(args.run))
    if len(steps) < 2:
        raise SystemExit(f"{args.run}: needs step_0 and step_1 at least (nemo-dcr make-deltas)")
    base = load_checkpoint(steps[0])
    plan = quant.Fp8Plan.build({n: t.shape for n, t in base.items()})
    engine, amax = plan.quantize_model(base)
    print(f"{len(plan.fp8)} FP8 weights ({sum(s[0] * s[1] for s in plan.fp8.values()):,} elements), "
          f"{len(plan.kept)} kept tensors; scheme {plan.scheme}")
    rows = []
    for i in range(len(steps) - 1):
        target = load_checkpoint(steps[i + 1])
        row, amax = fp8_step(plan, engine, amax, base, target, encodings, args.repeat)
        rows.append(row)
        print_row(i, row, encodings)
        base = target
    ok = all(r["bit_exact"] for r in rows)
    print(f"SUMMARY: {len(rows)} steps, all bit-exact={ok}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
