"""``python -m nemo_dcr.refit.warm`` (run by scripts/setup_env.sh) works in a plain process."""

from __future__ import annotations

import subprocess
import sys


def test_the_warm_up_runs_the_refit_path():
    out = subprocess.run([sys.executable, "-m", "nemo_dcr.refit.warm"], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "[warm] compiled kernels ready" in out.stderr
