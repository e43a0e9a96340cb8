"""``nemo-dcr make-deltas``: write real RL weight deltas of SmolLM2-135M-Instruct.

Example::

    nemo-dcr make-deltas --steps 3 --lr 1e-6 --out /tmp/deltas

writes ``/tmp/deltas/step_0 .. step_3`` (bf16 HF checkpoints, ``meta.json`` each); see
:mod:`nemo_dcr.tools.demo.task` for the objective.
"""

from __future__ import annotations

import argparse


def register(subparsers) -> None:
    """Add the ``make-deltas`` parser."""
    p = subparsers.add_parser(
        "make-deltas",
        help="train SmolLM2-135M a few AdamW steps on CPU and write bf16 step checkpoints",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--steps", type=int, required=True, help="optimizer steps (K)")
    p.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate")
    p.add_argument("--out", required=True, help="output folder for step_0 .. step_K")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--group-size", type=int, default=8, help="answers sampled per prompt")
    p.add_argument("--prompts-per-step", type=int, default=2, help="prompts (groups) per step")
    p.add_argument("--max-new-tokens", type=int, default=8, help="answer length cap")
    p.add_argument("--objective", choices=("pg", "lm"), default="pg")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run :func:`nemo_dcr.tools.demo.task.make_deltas` with the parsed options."""
    import torch

    from nemo_dcr.tools.demo.task import make_deltas

    if args.steps < 0:
        raise SystemExit("--steps must be >= 0")
    if args.threads:
        torch.set_num_threads(args.threads)
    dirs = make_deltas(
        args.out,
        args.steps,
        args.lr,
        seed=args.seed,
        group_size=args.group_size,
        prompts_per_step=args.prompts_per_step,
        max_new_tokens=args.max_new_tokens,
        objective=args.objective,
        weight_decay=args.weight_decay,
        log=lambda line: print(line, flush=True),
    )
    print(f"wrote {len(dirs)} checkpoints under {args.out}")
    return 0
