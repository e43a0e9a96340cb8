"""CI smoke of the coverage-guided fuzzers (seconds): every target runs a few thousand inputs
through ``benchmarks/fuzz.py`` (the command that runs a million), with no crash, hang or silent
change, and its coverage grows past the seeds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("atheris", reason="the fuzzers need atheris (pip install atheris)")

ROOT = Path(__file__).resolve().parents[2]


def test_every_target_runs_clean(tmp_path):
    out = tmp_path / "fuzz.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fuzz.py"), "--inputs", "2000",
                           "--json", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert [r["target"] for r in figures["targets"]] == ["payload", "header", "envelope"]
    for r in figures["targets"]:
        assert r["inputs"] == 2000 and r["cov"] > 0 and r["corpus"] > 0, r
        assert r["crashes"] == r["hangs"] == r["silent_changes"] == 0, r
