"""``nemo-dcr demo``: GRPO on the embedded SmolLM2-135M with a bit-exact delta refit per step.

Example::

    nemo-dcr demo --steps 3 --summary-json runs/demo/summary.json
    nemo-dcr demo --config configs/grpo_smollm2_cpu.yaml dcr.encoding=reference

Launches ``tp * pp`` gloo ranks with torchrun on this machine (OMP_NUM_THREADS=1 each): the
megatron-core trainer (fp32 master AdamW), the engine producing sampled rollouts (vLLM in
a process of its own by default; ``engine.kind=hf engine.placement=colocated`` for transformers), a
delta refit after every step, and the efficient dense refit of the same weights timed in the same run
(which also checks that the engine held bit for bit what its own full load gives it).

The terminal shows one line per start-up phase and per step, then a short table; everything the
ranks and the engine print goes to ``job.log`` and ``engine.log`` in the run folder (``--verbose``:
to the terminal).  The report (``report.md`` and the plots) is written into the run folder.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

from .launch import EXIT_TIMEOUT, JobTimeoutError, check_timeout, run_job, tail

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
    p.add_argument("--verbose", action="store_true",
                   help="print everything the ranks and the engine print (vLLM's own lines included)")
    p.add_argument("--timeout", type=float, default=1800,
                   help=f"seconds before the job (torchrun and every rank) is stopped; exit {EXIT_TIMEOUT}")
    p.add_argument("overrides", nargs="*", help="dotted.key=value config overrides")
    p.set_defaults(func=run)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_command(config: str | None, overrides: list[str], world: int, summary: str,
                  start: float | None = None) -> list[str]:
    """The torchrun command line of the demo worker."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
           "--master-port", str(_free_port()), "-m", WORKER, "--summary-json", summary]
    if start is not None:
        cmd += ["--job-start", repr(start)]
    if config:
        cmd += ["--config", config]
    return cmd + list(overrides)


def _shown(line: str) -> str | None:
    """The progress lines of the worker (without their marker); everything else stays in the log."""
    from nemo_dcr.tools.demo.results import MARK

    return line[len(MARK):].rstrip("\n") if line.startswith(MARK) else None


def run(args: argparse.Namespace) -> int:
    """Validate the config here (fast, clear errors), launch the ranks, then the report and the table."""
    from nemo_dcr.tools.demo.recipe_load import load_config

    start = time.time()
    check_timeout(args.timeout)
    config = args.config or (str(DEFAULT_CONFIG) if DEFAULT_CONFIG.is_file() else None)
    overrides = list(args.overrides) + ([f"run.steps={args.steps}"] if args.steps is not None else []) + (
        [f"run.run_dir={args.run_dir}"] if args.run_dir else []) + (["run.verbose=true"] if args.verbose else [])
    cfg = load_config(config, overrides)
    run_dir = Path(cfg.run.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    summary = args.summary_json or str(run_dir / "summary.json")
    Path(summary).unlink(missing_ok=True)  # a failing run leaves no summary (not an earlier run's either)
    world = cfg.trainer.tp * cfg.trainer.pp
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", TQDM_DISABLE="1",
               TRANSFORMERS_VERBOSITY="error")
    engine = f"{cfg.engine.kind} engine ({cfg.engine.placement})"
    print(f"nemo-dcr demo: GRPO on {cfg.trainer.model}, megatron-core TP={cfg.trainer.tp} PP={cfg.trainer.pp} "
          f"({world} gloo ranks), {engine}, {cfg.run.steps} steps, dcr.encoding={cfg.dcr.encoding}, "
          f"run folder {run_dir}", flush=True)
    log = None if cfg.run.verbose else run_dir / "job.log"
    try:
        proc = run_job(build_command(config, overrides, world, summary, start), env, args.timeout,
                       log=log, show=_shown)
    except JobTimeoutError as exc:
        print(f"nemo-dcr demo: {exc}" + (f"; its output: {log}" if log else ""), file=sys.stderr)
        return EXIT_TIMEOUT
    if proc.returncode != 0:
        _failed(proc.returncode, log, run_dir)
        return proc.returncode
    return _finish(run_dir, summary)


def rank_errors(log: Path, most: int = 4) -> list[str]:
    """The distinct exception lines the ranks printed (``[rankN]: SomeError: ...``), first seen first."""
    import re

    seen: dict[str, str] = {}
    try:
        lines = open(log, errors="replace").readlines()
    except OSError:
        return []
    for line in lines:
        m = re.match(r"\[rank(\d+)\]: ((?:\w+\.)*\w*(?:Error|Exception|Interrupt)\b.*)", line.rstrip())
        key = re.sub(r"\d+", "N", m.group(2)) if m else None  # the same error from another port or pid
        if key and key not in seen:
            seen[key] = f"rank {m.group(1)}: {m.group(2)}"
    return list(seen.values())[:most]


def _failed(code: int, log: Path | None, run_dir: Path) -> None:
    """Say that the job failed, with the last lines of its log and where the logs are."""
    print(f"nemo-dcr demo: the ranks failed (exit {code})", file=sys.stderr)
    if log is not None:
        errors = rank_errors(log)
        print(f"the ranks' errors (from {log}):\n" + "".join(f"  {e}\n" for e in errors) if errors
              else f"last lines of {log}:\n{tail(log)}", file=sys.stderr, end="")
        engine_log = run_dir / "engine.log"
        if engine_log.is_file():
            print(f"the engine's output: {engine_log}", file=sys.stderr)


def _finish(run_dir: Path, summary: str) -> int:
    """Write the report into the run folder and print the closing table."""
    from nemo_dcr.tools.demo.results import table
    from nemo_dcr.tools.run_report import write_report

    report = write_report(run_dir)
    print("results:\n" + table(json.loads(Path(summary).read_text()), str(run_dir), report["files"]), flush=True)
    return 0
