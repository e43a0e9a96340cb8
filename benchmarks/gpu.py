"""GPU kernel figures in one run (docs/performance.md): capture scan, apply, dcr encode/decode (torch oracle).

Usage: python benchmarks/gpu.py [--device cuda] [--elements N] [--json OUT]

References are measured in the same run on the same device: a clone of a large tensor (memcpy
bandwidth) for the scan, a dense copy of the tensor for the apply of a 1% delta.  Bit-exactness:
the bytes encoded on the device (the torch oracle of the ``dcr`` coder, tests/oracles) equal the
compiled coder's bytes on the host, and the tensor after decode + apply on the device equals an
independent dense target (integer views).  Needs only
torch, numpy and zstandard; prints a JSON summary at the end.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nemo_dcr.codec.dcr import encode_dcr  # noqa: E402
from nemo_dcr.kernels import scan_changes, write_bits  # noqa: E402
from nemo_dcr.types import DTYPES, bits_view  # noqa: E402
from tests.oracles import decode_dcr_torch, encode_dcr_torch  # noqa: E402


def timed(fn, device, reps: int = 5) -> float:
    """Best-of-``reps`` wall seconds of ``fn()`` (device synchronized)."""
    fn()
    best = float("inf")
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def adam_like(n: int, device, density_scale: float = 1e-5, seed: int = 0):
    """A bf16 weight tensor and the tensor after an Adam-like step (most changes 1-2 ULPs)."""
    g = torch.Generator(device=device).manual_seed(seed)
    w = (torch.randn(n, generator=g, device=device) * 0.02).to(torch.bfloat16)
    step = torch.randn(n, generator=g, device=device) * density_scale
    return w, (w.float() + step).to(torch.bfloat16)


def bench_scan(n: int, device) -> dict:
    w, t = adam_like(n, device)
    nbytes = w.numel() * w.element_size()
    t_copy = timed(lambda: w.clone(), device)  # reads + writes nbytes each
    t_scan = timed(lambda: scan_changes(t, w), device)  # reads two tensors of nbytes
    copy_bw, scan_bw = 2 * nbytes / t_copy, 2 * nbytes / t_scan
    pos, _ = scan_changes(t, w)
    return {"elements": n, "density": pos.numel() / n, "memcpy_GBps": copy_bw / 1e9, "scan_GBps": scan_bw / 1e9,
            "scan_pct_of_memcpy": 100 * scan_bw / copy_bw, "scan_model_GBps": nbytes / t_scan / 1e9}


def bench_apply(n: int, device) -> dict:
    g = torch.Generator(device=device).manual_seed(1)
    w = torch.randn(n, generator=g, device=device).to(torch.bfloat16)
    dense = torch.randn(n, generator=g, device=device).to(torch.bfloat16)
    pos = torch.randperm(n, generator=g, device=device)[: n // 100].sort().values
    new = dense.view(torch.int16)[pos]
    t_apply = timed(lambda: write_bits(w, pos, new), device)
    t_dense = timed(lambda: w.copy_(dense), device)
    return {"elements": n, "changed": pos.numel(), "apply_ms": 1e3 * t_apply, "dense_copy_ms": 1e3 * t_dense,
            "apply_speedup_vs_dense": t_dense / t_apply}


def bench_codec(n: int, device) -> dict:
    w, t = adam_like(n, device, seed=2)
    pos, new = scan_changes(t, w)
    t_enc = timed(lambda: encode_dcr_torch(w, pos, new), device, reps=3)
    body = encode_dcr_torch(w, pos, new)
    t_dec = timed(lambda: decode_dcr_torch(body, w), device, reps=3)
    w_h, t_h = w.cpu(), t.cpu()
    pos_h = pos.cpu().numpy()
    t0 = time.perf_counter()
    ref = encode_dcr(bits_view(w_h), pos_h, bits_view(t_h)[pos_h], DTYPES["bf16"])
    t_cpu = time.perf_counter() - t0
    out = w.clone()
    write_bits(out, *decode_dcr_torch(body, w))
    exact = bool(torch.equal(out.view(torch.int16), t.view(torch.int16)))
    return {"elements": n, "changed": pos.numel(), "bytes": len(body), "bytes_per_changed": len(body) / max(pos.numel(), 1),
            "encode_Mchanged_per_s": pos.numel() / t_enc / 1e6, "decode_Mchanged_per_s": pos.numel() / t_dec / 1e6,
            "encode_model_GBps": 2 * n / t_enc / 1e9, "decode_model_GBps": 2 * n / t_dec / 1e9,
            "cpu_compiled_encode_Mchanged_per_s": pos.numel() / t_cpu / 1e6,
            "bytes_equal_cpu_compiled": body == ref, "apply_equals_dense_target": exact}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--elements", type=int, default=1 << 28, help="scan/apply tensor size (bf16 elements)")
    ap.add_argument("--codec-elements", type=int, default=1 << 25)
    ap.add_argument("--json")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to measure (use --device cpu for a dry run)")
        return 2
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    summary = {"device": name, "torch": torch.__version__}
    for key, fn, n in (("scan", bench_scan, args.elements), ("apply_1pct", bench_apply, args.elements),
                       ("dcr_codec", bench_codec, args.codec_elements)):
        t0 = time.perf_counter()
        summary[key] = fn(n, device)
        print(f"{key}: {json.dumps(summary[key])}  ({time.perf_counter() - t0:.1f}s)", flush=True)
    s, a, c = summary["scan"], summary["apply_1pct"], summary["dcr_codec"]
    summary["targets"] = {"scan_ge_50pct_memcpy": s["scan_pct_of_memcpy"] >= 50,
                          "apply_1pct_ge_10x_dense": a["apply_speedup_vs_dense"] >= 10,
                          "bit_exact": c["bytes_equal_cpu_compiled"] and c["apply_equals_dense_target"]}
    print("SUMMARY " + json.dumps(summary))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0 if summary["targets"]["bit_exact"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
