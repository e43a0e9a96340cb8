"""``benchmarks/gpu.sh --device cpu`` (what CI runs of the GPU check): the device code path of one refit
on host tensors, tiny, bit-exact, and the bytes counted across PCIe follow the changes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_runs_on_the_cpu(tmp_path):
    out = tmp_path / "gpu.json"
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT)}
    run = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu.sh"), "--device", "cpu", "--hidden", "128",
                          "--layers", "1", "--json", str(out)], env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr
    s = json.loads(out.read_text())
    assert s["bit_exact"] and s["targets"]["host_bytes_le_64_per_changed"]
    assert 0.005 < s["density"] < 0.02 and s["changed"] > 1000
    for side in ("trainer", "engine"):
        per = s["host_bytes_per_changed"][side]
        assert 0 < per["to_host"] + per["to_device"] <= 64
        assert s["host_bytes_vs_dense"][side] > 1  # fewer bytes than a dense refit's at 1%
    assert s["decode_to_host_bytes_per_changed"] == 2.0  # the old bits at the changed positions only
    assert "SUMMARY " in run.stdout
