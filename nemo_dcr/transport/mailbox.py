"""The one mailbox wait of the transports that file envelopes from a receiving thread."""

from __future__ import annotations

import threading
import time
from typing import Mapping

from .base import Envelope, TransportError, TransportTimeout


def take(box: list, cond: threading.Condition, rank: int, src: int | None, timeout: float | None,
         lost: Mapping[int, TransportError] | None = None) -> Envelope:
    """The oldest envelope in ``box`` (from ``src`` when given), waiting on ``cond`` (held by the
    caller) up to ``timeout`` seconds; a :class:`TransportError` filed in the box is raised, and so
    is the error of a ``lost`` peer (``src``, or any when ``src`` is None) once nothing of it is left.

    Raises:
        TransportTimeout: nothing arrived within ``timeout``.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        for i, item in enumerate(box):
            if isinstance(item, TransportError) or src is None or item.sender == src:
                got = box.pop(i)
                if isinstance(got, TransportError):
                    raise got
                return got
        gone = [p for p in (lost or {}) if src is None or p == src]
        if gone:
            raise lost[gone[0]]
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise TransportTimeout(f"rank {rank}: nothing from {src} within {timeout}s")
        cond.wait(left)
