"""What each ``dcr.verify`` mode costs per refit, as ratios against ``incremental`` measured in the
same run (the machine is shared: absolute seconds are noisy, ratios less so).

Usage:
    python benchmarks/verify_modes.py [--numel N] [--refits R] [--steps K]

One trainer (the stand-in row-shard trainer, fp32-master AdamW) refits an in-process
``TensorEngine`` through ``DeltaRefit`` after every step; the modes run on the same steps of the
same weights, taking turns at every step. For each mode: the median total seconds of a refit, of its verify phases (the
checksum and comparison phases), and their ratio to ``incremental`` (which compares the deltas'
checksums only, with no full check within the run: ``verify_steps`` 0).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nemo_dcr.apply import TensorEngine  # noqa: E402
from nemo_dcr.config.schema import DcrConfig  # noqa: E402
from nemo_dcr.refit import DeltaRefit, colocated_wiring  # noqa: E402
from nemo_dcr.telemetry.phases import Phase  # noqa: E402
from tests.standins.shard_trainer import ShardTrainer  # noqa: E402

KEY = b"v" * 32
VERIFY_PHASES = (Phase.CHECKSUM, Phase.VERIFY)


def _setup(mode: str, numel: int, steps: int):
    cols = 1024
    shapes = {f"w{i}.weight": (numel // (4 * cols), cols) for i in range(4)}
    trainer = ShardTrainer(shapes, 0, 1, lr=2e-4)
    engine = TensorEngine({n: torch.zeros(s, dtype=torch.bfloat16) for n, s in shapes.items()}, key=KEY)
    cfg = DcrConfig(transport="inprocess", reply_timeout_s=600, telemetry_encodings=[], verify=mode,
                    verify_steps=0 if mode == "incremental" else steps)
    refit = DeltaRefit(cfg, trainer, colocated_wiring(cfg, 0, KEY), engine, key=KEY)
    refit.attach()
    return trainer, refit


def measure(modes: tuple[str, ...], numel: int, refits: int, steps: int, warmup: int = 2) -> dict:
    """Median seconds per refit (total and verify phases) of each mode; the modes take turns at
    every step (the same weights, the same load on the machine), the first ``warmup`` refits
    (compiling the kernels) left out."""
    runs = {m: _setup(m, numel, steps) for m in modes}
    seen: dict[str, dict[str, list]] = {m: dict(total=[], verify=[]) for m in modes}
    try:
        for i in range(warmup + refits):
            for m, (trainer, refit) in runs.items():
                trainer.step()
                r = refit.step()
                assert r.committed and not r.detected, r.detected
                if i >= warmup:
                    seen[m]["total"].append(r.times.get("total", 0.0))
                    seen[m]["verify"].append(sum(r.times.get(p.value, 0.0) for p in VERIFY_PHASES))
    finally:
        for _, refit in runs.values():
            refit.close(5)
    return {m: dict(total_s=statistics.median(v["total"]), verify_s=statistics.median(v["verify"]))
            for m, v in seen.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=16 << 20, help="elements of the model (4 bf16 tensors)")
    ap.add_argument("--refits", type=int, default=8)
    ap.add_argument("--steps", type=int, default=16, help="verify_steps of sampled (K)")
    args = ap.parse_args()
    out = measure(("incremental", "sampled", "full"), args.numel, args.refits, args.steps)
    base = out["incremental"]
    for m, v in out.items():
        v["total_vs_incremental"] = round(v["total_s"] / base["total_s"], 2)
        v["total_s"], v["verify_s"] = round(v["total_s"], 4), round(v["verify_s"], 4)
    print(json.dumps(dict(numel=args.numel, refits=args.refits, sampled_steps=args.steps, modes=out), indent=1))


if __name__ == "__main__":
    main()
