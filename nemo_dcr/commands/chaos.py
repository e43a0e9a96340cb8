"""``nemo-dcr chaos``: refits between separate trainer and engine processes with injected faults."""

from __future__ import annotations

import argparse
import json


def register(subparsers) -> None:
    """Add the ``chaos`` subcommand."""
    from nemo_dcr.refit.chaos import FAULTS

    p = subparsers.add_parser("chaos", help="run refits with injected faults across processes (gloo)",
                              description=__doc__)
    p.add_argument("--refits", type=int, default=10)
    p.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated subset of {','.join(FAULTS)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trainers", type=int, default=2, help="trainer processes")
    p.add_argument("--fault-rate", type=float, default=0.5, help="chance that a refit gets a fault")
    p.add_argument("--json", action="store_true", help="print the JSON report only")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the chaos scenario; exit 1 unless bit-exact after every refit with no mixed version."""
    from nemo_dcr.refit.chaos import FAULTS, ChaosConfig, run_chaos

    faults = tuple(f for f in args.faults.split(",") if f)
    unknown = sorted(set(faults) - set(FAULTS))
    if unknown:
        raise SystemExit(f"unknown faults {unknown}; known: {', '.join(FAULTS)}")
    report = run_chaos(ChaosConfig(args.refits, faults, args.seed, args.trainers, args.fault_rate))
    if args.json:
        print(json.dumps(report))
    else:
        print(json.dumps({k: v for k, v in report.items() if k not in ("engine", "changed_per_refit")}, indent=1))
    ok = report["bit_exact_after_every_refit"] and report["mixed_version_served"] == 0
    return 0 if ok else 1
