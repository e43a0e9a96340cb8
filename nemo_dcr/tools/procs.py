"""Spawning the processes of a local multi-process check (chaos, the fan-out check)."""

from __future__ import annotations

from typing import Callable, Sequence


def run_processes(target: Callable, args: Sequence[tuple], timeout: float, what: str) -> None:
    """Run ``target(*a)`` for every ``a`` of ``args``, each in a spawned process, and wait up to
    ``timeout`` seconds for each (then kill what is left).

    Raises:
        RuntimeError: a process exited with a code other than 0 (the codes, in ``args`` order).
    """
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=a) for a in args]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
    if codes != [0] * len(procs):
        raise RuntimeError(f"{what} processes failed: exit codes {codes}")
