"""Launch a torchrun job (gloo, CPU) from pytest and read its JSON result."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """An unused TCP port on localhost for torchrun's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(target: list[str], nproc: int, out: Path, timeout: int = 300) -> dict:
    """Run ``torchrun --nproc-per-node nproc <target...>``; assert rc 0; return ``out``'s JSON.

    Args:
        target: script path or ``["-m", module]`` followed by its arguments.
        nproc: number of ranks.
        out: the JSON file the job writes (rank 0 or the reporting rank).
        timeout: seconds before the job is killed.
    """
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-port", str(free_port()), *target]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(Path(out).read_text())
