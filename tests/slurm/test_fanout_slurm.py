"""Fan-out on a real three-node Slurm cluster on this machine (``slurm_cluster.sh fanout``): the
trainer on n1 behind a 100 Mbit/s link, engine replicas on n2 and n3; every replica bit-exact
after every refit, relay crossing once per version whatever R, direct R times, failing replicas
resynced alone.  Skipped with the script's reason where it cannot run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]
SKIPPED = 77


def test_relay_crosses_once_per_version_on_three_nodes():
    env = {**os.environ, "PYTHON": sys.executable, "JOB_TIMEOUT": "600", "FANOUT_REPLICAS": "1 4"}
    proc = subprocess.run(["bash", "scripts/slurm_cluster.sh", "fanout", "--rate", "100mbit"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=1500)
    if proc.returncode == SKIPPED:
        pytest.skip([x for x in proc.stderr.splitlines() if x.startswith("skipped:")][-1])
    assert proc.returncode == 0, proc.stderr[-4000:]
    runs = {(r["mode"], r["replicas"]): r for r in json.loads((REPO / "runs/slurm-fanout/summary.json").read_text())
            if r["replicas"] in (1, 4)}
    assert all(r["bit_exact_steps"] == r["steps"] == 6 for r in runs.values()), runs
    one = runs["relay", 1]["cross_link_bytes_per_version"]
    assert runs["relay", 4]["cross_link_bytes_per_version"] <= 1.1 * one
    assert runs["direct", 4]["cross_link_bytes_per_version"] >= 3.5 * one
    assert runs["relay", 4]["engine_fanout_bytes_per_version"] == pytest.approx(
        3 * runs["relay", 4]["cross_link_bytes_per_version"])
    assert runs["relay", 4]["resynced_alone"] == [3, 5] and runs["direct", 4]["resynced_alone"] == [3]
