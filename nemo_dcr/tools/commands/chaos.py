"""``nemo-dcr chaos``: the refit path on megatron-core shards into a real engine process (the
transformers model or vLLM) with faults injected on the transport, in the engine, and on the
processes and the disk themselves; reports what was detected and recovered, bit-exactness
against an independent dense export after every refit, and mixed versions measured from rollouts
served during the refits."""

from __future__ import annotations

import argparse
import json


def register(subparsers) -> None:
    """Add the ``chaos`` subcommand."""
    from nemo_dcr.tools.chaos import FAULTS

    p = subparsers.add_parser("chaos", help="refits with injected faults across trainer and engine processes",
                              description=__doc__)
    p.add_argument("--refits", type=int, default=10)
    p.add_argument("--faults", default=",".join(f for f in FAULTS if f != "disk-full"),
                   help=f"comma-separated subset of {','.join(FAULTS)} (default: all but disk-full)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fault-rate", type=float, default=0.5, help="chance that a refit gets a fault (1: every refit)")
    p.add_argument("--tp", type=int, default=2, help="tensor parallel size of the trainer")
    p.add_argument("--pp", type=int, default=2, help="pipeline parallel size of the trainer")
    p.add_argument("--engine", choices=("hf", "vllm"), default="hf",
                   help="the engine process: the transformers model, or a real vLLM engine (slower to start)")
    p.add_argument("--transport", choices=("gloo", "store"), default="gloo",
                   help="the refit transport (disk-full needs store)")
    p.add_argument("--no-key", action="store_true", help="unauthenticated payloads (the codec's checks alone)")
    p.add_argument("--duration", type=float, default=0.0,
                   help="a soak: seconds after which no refit starts (--refits stays the most; 0: all refits)")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds before the processes are stopped (default 1800, or --duration + 1800)")
    p.add_argument("--json", action="store_true", help="print the JSON report only")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the chaos scenario; exit 1 unless bit-exact after every refit with no mixed version."""
    from nemo_dcr.tools.chaos import FAULTS, ChaosConfig, run_chaos

    faults = tuple(f for f in args.faults.split(",") if f)
    unknown = sorted(set(faults) - set(FAULTS))
    if unknown:
        raise ValueError(f"--faults: unknown {unknown}; known: {', '.join(FAULTS)}")
    if args.refits < 1 or not 0 <= args.fault_rate <= 1 or args.duration < 0:
        raise ValueError("--refits must be >= 1, --fault-rate within [0, 1] and --duration >= 0")
    timeout = args.timeout if args.timeout is not None else 1800 + args.duration
    if timeout <= args.duration:
        raise ValueError(f"--timeout {timeout} must be longer than --duration {args.duration}")
    if "disk-full" in faults and args.transport != "store":
        raise ValueError("--faults disk-full is a fault of the store transport: add --transport store")
    cfg = ChaosConfig(args.refits, faults, args.seed, args.fault_rate, tp=args.tp, pp=args.pp, keyed=not args.no_key,
                      engine=args.engine, transport=args.transport, duration_s=args.duration)
    report = run_chaos(cfg, timeout=timeout)
    if args.json:
        print(json.dumps(report))
    else:
        print(json.dumps({k: v for k, v in report.items() if k not in ("engine", "changed_per_refit")}, indent=1))
    ok = report["bit_exact_after_every_refit"] and report["mixed_version_served"] == 0 and \
        report["detected"] == report["recovered"] == report["faults_injected"]
    return 0 if ok else 1
