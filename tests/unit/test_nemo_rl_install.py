"""recipes/nemo_rl/install_into_workers.sh: nemo_dcr and numba go into the environments NeMo-RL
builds for its policy and vLLM workers (and its project environment), nowhere else, with each
environment's torch and numpy pinned, and the plugin is imported with each one's Python.

NeMo-RL's environments are stood in for by folders named as NeMo-RL names them (the actor's
class path) whose ``bin/python`` runs this test's interpreter; ``uv`` is a stub that records its
arguments.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "recipes" / "nemo_rl" / "install_into_workers.sh"
ENVS = ["nemo_rl.models.policy.workers.megatron_policy_worker.MegatronPolicyWorker",
        "nemo_rl.models.generation.vllm.vllm_worker.VllmGenerationWorker",
        "nemo_rl.environments.math_environment.MathEnvironment"]


def python_at(folder: Path) -> None:
    (folder / "bin").mkdir(parents=True)
    py = folder / "bin" / "python"
    py.write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
    py.chmod(0o755)


def run(tmp_path: Path, envs: list[str]) -> subprocess.CompletedProcess:
    rl = tmp_path / "RL"
    for name in envs:
        python_at(rl / "venvs" / name)
    python_at(rl / ".venv")
    uv = tmp_path / "uv"
    uv.write_text(f"#!/bin/sh\necho \"$*\" >> {tmp_path / 'uv.log'}\n")
    uv.chmod(0o755)
    env = {**os.environ, "NEMO_RL_DIR": str(rl), "NEMO_DCR_UV": str(uv), "PYTHONPATH": str(ROOT)}
    env.pop("NEMO_RL_VENV_DIR", None)
    return subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=300)


def test_installs_into_the_policy_and_vllm_worker_environments_only(tmp_path):
    done = run(tmp_path, ENVS)
    assert done.returncode == 0, done.stderr
    calls = (tmp_path / "uv.log").read_text().splitlines()
    rl = tmp_path / "RL"
    targets = [rl / "venvs" / n for n in sorted(ENVS[:2])] + [rl / ".venv"]  # in the order of the glob
    torch_pin = f"torch=={torch.__version__}"
    assert len(calls) == 2 * len(targets)
    for i, target in enumerate(targets):
        plugin, deps = calls[2 * i], calls[2 * i + 1]
        assert plugin == f"pip install --python {target}/bin/python --no-deps {ROOT}"
        assert deps.startswith(f"pip install --python {target}/bin/python {torch_pin} numpy==")
        assert deps.endswith("numba>=0.60 zstandard>=0.22 safetensors>=0.6")
    assert not any(ENVS[2] in c for c in calls)  # not a worker the plugin runs in
    assert done.stdout.count("nemo_dcr.integrations.nemo_rl:DcrCheckpointEngine imports, numba") == 3
    assert "installed into 2 worker environment(s)" in done.stdout


def test_refuses_when_nemo_rl_built_no_worker_environment(tmp_path):
    done = run(tmp_path, ENVS[2:])
    assert done.returncode == 2 and "no policy or vLLM worker environment" in done.stderr
    assert not (tmp_path / "uv.log").exists()


def test_ray_sub_submission_checks_first_then_installs_and_runs_through_the_driver(tmp_path):
    """recipes/nemo_rl/submit_ray_sub.sh: the driver's check on the submit host, then sbatch of
    NeMo-RL's ray.sub with SETUP_COMMAND (install on every node) and COMMAND (the driver)."""
    rl = tmp_path / "RL"
    rl.mkdir()
    (rl / "ray.sub").write_text("#!/bin/bash\n")
    log = tmp_path / "calls.log"
    stub = tmp_path / "stub-python"  # NeMo-RL's `uv run python`, recording its arguments
    stub.write_text(f"#!/bin/sh\necho \"python $*\" >> {log}\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f"#!/bin/sh\n{{ echo \"sbatch $*\"; echo \"SETUP $SETUP_COMMAND\"; "
                                    f"printf '%s\\n' \"$COMMAND\" > {tmp_path / 'command.sh'}; }} >> {log}\n")
    for f in (stub, bin_dir / "sbatch"):
        f.chmod(0o755)
    env = {**os.environ, "NEMO_RL_DIR": str(rl), "NEMO_RL_RUN": str(stub), "PATH": f"{bin_dir}:{os.environ['PATH']}",
           "NEMO_DCR_REFIT_DIR": str(tmp_path / "refit"), "NEMO_DCR_KEY_FILE": str(tmp_path / "k" / "hmac.key")}
    script = ROOT / "recipes" / "nemo_rl" / "submit_ray_sub.sh"
    done = subprocess.run(["bash", str(script), "--nodes=2", "--", "grpo.max_num_steps=3"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    config = ROOT / "configs" / "nemo_rl" / "grpo_math_1B_megatron_dcr.yaml"
    check, sbatch, setup = log.read_text().splitlines()
    driver = "-m nemo_dcr.integrations.nemo_rl.driver"
    assert check == f"python {driver} --check-only examples/run_grpo.py --config {config} grpo.max_num_steps=3"
    assert sbatch == "sbatch --nodes=2 ray.sub" and len((tmp_path / "k" / "hmac.key").read_bytes()) == 32
    assert setup.endswith(f"NEMO_DCR_PREFETCH=1 NEMO_RL_DIR={rl} {ROOT}/recipes/nemo_rl/install_into_workers.sh")
    ran = subprocess.run(["bash", str(tmp_path / "command.sh")], env=env, capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0, ran.stderr  # what ray.sub runs in the head container
    assert log.read_text().splitlines()[-1] == f"python {driver} examples/run_grpo.py --config {config} " \
                                               "grpo.max_num_steps=3"
