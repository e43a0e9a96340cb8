"""Run a torchrun job as a process group of its own, so that a timeout or Ctrl-C stops all of it.

torchrun starts the ranks as its children; killing torchrun alone leaves them running. The job
is started in a new session (its own process group); when it has to stop, the whole group gets
SIGTERM, then, after a grace period, SIGKILL (ranks stuck in a collective may ignore SIGTERM).
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence

EXIT_TIMEOUT = 124
"""Exit code of a command whose job ran past ``--timeout`` (as ``timeout(1)``)."""
GRACE_S = 5.0


class JobTimeoutError(RuntimeError):
    """The job ran past its timeout; every process of it was stopped."""


def check_timeout(timeout: float) -> None:
    """``--timeout`` must be positive.

    Raises:
        ValueError: it is not (the command line exits 2).
    """
    if not timeout > 0:
        raise ValueError(f"--timeout must be > 0 seconds, got {timeout}")


def run_job(cmd: Sequence[str], env: Mapping[str, str], timeout: float, capture: bool = False,
            log: str | os.PathLike | None = None, show: Callable[[str], str | None] | None = None
            ) -> subprocess.CompletedProcess:
    """Run ``cmd`` in a new process group and wait for it.

    Args:
        cmd: the command (torchrun and its arguments).
        env: its environment.
        timeout: seconds before the whole group is stopped.
        capture: collect stdout and stderr as text (else they pass through).
        log: write every line of the job's stdout and stderr to this file (instead of the terminal);
            ``show(line)`` returns the text to print for the lines the terminal should still see.

    Raises:
        JobTimeoutError: ``timeout`` passed; the group was stopped (no rank is left running).
    """
    if log is not None:
        return _run_logged(cmd, env, timeout, log, show or (lambda line: None))
    pipe = subprocess.PIPE if capture else None
    proc = subprocess.Popen(list(cmd), env=dict(env), stdout=pipe, stderr=pipe, text=capture,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_group(proc)
        raise JobTimeoutError(f"timed out after {timeout:g} s; stopped torchrun and every rank it started") from None
    except BaseException:
        stop_group(proc)
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _run_logged(cmd, env, timeout: float, log, show) -> subprocess.CompletedProcess:
    """:func:`run_job` with the output going to ``log`` and the lines ``show`` picks to the terminal."""
    proc = subprocess.Popen(list(cmd), env=dict(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, errors="replace", start_new_session=True)

    def pump() -> None:
        with open(log, "w") as f:
            for line in proc.stdout:
                f.write(line)
                f.flush()
                text = show(line)
                if text is not None:
                    print(text, flush=True)

    reader = threading.Thread(target=pump, name="nemo-dcr-job-log", daemon=True)
    reader.start()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_group(proc)
        reader.join(GRACE_S)
        raise JobTimeoutError(f"timed out after {timeout:g} s; stopped torchrun and every rank it started") from None
    except BaseException:
        stop_group(proc)
        raise
    reader.join()
    return subprocess.CompletedProcess(proc.args, proc.returncode, None, None)


def tail(path: str | os.PathLike, lines: int = 15) -> str:
    """The last ``lines`` lines of a text file ("" when it does not exist)."""
    try:
        return "".join(open(path, errors="replace").readlines()[-lines:])
    except OSError:
        return ""


def stop_group(proc: subprocess.Popen, grace: float = GRACE_S) -> None:
    """SIGTERM the process group led by ``proc``, then SIGKILL whatever is left of it."""
    _signal_group(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        pass
    _signal_group(proc.pid, signal.SIGKILL)  # ranks outlive torchrun when they ignore SIGTERM
    proc.wait()
    deadline = time.monotonic() + grace
    while _signal_group(proc.pid, 0) and time.monotonic() < deadline:  # until the kernel took them
        time.sleep(0.05)
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()


def _signal_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to the group; False when no process of it is left."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    return True
