"""A NeMo-RL-style sparse refit, written from its published design (benchmarks only; own code).

Design (NeMo-RL's sparse-refit codec, summarized): per tensor the sender finds
``locations = current_bits.ne(baseline_bits).nonzero()``, sends the positions as gaps
``diff(prepend=-1) - 1`` in the narrowest of uint16/uint32/uint64 that holds the largest gap (or
only the start when the changes are one contiguous run) and the values as ``current XOR
baseline`` at the locations; everything is concatenated, serialized and compressed with zstd
level 1.  The receiver decompresses, turns gaps back into positions (``+1``, cumsum, ``-1``),
gathers its live bits there, XORs and ``index_copy_``-s the result into the live tensor.  No
undo log, no verification.

The serialization here is a flat binary table (no pickle): generous to the peer, whose real
code goes through ``torch.save``.  The sender moves its baseline at the changed positions only
(also generous: cost in proportion to the changes).
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass

import numpy as np
import torch
import zstandard

from nemo_dcr.types import int_view

_HEAD = struct.Struct("<I")
_ROW = np.dtype([("tensor", "<u4"), ("count", "<u8"), ("width", "<u1"), ("start", "<u8")])
RANGE = 0  # the changes are one contiguous run: only its start is sent


@dataclass
class PeerTimes:
    """CPU seconds of the phases of one refit (sender: scan, pack, zstd, commit; receiver: unzstd,
    scatter)."""

    scan: float = 0.0
    pack: float = 0.0
    zstd: float = 0.0
    commit: float = 0.0
    unzstd: float = 0.0
    scatter: float = 0.0


def _gap_width(gaps: torch.Tensor) -> int:
    top = int(gaps.max()) if gaps.numel() else 0
    return 2 if top <= 0xFFFF else 4 if top <= 0xFFFFFFFF else 8


def _one(i: int, cur: torch.Tensor, base: torch.Tensor, rows: list, pos: list, vals: list,
         times: PeerTimes) -> torch.Tensor:
    """Locations of one tensor's changes; its row, gap bytes and XOR bytes appended."""
    t0 = time.process_time()
    loc = cur.ne(base).nonzero().reshape(-1)
    n = loc.numel()
    times.scan += time.process_time() - t0
    if n == 0:
        return loc
    vals.append((cur[loc] ^ base[loc]).numpy().tobytes())
    first = int(loc[0])
    if int(loc[-1]) - first + 1 == n:
        rows.append((i, n, RANGE, first))
        return loc
    gaps = torch.diff(loc, prepend=loc.new_full((1,), -1)) - 1
    width = _gap_width(gaps)
    pos.append(gaps.numpy().astype(f"<u{width}").tobytes())
    rows.append((i, n, width, 0))
    return loc


def send(names: list[str], params: dict[str, torch.Tensor], baseline: dict[str, torch.Tensor],
         times: PeerTimes, level: int = 1) -> bytes:
    """Payload of every change of ``params`` against ``baseline`` (moves the baseline after)."""
    t0 = time.process_time()
    rows, pos, vals, locs = [], [], [], []
    for i, n in enumerate(names):
        cur, base = int_view(params[n]), baseline[n]
        locs.append((base, cur, _one(i, cur, base, rows, pos, vals, times)))
    table = np.array(rows, dtype=_ROW).tobytes()
    raw = _HEAD.pack(len(rows)) + table + b"".join(pos) + b"".join(vals)
    t1 = time.process_time()
    out = zstandard.ZstdCompressor(level=level).compress(raw)
    t2 = time.process_time()
    for base, cur, loc in locs:  # the sender's baseline follows (generous: changed positions only)
        if loc.numel():
            base.index_copy_(0, loc, cur[loc])
    t3 = time.process_time()
    times.pack, times.zstd, times.commit = t1 - t0 - times.scan, t2 - t1, t3 - t2
    return out


def receive(names: list[str], live: dict[str, torch.Tensor], payload: bytes, times: PeerTimes) -> int:
    """Apply a :func:`send` payload to the live tensors in place; returns elements written."""
    t0 = time.process_time()
    raw = zstandard.ZstdDecompressor().decompress(payload)
    t1 = time.process_time()
    (count,) = _HEAD.unpack_from(raw)
    rows = np.frombuffer(raw, _ROW, count, _HEAD.size)
    at = _HEAD.size + rows.nbytes
    positions = []
    for r in rows:
        n, width = int(r["count"]), int(r["width"])
        if width == RANGE:
            positions.append(torch.arange(int(r["start"]), int(r["start"]) + n))
            continue
        gaps = torch.from_numpy(np.frombuffer(raw, f"<u{width}", n, at).astype(np.int64))
        positions.append(torch.cumsum(gaps + 1, 0) - 1)
        at += n * width
    written = 0
    for r, loc in zip(rows, positions):
        view = int_view(live[names[int(r["tensor"])]])
        n = loc.numel()
        xor = torch.from_numpy(np.frombuffer(raw, view.numpy().dtype, n, at).copy())
        at += n * view.element_size()
        view.index_copy_(0, loc, view[loc] ^ xor)
        written += n
    times.unzstd, times.scatter = t1 - t0, time.process_time() - t1
    return written
