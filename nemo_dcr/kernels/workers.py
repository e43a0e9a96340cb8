"""Worker threads for the record loops of a part (``dcr.threads``): one pool per process.

The compiled kernels release the GIL (``nogil=True``, :mod:`.jit`), so the records of a part
(encode, decode, write, read-back) run side by side on a thread pool.  :func:`map_records`
returns the results in record order and raises the first failing record's error (in record
order, after every started record finished), so the bytes, the state and the message are what
one thread gives.  Each record runs in a copy of the caller's context (:func:`~.traffic.device_path`
holds there); the host <-> device bytes a worker copies are counted into the caller's meter.
"""

from __future__ import annotations

import contextvars
import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Callable, Sequence, TypeVar

from .traffic import HostDeviceBytes, _count, measure

T = TypeVar("T")
R = TypeVar("R")

MIN_PARALLEL_CHANGES = 1 << 16
"""A part with fewer changes than this stays on the calling thread (the pool's hand-over costs
more than the kernels' work)."""

CHUNKS_PER_THREAD = 4
"""Runs of records per worker thread in one :func:`map_records` (balance against hand-overs)."""

_POOLS: dict[int, ThreadPoolExecutor] = {}
_POOL_LOCK = threading.Lock()
_IN_WORKER = threading.local()


def resolve_threads(value: int | str, processes: int | None = None) -> int:
    """Worker threads for ``value`` (``dcr.threads``): a positive int as it is; ``auto``: the cores
    this process may run on divided by the processes of this host sharing them (``processes``, by
    default ``LOCAL_WORLD_SIZE`` when set, as under torchrun, else 1), at least 1."""
    if value != "auto":
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"threads must be a positive int or 'auto', got {value!r}")
        return value
    if processes is None:
        processes = int(os.environ.get("LOCAL_WORLD_SIZE") or 1)
    return max(1, len(os.sched_getaffinity(0)) // max(1, processes))


def _pool(threads: int) -> ThreadPoolExecutor:
    """The process's pool of ``threads`` workers (created on first use; a process normally asks
    for one size)."""
    with _POOL_LOCK:
        if threads not in _POOLS:
            _POOLS[threads] = ThreadPoolExecutor(threads, thread_name_prefix="nemo-dcr-worker")
        return _POOLS[threads]


def _run(ctx: contextvars.Context, fn: Callable[[T], R], chunk: Sequence[T]) -> tuple[list[R], HostDeviceBytes]:
    """``fn`` over a chunk of items in order (stopping at the first error), in ``ctx``."""
    def counted():
        _IN_WORKER.on = True
        with measure() as crossed:
            return [fn(x) for x in chunk], crossed
    return ctx.run(counted)


def parallel(items: Sequence[T], threads: int, changes: Callable[[T], int] | None = None) -> bool:
    """:func:`map_records` hands ``items`` to worker threads (else it runs them on this thread)."""
    return (threads > 1 and len(items) > 1 and not getattr(_IN_WORKER, "on", False) and
            (changes is None or sum(changes(x) for x in items) >= MIN_PARALLEL_CHANGES))


def _chunks(items: Sequence[T], pieces: int, changes: Callable[[T], int] | None) -> list[Sequence[T]]:
    """``items`` cut into at most ``pieces`` consecutive runs of about equal changes (one hand-over
    per run, not per item)."""
    weights = [max(1, changes(x)) if changes is not None else 1 for x in items]
    total, out, start, acc = sum(weights), [], 0, 0
    for i, w in enumerate(weights):
        acc += w
        if acc * pieces >= total * (len(out) + 1) or i == len(items) - 1:
            out.append(items[start : i + 1])
            start = i + 1
    return out


def map_records(fn: Callable[[T], R], items: Sequence[T], threads: int,
                changes: Callable[[T], int] | None = None) -> list[R]:
    """``[fn(x) for x in items]``, on up to ``threads`` worker threads when there are several
    items and, with ``changes`` (changes per item), at least :data:`MIN_PARALLEL_CHANGES` of them;
    else (and inside a worker) on the calling thread.  The items go out in consecutive runs of
    about equal changes (:data:`CHUNKS_PER_THREAD` per thread).  Results in item order; an
    exception is the first failing item's (in item order), raised once no item runs any more."""
    items = list(items)
    if not parallel(items, threads, changes):
        return [fn(x) for x in items]
    pool = _pool(threads)
    futures = [pool.submit(_run, contextvars.copy_context(), fn, c)
               for c in _chunks(items, threads * CHUNKS_PER_THREAD, changes)]
    out = []
    try:
        for f in futures:
            results, crossed = f.result()
            _count(crossed.to_host, crossed.to_device)
            out += results
    except BaseException:
        for f in futures:
            f.cancel()
        wait(futures)
        raise
    return out


class Behind:
    """At most one job at a time on a thread of its own, which its next user waits for.

    For work whose result is needed only later (moving kept class indexes after a commit: the
    numba kernels release the GIL, so it runs beside what the caller does next).  :meth:`wait`
    joins the job and raises the error it ended with, once; :meth:`start` waits for the job
    before it first.

    Args:
        name: the thread's name.
    """

    def __init__(self, name: str):
        self.name = name
        self._job: tuple[threading.Thread, list[BaseException]] | None = None

    def start(self, fn: Callable[[], object]) -> None:
        """Run ``fn`` on a thread of its own (after the job before it ended)."""
        self.wait()
        failed: list[BaseException] = []

        def run():
            try:
                fn()
            except BaseException as exc:  # raised at the next wait
                failed.append(exc)

        thread = threading.Thread(target=run, name=self.name, daemon=True)
        thread.start()
        self._job = (thread, failed)

    def wait(self) -> None:
        """Wait for the job in flight, if any; raise the error it ended with."""
        job, self._job = self._job, None
        if job is not None:
            job[0].join()
            if job[1]:
                raise job[1][0]
