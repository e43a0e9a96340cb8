"""``DeltaRefit.from_config`` derives the model description from a built megatron-core model (its
TransformerConfig and module tree) for every family the layout tables know, and refuses what the
tables cannot describe with an error naming it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from launch import REPO, free_port

pytestmark = pytest.mark.distributed


def test_description_from_the_model_and_clear_refusals():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", MASTER_PORT=str(free_port()),
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "tests/distributed/describe_worker.py"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, family in (("dense-tiny", "llama"), ("qwen3-moe-tiny", "qwen3_moe"), ("deepseek-tiny", "deepseek_v3")):
        assert out[name]["diff"] == {} and out[name]["family"] == family, out[name]
    assert out["dense-tiny"]["padded"] == 1024  # megatron's padded rows, kept apart from the real vocabulary
    e = out["errors"]
    assert "add_bias_linear" in e["bias"] and "normalization" in e["norm"] and "RMSNorm" in e["norm"]
    assert "vocab_size=5000" in e["vocab"] and "1024" in e["vocab"]
    assert e["not_a_model"].startswith("TypeError") and "megatron-core" in e["not_a_model"]
