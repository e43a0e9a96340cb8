"""``nemo-dcr demo``: GRPO on the embedded SmolLM2-135M with a bit-exact delta refit per step.

Example::

    nemo-dcr demo --steps 3 --summary-json runs/demo/summary.json
    nemo-dcr demo --config configs/grpo_smollm2_cpu.yaml dcr.encoding=reference

Launches ``tp * pp`` gloo ranks with torchrun on this machine (OMP_NUM_THREADS=1 each): the
megatron-core trainer (fp32 master AdamW), the engine producing sampled rollouts (vLLM in
a process of its own by default; ``engine.kind=hf engine.placement=colocated`` for transformers), a delta refit after every step checked bitwise against an independent dense export,
and a dense refit timed in the same run.  Prints one line per step and the summary.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path

from .launch import EXIT_TIMEOUT, JobTimeoutError, check_timeout, run_job

DEFAULT_CONFIG = Path(__file__).resolve().parents[3] / "configs" / "grpo_smollm2_cpu.yaml"
WORKER = "nemo_dcr.tools.demo.grpo"


def register(subparsers) -> None:
    """Add the ``demo`` parser."""
    p = subparsers.add_parser(
        "demo", help="GRPO on CPU (megatron TP3/PP2 trainer, vLLM engine by default) with a delta refit per step",
        description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=None, help="GRPO steps (default: config run.steps)")
    p.add_argument("--summary-json", default=None, help="write the summary JSON here")
    p.add_argument("--config", default=None, help="recipe YAML (default: grpo_smollm2_cpu.yaml)")
    p.add_argument("--run-dir", default=None, help="output folder (default: config run.run_dir)")
    p.add_argument("--timeout", type=float, default=1800,
                   help=f"seconds before the job (torchrun and every rank) is stopped; exit {EXIT_TIMEOUT}")
    p.add_argument("overrides", nargs="*", help="dotted.key=value config overrides")
    p.set_defaults(func=run)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_command(config: str | None, overrides: list[str], world: int, summary: str) -> list[str]:
    """The torchrun command line of the demo worker."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
           "--master-port", str(_free_port()), "-m", WORKER, "--summary-json", summary]
    if config:
        cmd += ["--config", config]
    return cmd + list(overrides)


def run(args: argparse.Namespace) -> int:
    """Validate the config here (fast, clear errors), then launch the ranks and print the summary."""
    from nemo_dcr.tools.demo.recipe_load import load_config

    check_timeout(args.timeout)
    config = args.config or (str(DEFAULT_CONFIG) if DEFAULT_CONFIG.is_file() else None)
    overrides = list(args.overrides) + ([f"run.steps={args.steps}"] if args.steps is not None else []) + (
        [f"run.run_dir={args.run_dir}"] if args.run_dir else [])
    cfg = load_config(config, overrides)
    Path(cfg.run.run_dir).mkdir(parents=True, exist_ok=True)
    summary = args.summary_json or str(Path(cfg.run.run_dir) / "summary.json")
    Path(summary).unlink(missing_ok=True)  # a failing run leaves no summary (not an earlier run's either)
    world = cfg.trainer.tp * cfg.trainer.pp
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", TQDM_DISABLE="1",
               TRANSFORMERS_VERBOSITY="error")
    print(f"nemo-dcr demo: {world} ranks (tp={cfg.trainer.tp} pp={cfg.trainer.pp}), "
          f"{cfg.run.steps} steps, encoding {cfg.dcr.encoding}, run dir {cfg.run.run_dir}", flush=True)
    try:
        proc = run_job(build_command(config, overrides, world, summary), env, args.timeout)
    except JobTimeoutError as exc:
        print(f"nemo-dcr demo: {exc}", file=sys.stderr)
        return EXIT_TIMEOUT
    if proc.returncode != 0:
        print(f"nemo-dcr demo: the ranks failed (exit {proc.returncode})", file=sys.stderr)
        return proc.returncode
    print(json.dumps(json.loads(Path(summary).read_text()), indent=1))
    return 0
