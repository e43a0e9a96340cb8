"""``nemo-dcr check-engine``: preflight an inference engine's refit before a long job.

From a Hugging Face config folder (``config.json``; no weights, nothing downloaded) it makes
random bf16 weights, starts the engine on them (probing where and how every canonical tensor
lands; what cannot be refit is refused here, before anything is sent), makes ``--steps`` sparse
bf16 steps (a few percent of the elements moved by a few ULPs, as optimizer steps do), delta-refits
the live engine along them through the refit path (the first sync with ``dcr.preflight``), then
compares every parameter, buffer and tensor attribute of every rank with a *fresh* engine
loaded densely from the last step (its loader and post-load processing included), by integer
views, and compares greedy tokens.

Exit codes: 0 bit-exact; 1 something differs (each tensor named with its count); 3 refused up
front (what and why); 2 bad arguments.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Mapping

import torch

ENGINES = ("vllm",)


def register(subparsers) -> None:
    """Add the ``check-engine`` subcommand."""
    p = subparsers.add_parser("check-engine", help=__doc__.splitlines()[0], description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", required=True, choices=ENGINES)
    p.add_argument("--config", required=True, metavar="DIR", help="Hugging Face config folder (config.json)")
    p.add_argument("--steps", type=int, default=2, metavar="N", help="sparse bf16 steps to refit along (default 2)")
    p.add_argument("--tp", type=int, default=1, metavar="T", help="engine tensor-parallel ranks (default 1)")
    p.add_argument("--density", type=float, default=0.02, help="fraction of elements each step moves (default 0.02)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run)


def sparse_step(tensors: Mapping[str, torch.Tensor], density: float, seed: int) -> dict[str, torch.Tensor]:
    """``tensors`` with ``density`` of each bf16 one's elements moved by 1-4 ULPs up or down (on the
    integer view; never onto an Inf or NaN pattern), as a bf16 optimizer step moves weights."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in tensors.items():
        if t.dtype != torch.bfloat16:  # only bf16 weights move (the wire format's other floats stay)
            out[name] = t
            continue
        bits = t.contiguous().view(torch.int16).clone().reshape(-1)
        mask = torch.rand(bits.shape, generator=g) < density
        step = torch.randint(1, 5, bits.shape, generator=g, dtype=torch.int16)
        step = torch.where(torch.rand(bits.shape, generator=g) < 0.5, -step, step)
        moved = bits + step
        finite = (moved & 0x7F80) != 0x7F80
        bits = torch.where(mask & finite & ((bits & 0x7F80) != 0x7F80), moved, bits)
        out[name] = bits.view(torch.bfloat16).reshape(t.shape)
    return out


def _folder_like(model_dir: Path, tensors: Mapping[str, torch.Tensor], out: Path) -> Path:
    from nemo_dcr.checkpoint import save_checkpoint

    out.mkdir(parents=True)
    for f in model_dir.iterdir():
        if f.suffix == ".json" and not f.name.endswith("index.json"):
            shutil.copy(f, out / f.name)
    save_checkpoint(dict(tensors), out)
    return out


def run(args: argparse.Namespace) -> int:
    """Make the weights and steps, run the check, print it; returns the exit code."""
    from nemo_dcr.integrations.vllm.check import EXIT_BAD_ARGS, check_engine

    config = Path(args.config)
    bad = [m for ok, m in ((args.steps >= 1, f"--steps must be >= 1, got {args.steps}"),
                           (args.tp >= 1, f"--tp must be >= 1, got {args.tp}"),
                           (0 < args.density <= 1, f"--density must be in (0, 1], got {args.density}"),
                           ((config / "config.json").is_file(), f"--config {config}: no config.json there")) if not ok]
    if bad:
        print(f"nemo-dcr check-engine: error: {'; '.join(bad)}", file=sys.stderr)
        return EXIT_BAD_ARGS
    from nemo_dcr.checkpoint import load_checkpoint
    from nemo_dcr.integrations.hf.model import random_checkpoint

    with tempfile.TemporaryDirectory(prefix="nemo_dcr_check_engine_") as tmp:
        base = random_checkpoint(config, Path(tmp) / "base", args.seed)
        tensors = {n: t.clone() for n, t in load_checkpoint(base).items()}
        steps = []
        for k in range(args.steps):
            tensors = sparse_step(tensors, args.density, args.seed + 1 + k)
            steps.append(_folder_like(base, tensors, Path(tmp) / f"step_{k + 1}"))
        check = check_engine(base, steps, tp=args.tp)
    if args.json:
        print(json.dumps(check.to_json(), indent=1))
    else:
        print("\n".join(check.lines()))
    return check.exit_code
