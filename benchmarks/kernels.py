"""CPU kernel figures as ratios against references measured in the same run.

Usage: python benchmarks/kernels.py [RUN_DIR]   (RUN_DIR with step_0.. from ``nemo-dcr make-deltas``;
without it a synthetic Adam-like bf16 step of the same shapes as a 135M model's largest tensor).

- scan: MB/s of model compared (both tensors read) vs ``torch.equal`` and a memcpy of the same bytes;
- dcr encode/decode: M changed elements/s, the compiled coder (no kept index) vs the oracles of
  tests/oracles (vectorized numpy, group-by-group, torch); the numpy oracle's one pass over the
  base tensor is reported separately (GB/s of model).  ``benchmarks/codec_speed.py`` has the kept
  index, the per-refit figures and compile times.
- checksum: MB/s vs memcpy.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nemo_dcr.codec.dcr import decode_dcr, encode_dcr  # noqa: E402
from nemo_dcr.kernels import scan_changes  # noqa: E402
from nemo_dcr.types import bits_view, spec_of  # noqa: E402
from nemo_dcr.verify.checksum import tensor_checksum  # noqa: E402
from tests.oracles import (  # noqa: E402
    decode_dcr_np,
    decode_dcr_per_group,
    decode_dcr_torch,
    encode_dcr_np,
    encode_dcr_per_group,
    encode_dcr_torch,
)
from tests.oracles.index import encoder_sorted_pos_np  # noqa: E402


def best(fn, reps: int = 3) -> float:
    t = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        t = min(t, time.perf_counter() - t0)
    return t


def pairs(run: str | None):
    if run:
        from nemo_dcr.checkpoint import load_checkpoint

        steps = sorted(Path(run).glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
        a, b = load_checkpoint(steps[-2]), load_checkpoint(steps[-1])
        return [(a[n].reshape(-1), b[n].reshape(-1)) for n in a]
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(49152 * 576, generator=g) * 0.02).to(torch.bfloat16)
    return [(w, (w.float() + torch.randn(w.numel(), generator=g) * 3e-6).to(torch.bfloat16))]


def main() -> int:
    torch.set_num_threads(1)
    ts = pairs(sys.argv[1] if len(sys.argv) > 1 else None)
    nbytes = sum(a.numel() * a.element_size() for a, _ in ts)
    scans = [scan_changes(b, a) for a, b in ts]
    nnz = sum(p.numel() for p, _ in scans)
    copies = [a.clone() for a, _ in ts]  # torch.equal of equal tensors reads every byte
    r = {"memcpy": best(lambda: [a.clone() for a, _ in ts]), "torch.equal": best(lambda: [torch.equal(a, c) for (a, _), c in zip(ts, copies)]),
         "scan": best(lambda: [scan_changes(b, a) for a, b in ts]),
         "checksum": best(lambda: [tensor_checksum(bits_view(a)) for a, _ in ts])}
    print(f"model {nbytes / 1e6:.0f} MB, {nnz:,} changed ({100 * nnz / (nbytes / 2):.2f}% of bf16 elements), 1 thread")
    for k in ("memcpy", "torch.equal", "scan", "checksum"):
        print(f"  {k:<12} {nbytes / r[k] / 1e6:8.0f} MB/s of model   x{r['memcpy'] / r[k]:.2f} of memcpy time")
    args = [(bits_view(a), p.numpy(), bits_view(b)[p.numpy()], spec_of(a.dtype), a, p, n)
            for (a, b), (p, n) in zip(ts, scans) if p.numel()]
    bodies = [encode_dcr_np(*x[:4]) for x in args]
    t = {"index pass (numpy)": best(lambda: [encoder_sorted_pos_np(x[0], x[1], x[3]) for x in args]),
         "encode compiled": best(lambda: [encode_dcr(*x[:4]) for x in args]),
         "encode numpy": best(lambda: [encode_dcr_np(*x[:4]) for x in args]),
         "encode per-group": best(lambda: [encode_dcr_per_group(*x[:4]) for x in args], 1),
         "encode torch": best(lambda: [encode_dcr_torch(x[4], x[5], x[6]) for x in args], 1),
         "decode compiled": best(lambda: [decode_dcr(bd, x[0], x[3], "t") for bd, x in zip(bodies, args)]),
         "decode numpy": best(lambda: [decode_dcr_np(bd, x[0], x[3], "t") for bd, x in zip(bodies, args)]),
         "decode per-group": best(lambda: [decode_dcr_per_group(bd, x[0], x[3], "t") for bd, x in zip(bodies, args)], 1),
         "decode torch": best(lambda: [decode_dcr_torch(bd, x[4]) for bd, x in zip(bodies, args)], 1)}
    same = all(encode_dcr_torch(x[4], x[5], x[6]) == bd == encode_dcr(*x[:4]) for bd, x in zip(bodies, args))
    idx = t["index pass (numpy)"]
    for k, v in t.items():
        extra = "" if k.startswith("index") else f"   index pass {100 * min(idx / v, 1):3.0f}% of it"
        print(f"  {k:<20} {v:7.3f} s  {nnz / v / 1e6:6.2f} M changed/s  {nbytes / v / 1e9:5.2f} GB/s of model{extra}")
    print(f"  torch bytes == compiled bytes == numpy bytes: {same}; encode numpy vs per-group x{t['encode per-group'] / t['encode numpy']:.2f}, "
          f"decode x{t['decode per-group'] / t['decode numpy']:.2f}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
