"""Capture: find the changed elements of local param shards against the baseline.

Comparison is always on integer views (``!=`` on int16 for bf16), never on floats: ``-0.0``
vs ``+0.0`` and two NaNs with different payloads are changes, the same NaN bits are not.
The scan works in fixed-size chunks, so its scratch memory is bounded by ``chunk`` elements
no matter how large a param is.

Each rank scans only the part of each param it owns (see :mod:`nemo_dcr.capture.ranges`):
``ranges[name] = (start, stop)`` in the param's flat index space.  Positions are reported in
the full local param's flat index space (megatron-local), so a DP slice's positions can be
remapped like any other.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from nemo_dcr.capture.baseline import BaselineStore
from nemo_dcr.kernels.scan import changed_positions, changes_np
from nemo_dcr.kernels.traffic import on_host, to_device, to_host
from nemo_dcr.kernels.workers import map_records
from nemo_dcr.types import SparseDelta, int_view, spec_of

DEFAULT_CHUNK = 1 << 24

SCANNED_PER_CHANGE = 16
"""Elements scanned that cost about what one change costs the coder: a param's weight for the
worker threads (:func:`~nemo_dcr.kernels.workers.map_records`) is its scanned range over this."""


def capture(
    params: Mapping[str, torch.Tensor],
    baseline: BaselineStore,
    ranges: Mapping[str, tuple[int, int]] | None = None,
    *,
    version: int | None = None,
    chunk: int = DEFAULT_CHUNK,
    keep_empty: bool = False,
    threads: int = 1,
) -> list[SparseDelta]:
    """Changed elements of every param since the last *committed* baseline.

    Args:
        params: local name -> live param (contiguous; any device).
        baseline: the committed bits the engine holds.
        ranges: name -> (start, stop) flat slice this rank owns; a name missing from
            ``ranges`` is scanned whole, a name mapped to an empty range is skipped.
        version: when given, the deltas are staged in ``baseline`` under this version so
            :meth:`BaselineStore.commit` can apply them once the engine acknowledged.
        chunk: elements compared per step (bounds scratch memory).
        keep_empty: also return deltas with no changed element.
        threads: worker threads over the params (``dcr.threads``) for host params: the compiled
            scan releases the GIL, so params are scanned side by side; the deltas are those of
            one thread, in the same order.

    Returns:
        One :class:`SparseDelta` per param (megatron-local index space, sorted positions,
        ``old_bits`` from the baseline).
    """
    items = []
    for name, param in params.items():
        baseline.check(name, param)
        lo, hi = (0, param.numel()) if ranges is None else ranges.get(name, (0, param.numel()))
        items.append((name, param, baseline.bits(name), lo, hi))
    if not all(on_host(p) and on_host(b) for _, p, b, _, _ in items):
        threads = 1  # a device scan is one stream of torch ops: threads add nothing
    scanned = map_records(lambda it: scan_param(*it, chunk), items, threads,
                          lambda it: max(0, it[4] - it[3]) // SCANNED_PER_CHANGE)
    deltas = [d for d in scanned if d.nnz or keep_empty]
    if version is not None:
        baseline.stage(version, deltas)
    return deltas


def scan_param(name: str, param: torch.Tensor, base: torch.Tensor, lo: int, hi: int,
               chunk: int = DEFAULT_CHUNK) -> SparseDelta:
    """Compare ``param.flat[lo:hi]`` with ``base[lo:hi]`` (integer views) in chunks."""
    spec = spec_of(param.dtype)
    cur = int_view(param)
    if on_host(cur) and on_host(base):
        return _scan_host(name, param, cur.numpy().view(spec.uint), base.numpy().view(spec.uint), lo, hi, chunk)
    pos_parts, new_parts, old_parts = [], [], []
    for start in range(lo, hi, chunk):
        stop = min(start + chunk, hi)
        c = cur[start:stop]
        b = _on(base[start:stop], c.device)
        idx = changed_positions(c, b)
        if idx.numel():  # only the changes cross to the host: positions (4 B in a chunk), new and old bits
            pos_parts.append(to_host(idx.to(torch.int32) if stop - start <= 1 << 31 else idx).to(torch.int64) + start)
            new_parts.append(to_host(c[idx]))
            old_parts.append(to_host(b[idx]))
    return SparseDelta(
        name=name, dtype=spec.name, shape=tuple(param.shape),
        positions=_cat(pos_parts, np.int64),
        new_bits=_cat(new_parts, spec.uint), old_bits=_cat(old_parts, spec.uint),
    )


def _scan_host(name: str, param: torch.Tensor, cur: np.ndarray, base: np.ndarray, lo: int, hi: int,
               chunk: int) -> SparseDelta:
    """The host scan: one compiled pass per chunk gives positions, new and old bits together."""
    parts = []
    for start in range(lo, hi, chunk):
        stop = min(start + chunk, hi)
        pos, new, old = changes_np(cur[start:stop], base[start:stop])
        if pos.size:
            pos += start
            parts.append((pos, new, old))
    pos, new, old = (np.concatenate(x) for x in zip(*parts)) if len(parts) > 1 else parts[0] if parts else \
        (np.zeros(0, np.int64), np.zeros(0, cur.dtype), np.zeros(0, cur.dtype))
    return SparseDelta(name, spec_of(param.dtype).name, tuple(param.shape), pos, new, old)


def _on(base: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A baseline chunk on the param's device: a host baseline (``pinned``, ``file``) crosses whole
    (counted); the GPU path keeps the baseline on the device (``dcr.baseline: device``)."""
    if base.device == device:
        return base
    if base.device.type == "cpu":
        return to_device(base, device)
    return base.to(device)


def _cat(parts: list[torch.Tensor], dtype) -> np.ndarray:
    if not parts:
        return np.zeros(0, dtype=dtype)
    arr = torch.cat(parts).numpy()
    return arr.astype(np.int64) if dtype is np.int64 else arr.view(dtype)

