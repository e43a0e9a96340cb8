"""Per-core cost of the trainer-to-trainer route, per routed change, on one real step.

Usage:
    python benchmarks/route.py RUN [--pair A B] [--reps N] [--tp T] [--json OUT]

RUN holds ``step_0 .. step_K`` from ``nemo-dcr make-deltas``.  Every 2-D tensor is laid out as
megatron shards it at tensor parallelism ``--tp`` (default 3): ``o_proj`` and ``down_proj``
(row-parallel) by column slices, the others by row slices.  Trainer rank 1 captures its slice
of each and sends it to the tensor's owner, rank 0, which merges it with its own and rank 2's
pieces: the main job's route for the two thirds of a TP=3 tensor a rank captures but does not
own.  The two ranks are the real :class:`~nemo_dcr.refit.route_views.Router` of each side in
this process (attach: the views are sent and indexed once), driven through the calls its
``route`` and ``end`` make (the exchange itself left out, since the two ranks share one
process): the sender's pack (select, encode, checksums), the owner's receive (unpack, decode,
checksums, view to canonical), the merge of the pieces, and both sides' index moves.

Every time is CPU time of this process (``time.process_time``) on one core, the best of
``--reps`` forward/back pairs (``A -> B``, then ``B -> A``); the owner's merged changes are
checked against the step's own changes after every route.  Prints one JSON object: ns per
routed change of each part, and their total.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer_phases import Probe  # noqa: E402

from nemo_dcr.refit import route_views  # noqa: E402
from nemo_dcr.refit.route_views import Router  # noqa: E402
from nemo_dcr.types import SparseDelta  # noqa: E402

PROBES = {
    "select": "nemo_dcr.apply.placement.select_runs",
    "encode": "nemo_dcr.refit.route_views.encode_dcr",
    "decode": "nemo_dcr.refit.route_views.decode_dcr",
    "checksums": "nemo_dcr.refit.route_views.updated_checksum",
    "pack": "nemo_dcr.refit.route_views.pack",
    "unpack": "nemo_dcr.refit.route_views.unpack",
    "view to canonical": "nemo_dcr.apply.placement.from_view_runs",
}
"""Probed calls inside the sender's pack and the owner's receive: label -> dotted path."""


class _Rank:
    """The trainer group as the two routers see it outside an exchange: a rank and a size."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16).numpy().view(np.uint16).reshape(-1)


def _slices(name: str, shape: tuple[int, ...], tp: int) -> list[np.ndarray]:
    """Canonical flat indices each TP rank captures of a 2-D tensor."""
    rows, cols = shape
    if "o_proj" in name or "down_proj" in name:  # row-parallel: the input dimension is split
        cuts = [cols * r // tp for r in range(tp + 1)]
        return [(np.arange(rows)[:, None] * cols + np.arange(cuts[r], cuts[r + 1])[None, :]).reshape(-1)
                for r in range(tp)]
    cuts = [rows * r // tp for r in range(tp + 1)]
    return [np.arange(cuts[r] * cols, cuts[r + 1] * cols, dtype=np.int64) for r in range(tp)]


def _pieces(shapes, slices, bits_new, bits_old, rank: int, changed: bool) -> list[SparseDelta]:
    """Rank ``rank``'s pieces: its changes from ``bits_old`` (``changed``), else every element it captures."""
    out = []
    for n, shape in shapes.items():
        pos = slices[n][rank]
        if changed:
            pos = pos[bits_new[n][pos] != bits_old[n][pos]]
        out.append(SparseDelta(n, "bf16", shape, pos, bits_new[n][pos].copy(),
                               bits_old[n][pos].copy() if changed else None))
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run")
    p.add_argument("--pair", nargs=2, type=int, default=(1, 2))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--tp", type=int, default=3)
    p.add_argument("--json")
    args = p.parse_args(argv)
    if args.tp < 2:
        p.error("--tp must be at least 2 (a route needs a rank that does not own the tensor)")
    torch.set_num_threads(1)
    steps = [load_file(str(Path(args.run) / f"step_{s}" / "model.safetensors")) for s in args.pair]
    names = sorted(n for n, t in steps[0].items() if t.dim() == 2)
    shapes = {n: tuple(steps[0][n].shape) for n in names}
    bits = [{n: _bits(s[n]) for n in names} for s in steps]
    slices = {n: _slices(n, shapes[n], args.tp) for n in names}
    canonical = {n: ("bf16", shapes[n]) for n in names}
    owners = {n: 0 for n in names}
    sender, owner = Router(_Rank(1, args.tp), owners, canonical), Router(_Rank(0, args.tp), owners, canonical)
    t0 = time.perf_counter()
    owner._receive(sender._pack(_pieces(shapes, slices, bits[0], bits[0], 1, False), 0, attach=True), 1)
    print(f"[route] {len(names)} tensors attached ({time.perf_counter() - t0:.1f} s)", file=sys.stderr)

    probe, best, routed = Probe(PROBES), None, 0
    for rep in range(2 * args.reps):
        new, old = bits[(rep + 1) % 2], bits[rep % 2]
        mine = _pieces(shapes, slices, new, old, 1, True)
        theirs = [d for r in (0, 2) for d in _pieces(shapes, slices, new, old, r, True)]
        routed = sum(d.nnz for d in mine)
        probe.reset()
        with probe.active():
            c0 = time.process_time()
            blob = sender._pack(mine, 0, attach=False)
            c1 = time.process_time()
            received = owner._receive(blob, 1)
            c2 = time.process_time()
            merged = route_views.merge(theirs + received)
            c3 = time.process_time()
            moves = [m for v in (*sender.outgoing.values(), *owner.incoming.values()) if (m := v.end(True))]
            for m in moves:
                m()
            c4 = time.process_time()
        if sorted(d.name for d in merged) != names:
            raise SystemExit("route: the owner's merged changes do not cover every tensor once")
        for d in merged:
            want = np.flatnonzero(new[d.name] != old[d.name])
            if not (np.array_equal(d.positions, want) and np.array_equal(d.new_bits, new[d.name][want])):
                raise SystemExit(f"route: {d.name} merged changes differ from the step's own")
        times = {"sender pack": c1 - c0, "owner receive": c2 - c1, "merge": c3 - c2, "index moves": c4 - c3}
        times.update({f"  {k}": v for k, v in probe.seconds.items()})
        total = c4 - c0
        if best is None or total < best[0]:
            best = (total, times, len(blob))
    total, times, nbytes = best
    ns = {k: v / routed * 1e9 for k, v in times.items()}
    out = {"run": args.run, "pair": list(args.pair), "tp": args.tp, "tensors": len(names), "routed_changes": routed,
           "route_bytes": nbytes, "B_per_routed_change": nbytes / routed, "ns_per_routed_change": ns,
           "total_ns_per_routed_change": total / routed * 1e9}
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
