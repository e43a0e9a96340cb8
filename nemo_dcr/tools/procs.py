"""Spawning the processes of a local multi-process check (chaos, the fan-out check)."""

from __future__ import annotations

import time
from typing import Callable, Sequence


def run_processes(target: Callable, args: Sequence[tuple], timeout: float, what: str,
                  restart: Callable[[int, int], tuple | None] | None = None) -> None:
    """Run ``target(*a)`` for every ``a`` of ``args``, each in a spawned process, and wait up to
    ``timeout`` seconds for all (then kill what is left).  ``restart(i, exit code)``: for process
    ``i`` that ended with a code other than 0, the arguments of the process that takes its place
    (None: it stays ended).

    Raises:
        RuntimeError: a process exited with a code other than 0 (the codes, in ``args`` order;
            a process restarted counts with its last one's).
    """
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=a) for a in args]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(p.is_alive() for p in procs):
        for i, p in enumerate(procs):
            again = None
            if restart is not None and not p.is_alive() and p.exitcode not in (0, None):
                again = restart(i, p.exitcode)
            if again is not None:
                procs[i] = ctx.Process(target=target, args=again)
                procs[i].start()
        time.sleep(0.05)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
    if codes != [0] * len(procs):
        raise RuntimeError(f"{what} processes failed: exit codes {codes}")
