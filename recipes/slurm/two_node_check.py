#!/usr/bin/env python
"""Two-node check (run under torchrun, one torchrun per node): gloo all-reduce + timed transfer.

Every rank all-reduces ``arange(16) * (rank + 1)`` (int64, exact); rank 0 then sends
``--send-mb`` MB to the first rank on another host ``--repeats`` times and times each send
until the receiver's 1-element acknowledgement is back.  Rank 0 writes ``--out`` (JSON)::

    {"world_size", "hosts": [hostname per rank], "addresses": [...], "allreduce": [...],
     "send_bytes", "send_seconds": [...], "mbit_per_s": [...], "peer": rank}

The all-reduce values are reported as computed, not judged here: a caller checks them against
``arange(16) * world * (world + 1) / 2``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="result JSON written by rank 0")
    ap.add_argument("--send-mb", type=float, default=50.0, help="MB per timed send (0: none)")
    ap.add_argument("--repeats", type=int, default=3, help="timed sends")
    return ap.parse_args()


def _timed_sends(peer: int, nbytes: int, repeats: int) -> list[float]:
    """Rank 0 sends ``nbytes`` to ``peer`` ``repeats`` times; returns seconds per send."""
    rank = dist.get_rank()
    ack = torch.zeros(1, dtype=torch.uint8)
    seconds = []
    if rank not in (0, peer):
        return seconds
    buf = torch.ones(nbytes, dtype=torch.uint8) if rank == 0 else torch.empty(nbytes, dtype=torch.uint8)
    for _ in range(repeats):
        if rank == 0:
            t0 = time.perf_counter()
            dist.send(buf, peer)
            dist.recv(ack, peer)
            seconds.append(time.perf_counter() - t0)
        else:
            dist.recv(buf, 0)
            dist.send(ack, 0)
    return seconds


def main() -> int:
    args = _parse()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    host = socket.gethostname()
    me = {"host": host, "address": socket.gethostbyname(host)}
    everyone: list[dict] = [{}] * world
    dist.all_gather_object(everyone, me)
    values = torch.arange(16, dtype=torch.int64) * (rank + 1)
    dist.all_reduce(values)
    others = [r for r, who in enumerate(everyone) if who["host"] != everyone[0]["host"]]
    peer = others[0] if others else -1
    nbytes = int(args.send_mb * 1e6)
    seconds = _timed_sends(peer, nbytes, args.repeats) if peer > 0 and nbytes > 0 else []
    dist.barrier()
    if rank == 0:
        result = {
            "world_size": world,
            "hosts": [w["host"] for w in everyone],
            "addresses": [w["address"] for w in everyone],
            "allreduce": values.tolist(),
            "peer": peer,
            "send_bytes": nbytes,
            "send_seconds": seconds,
            "mbit_per_s": [nbytes * 8 / s / 1e6 for s in seconds],
            "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps({k: result[k] for k in ("hosts", "mbit_per_s")}), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
