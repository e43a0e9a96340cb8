"""``nemo-dcr plan --calibrate``: kernel throughput of this machine, one core, the real code paths.

Every figure times the function the refit path calls: the capture scan
(:func:`nemo_dcr.kernels.scan_changes`), the remap of a real layout plan, routing
(:class:`~nemo_dcr.refit.route_views.Router`: ``dcr`` against each sender's view), the codec
(:func:`~nemo_dcr.codec.encode_deltas`, :func:`~nemo_dcr.codec.decode`) and the engine's write
with undo log and read-back (:class:`nemo_dcr.apply.transaction.UndoLog`).  Data: a real step of
``nemo-dcr make-deltas`` when a run folder is given, else an Adam-like step on random weights.

Encode and decode cost a pass over each tensor plus work per change, so both are timed at two
densities of the same tensors (the real change set and every 8th change of it) and the two
rates solved from the pair.  Each timing is the best of a few repeats, in CPU time of the
calling thread (the machine may be shared).  The result is written where plans read it
(``figures/cpu.json``), so a faster codec reaches every plan by rerunning this.
"""

from __future__ import annotations

import datetime
import json
import platform
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from nemo_dcr.apply.transaction import UndoLog
from nemo_dcr.checkpoint import atomic_write
from nemo_dcr.codec import Identity, decode, encode_deltas, inspect
from nemo_dcr.kernels import read_bits, scan_changes
from nemo_dcr.layout import ParallelLayout, build_plan, model_dims
from nemo_dcr.refit.route_views import Router
from nemo_dcr.types import SparseDelta, bits_view, carrier, spec_of
from nemo_dcr.verify.checksum import tensor_checksum, updated_checksum

from .figures import CPU_FIGURES, Kernels


def best_of(fn: Callable[[], object], reps: int = 3) -> float:
    """Smallest CPU time of this thread over ``reps`` calls after one warm-up.

    CPU time, not wall time: on a shared machine the wall clock also counts time other
    processes held the core; a plan models sharing itself (cores per node over ranks).
    """
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.thread_time()
        fn()
        best = min(best, time.thread_time() - t0)
    return best


