"""Link between the two nodes of the local Slurm cluster: throughput without and with shaping.

    sudo python benchmarks/slurm_link.py [--rate 100mbit] [--send-mb 50]

Brings up the two-node cluster once (``scripts/slurm_cluster.sh up``), runs
``recipes/slurm/two_node_check.sbatch`` (rank 0 on ``n1`` sends ``--send-mb`` MB to the rank on
``n2`` three times, each timed until the 1-byte acknowledgement is back), shapes both nodes'
links with ``tc tbf`` at ``--rate``, runs the same job again, and tears the cluster down.
Prints both throughputs, the shaped one as a fraction of the configured rate, and the
unshaped/shaped ratio; ``--json`` writes them.  Exits 77 where the cluster cannot run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "slurm_cluster.sh"
JOB = REPO / "recipes" / "slurm" / "two_node_check.sbatch"
SKIPPED = 77


def _cluster(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(["bash", str(SCRIPT), *args], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, **(env or {})})
    if proc.returncode == SKIPPED:
        sys.stderr.write(proc.stderr)
        raise SystemExit(SKIPPED)
    if proc.returncode != 0:
        raise SystemExit(f"slurm_cluster.sh {args[0]} failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}")
    return proc


def _job(folder: str, send_mb: float, out: Path) -> dict:
    """Run the transfer job on the cluster; its result JSON."""
    env = {"RESULT": str(out), "SEND_MB": str(send_mb), "PYTHON": sys.executable, "REPO": str(REPO)}
    _cluster("submit", "--dir", folder, str(JOB), env=env)
    return json.loads(out.read_text())


def _rate_mbit(rate: str) -> float:
    """``100mbit`` -> 100.0 (tc units: kbit, mbit, gbit)."""
    found = re.fullmatch(r"([0-9.]+)(kbit|mbit|gbit)", rate)
    if not found:
        raise SystemExit(f"--rate {rate!r}: give a number with kbit, mbit or gbit (tc units)")
    return float(found.group(1)) * {"kbit": 1e-3, "mbit": 1.0, "gbit": 1e3}[found.group(2)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", default="100mbit", help="tc rate of the shaped link")
    ap.add_argument("--send-mb", type=float, default=50.0)
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args()
    configured = _rate_mbit(args.rate)
    folder = _cluster("up").stdout.strip().splitlines()[-1]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            free = _job(folder, args.send_mb, Path(tmp) / "free.json")
            _cluster("shape", "--dir", folder, args.rate)
            shaped = _job(folder, args.send_mb, Path(tmp) / "shaped.json")
    finally:
        _cluster("down", "--dir", folder)
    # the first send includes connection set-up: the median of all three is reported
    free_mbit = statistics.median(free["mbit_per_s"])
    shaped_mbit = statistics.median(shaped["mbit_per_s"])
    figures = {
        "send_mb": args.send_mb, "hosts": free["hosts"], "rate": args.rate,
        "unshaped_mbit_per_s": free["mbit_per_s"], "shaped_mbit_per_s": shaped["mbit_per_s"],
        "shaped_over_rate": shaped_mbit / configured, "unshaped_over_shaped": free_mbit / shaped_mbit,
    }
    print(f"{args.send_mb:g} MB n1 -> n2, median of 3 sends")
    print(f"  unshaped           {free_mbit:10.1f} Mbit/s")
    print(f"  tbf {args.rate:<14} {shaped_mbit:10.1f} Mbit/s  ({figures['shaped_over_rate']:.3f} of the rate)")
    print(f"  unshaped / shaped  {figures['unshaped_over_shaped']:10.1f}x")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