def adam_like(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 weights and the weights after an Adam-like step (about 1% of elements move 1-2 ULPs)."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, generator=g) * 0.02).to(torch.bfloat16)
    step = torch.randn(n, generator=g) * 2e-5
    return w, (w.float() + step).to(torch.bfloat16)


def load_pair(run: str | None, elements: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """name -> (base, target) flat tensors: step 1 -> 2 of a make-deltas run, else synthetic."""
    if run is None:
        w, t = adam_like(elements)
        return {"synthetic.weight": (w, t)}
    from nemo_dcr.checkpoint import load_checkpoint

    base, target = load_checkpoint(Path(run) / "step_1"), load_checkpoint(Path(run) / "step_2")
    return {n: (base[n].reshape(-1), target[n].reshape(-1)) for n in base if base[n].dtype == torch.bfloat16}


def _deltas(pair, every: int = 1) -> list[SparseDelta]:
    out = []
    for name, (b, t) in pair.items():
        pos, new = scan_changes(t, b)
        pos, new = pos[::every].numpy(), new[::every].numpy()
        out.append(SparseDelta(name, spec_of(b.dtype).name, (b.numel(),), pos.astype(np.int64),
                               new.view(np.uint16), bits_view(b)[pos]))
    return out


def _solve(times: tuple[float, float], changes: tuple[int, int], elements: int) -> tuple[float, float]:
    """(pass GB/s, changes/s) from times at two change counts over the same elements."""
    per_change = max((times[0] - times[1]) / max(changes[0] - changes[1], 1), 1e-12)
    pass_s = max(times[0] - changes[0] * per_change, 1e-9)
    return elements * 2 / pass_s / 1e9, 1.0 / per_change


def _codec(pair, encoding: str) -> dict[str, float]:
    base = {n: bits_view(b) for n, (b, _) in pair.items()}
    tensors = {n: b.clone() for n, (b, _) in pair.items()}
    cks = {n: tensor_checksum(v) for n, v in base.items()}
    elements = sum(v.size for v in base.values())
    enc_t, dec_t, counts, sizes = [], [], [], []
    for every in (1, 8):
        ds = _deltas(pair, every)
        payload = encode_deltas(ds, base, Identity(), encoding, None, cks)
        enc_t.append(best_of(lambda: encode_deltas(ds, base, Identity(), encoding, None, cks)))
        dec_t.append(best_of(lambda: decode(payload, tensors, None, cks)))
        counts.append(sum(d.nnz for d in ds))
        sizes.append((len(payload), sum(r.length for r in inspect(payload).records), len(ds)))
    enc_pass, enc_rate = _solve(tuple(enc_t), tuple(counts), elements)
    dec_pass, dec_rate = _solve(tuple(dec_t), tuple(counts), elements)
    header = (sizes[0][0] - sizes[0][1]) / sizes[0][2]
    return {"encode_pass_gbps": enc_pass, "encode_per_s": enc_rate, "decode_pass_gbps": dec_pass,
            "decode_per_s": dec_rate, "header_bytes_per_record": header, "changes": counts[0],
            "elements": elements, "encode_s": enc_t[0], "decode_s": dec_t[0]}


def _remap_rate() -> float:
    """Changes per second through the real remap of SmolLM2's qkv shard at TP=3 (half its elements)."""
    plan = build_plan("llama", model_dims("smollm2"), ParallelLayout(tp=3, pp=2, tp_rank=1))
    name = "decoder.layers.3.self_attention.linear_qkv.weight"
    numel = plan.params[name].numel
    idx = torch.from_numpy(np.sort(np.random.default_rng(0).choice(numel, numel // 2, replace=False)))
    return idx.numel() / best_of(lambda: plan.remap(name, idx))


class _Relay:
    """Trainer-group stand-in that lets one thread time a route: ranks ``1..size-1`` send, rank 0
    (the owner of everything) receives what they handed over."""

    def __init__(self, rank: int, size: int, mailbox: dict):
        self.rank, self.size, self.mailbox = rank, size, mailbox

    def exchange(self, outgoing):
        if self.rank:
            self.mailbox[self.rank] = outgoing[0]
            return [bytes(outgoing[r]) if r == self.rank else b"" for r in range(self.size)]
        return [bytes(outgoing[0])] + [self.mailbox.pop(r, b"") for r in range(1, self.size)]


def _route_rate(deltas: list[SparseDelta], pair, ranks: int = 4) -> float:
    """Changes per second routed (:class:`~nemo_dcr.refit.route_views.Router`): ``ranks`` senders
    each capturing a contiguous quarter of every tensor code their changes against their view with
    its kept index, the owner decodes and merges them."""
    canonical = {d.name: (d.dtype, d.shape) for d in deltas}
    mailbox: dict = {}
    routers = [Router(_Relay(r, ranks + 1, mailbox), {n: 0 for n in canonical}, canonical) for r in range(ranks + 1)]

    def share(d: SparseDelta, r: int, attach: bool) -> SparseDelta:
        lo, hi = d.numel * (r - 1) // ranks, d.numel * r // ranks
        if attach:
            return SparseDelta(d.name, d.dtype, d.shape, np.arange(lo, hi), bits_view(pair[d.name][0])[lo:hi].copy())
        sel = (d.positions >= lo) & (d.positions < hi)
        return SparseDelta(d.name, d.dtype, d.shape, d.positions[sel], d.new_bits[sel], d.old_bits[sel])

    def route(attach: bool = False):
        for r in range(1, ranks + 1):
            routers[r].route([share(d, r, attach) for d in deltas], attach)
        routers[0].route([], attach)
        for router in routers:
            router.end(attach)  # the timed refits never commit: every repeat routes the same changes

    route(attach=True)
    return sum(d.nnz for d in deltas) / best_of(route)


def _apply_rate(deltas: list[SparseDelta], pair) -> float:
    """Changes per second written with the undo log, read back and checksummed (the transaction)."""
    views = {n: b.clone().view(torch.int16) for n, (b, _) in pair.items()}

    def run():
        log = UndoLog()
        for d in deltas:
            pos = torch.from_numpy(d.positions)
            log.scatter(views[d.name], pos, carrier(d.new_bits))
            back = read_bits(views[d.name], pos).numpy().view(np.uint16)
            updated_checksum(0, d.positions, d.old_bits, back)
        log.rollback()

    return sum(d.nnz for d in deltas) / best_of(run)


def _scan_and_copy(n: int) -> tuple[float, float]:
    w, t = adam_like(n, seed=1)
    scan = n * 2 / best_of(lambda: scan_changes(t, w)) / 1e9
    copy = n * 2 / best_of(lambda: w.clone()) / 1e9
    return scan, copy


def calibrate(run: str | None = None, elements: int = 1 << 24) -> dict:
    """Measure every CPU kernel figure (one thread) and return the figures document."""
    torch.set_num_threads(1)
    pair = load_pair(run, elements)
    deltas = _deltas(pair)
    scan, copy = _scan_and_copy(elements)
    dcr, ref = _codec(pair, "dcr"), _codec(pair, "reference")
    kernels = Kernels(scan_gbps=scan, remap_per_s=_remap_rate(), route_per_s=_route_rate(deltas, pair),
                      encode_pass_gbps=dcr["encode_pass_gbps"], encode_per_s=dcr["encode_per_s"],
                      decode_pass_gbps=dcr["decode_pass_gbps"], decode_per_s=dcr["decode_per_s"],
                      apply_per_s=_apply_rate(deltas, pair),
                      ref_encode_per_s=ref["changes"] / ref["encode_s"],
                      ref_decode_per_s=ref["changes"] / ref["decode_s"], memcpy_gbps=copy,
                      source=f"measured by `nemo-dcr plan --calibrate{' --calibrate-run RUN' if run else ''}` "
                             f"on {platform.machine()} {platform.processor() or ''}".strip())
    return {"kernels": kernels.to_dict(), "measured": datetime.date.today().isoformat(),
            "data": "make-deltas step_1 -> step_2" if run else f"Adam-like step on {elements} random bf16 weights",
            "codec_runs": {"dcr": dcr, "reference": ref}, "threads": 1}


def write(doc: dict, path: str | Path = CPU_FIGURES) -> Path:
    """Write the figures document (plans read ``figures/cpu.json`` by default)."""
    p = Path(path)
    text = json.dumps(doc, indent=1, sort_keys=True) + "\n"
    p.parent.mkdir(parents=True, exist_ok=True)
    atomic_write({p: lambda f: f.write(text.encode())})
    return p
