"""The GPU path in one run (docs/refit.md, "GPU path"): a refit through the real engine path on one device.

Usage: python benchmarks/gpu.py [--device cuda|cpu] [--hidden H] [--layers L] [--density D] [--json OUT]

Real-shaped bf16 tensors (the matrices of ``L`` transformer layers of hidden size ``H``) live on
the device as the trainer's params and as the engine's live tensors; an RL-like step moves a
fraction ``D`` of the elements by one to three ULPs.  One refit then runs the library's own path:
capture scan on the device against a device baseline (changes to the host), ``dcr`` encode on the
host against the kept class index, decode on the host reading the old bits gathered on the device
at the changed positions, new bits to the device, scatter and read-back there (``TensorEngine``),
and the baseline's commit.  Every host <-> device copy is counted (``nemo_dcr.kernels.traffic``).
With ``--device cpu`` the same device code runs on host tensors (``device_path``): its counts are
what would cross PCIe.

References measured in the same run on the same device: a clone of the largest tensor (device
copy bandwidth) for the scan, and a dense refit of the same tensors (each tensor to the host and
back into the engine's, and a device-to-device copy) for the bytes and the apply time.
Bit-exactness: the engine's tensors and the trainer's baseline equal the dense target (integer
views).  Prints one JSON object (``SUMMARY {...}``); exit 1 unless bit-exact.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nemo_dcr.apply import TensorEngine, apply_version  # noqa: E402
from nemo_dcr.capture import BaselineStore, capture  # noqa: E402
from nemo_dcr.codec import DcrIndexes, Identity, decode, encode_deltas  # noqa: E402
from nemo_dcr.kernels.traffic import device_path, host_bits, measure  # noqa: E402
from nemo_dcr.types import spec_of  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device):
    """``(seconds, result)`` of one call of ``fn`` (device synchronized)."""
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - t0, out


def best_of(fn, device: torch.device, reps: int = 3) -> float:
    fn()
    return min(timed(fn, device)[0] for _ in range(reps))


def layer_shapes(hidden: int, layers: int) -> dict[str, tuple[int, int]]:
    """The matrices of ``layers`` Llama-like layers (fused qkv and gate/up, MLP of 11/4 hidden)."""
    ffn = 64 * -(-hidden * 11 // 4 // 64)
    one = {"qkv": (3 * hidden, hidden), "o": (hidden, hidden), "gate_up": (2 * ffn, hidden), "down": (hidden, ffn)}
    return {f"layers.{i}.{k}.weight": s for i in range(layers) for k, s in one.items()}


def make_weights(shapes, device: torch.device, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    return {n: (torch.randn(s, generator=g, device=device) * 0.02).to(torch.bfloat16) for n, s in shapes.items()}


def rl_step(params: dict[str, torch.Tensor], density: float, seed: int = 1) -> None:
    """Move a ``density`` fraction of each tensor's elements by 1 to 3 ULPs (in place)."""
    g = torch.Generator(device=next(iter(params.values())).device).manual_seed(seed)
    for p in params.values():
        bits = p.view(torch.int16).reshape(-1)
        moved = torch.rand(bits.numel(), generator=g, device=bits.device) < density
        step = torch.randint(1, 4, (bits.numel(),), generator=g, device=bits.device, dtype=torch.int16)
        sign = torch.where(torch.rand(bits.numel(), generator=g, device=bits.device) < 0.5, -1, 1).to(torch.int16)
        bits.add_(torch.where(moved, step * sign, torch.zeros_like(step)))


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[n].view(torch.int16), b[n].reshape(a[n].shape).view(torch.int16)) for n in a)


def dense_refit(target: dict[str, torch.Tensor], live: dict[str, torch.Tensor], device: torch.device) -> dict:
    """A dense refit of the same tensors: each to the host and back into the engine's (PCIe bytes
    per element on each side: the element width), and a device-to-device copy (colocated)."""
    def round_trip():
        for n, t in target.items():
            live[n].copy_(t.to("cpu", copy=True))
    t_pcie = best_of(round_trip, device, reps=1)
    t_copy = best_of(lambda: [live[n].copy_(t) for n, t in target.items()], device)
    return {"pcie_round_trip_ms": 1e3 * t_pcie, "device_copy_ms": 1e3 * t_copy,
            "bytes_each_side": sum(t.numel() * t.element_size() for t in target.values())}


def attach(params) -> tuple:
    """Trainer baseline on the device, the engine's copy, the trainer's mirror of the engine's bits
    and both kept class indexes (built here, at attach: not a refit's cost)."""
    store = BaselineStore("device")
    for n, p in params.items():
        store.register(n, p)
    engine = TensorEngine({n: p.clone() for n, p in params.items()})
    engine.build_indexes()
    mirror = {n: host_bits(p).copy() for n, p in params.items()}
    trainer_ix = DcrIndexes()
    for n, b in mirror.items():
        trainer_ix.get(n, b, spec_of(params[n].dtype), engine.sums.views[n])
    return store, engine, mirror, trainer_ix


def refit(params, state, version: int, device: torch.device, density: float) -> dict:
    """One RL step and one refit through the library path; the figures of each part."""
    store, engine, mirror, trainer_ix = state
    rl_step(params, density, seed=version)
    with measure() as trainer:
        t_scan, deltas = timed(lambda: capture(params, store, version=version), device)
        changed = sum(d.nnz for d in deltas)
        ident = Identity(base_version=version - 1, target_version=version)
        t_enc, payload = timed(lambda: encode_deltas(deltas, mirror, ident, "dcr", None, engine.sums.views,
                                                     trainer_ix), device)
    with measure() as decoding:
        t_dec, _ = timed(lambda: decode(payload, engine.tensors, None, engine.sums.views, engine.indexes), device)
    t_apply, result = timed(lambda: apply_version(engine, {0: [payload]}), device)
    with measure() as commit:
        t_commit, _ = timed(lambda: store.commit(version), device)
    for d in deltas:  # the trainer's mirror and index follow the acknowledged version
        mirror[d.name][d.positions] = d.new_bits
    trainer_ix.update(deltas)
    trainer.to_host += commit.to_host
    trainer.to_device += commit.to_device
    target = {n: p.detach().clone() for n, p in params.items()}
    return dict(changed=changed, payload_bytes=len(payload), scan_s=t_scan, encode_s=t_enc, decode_s=t_dec,
                apply_s=t_apply, commit_s=t_commit, decode_to_host=decoding.to_host, target=target,
                bit_exact=_equal(engine.tensors, target) and _equal({n: store.bits(n) for n in target}, target),
                trainer=trainer.per_element(changed), engine=result.host_device.per_element(changed),
                engine_bytes=result.host_device.total, trainer_bytes=trainer.total)


def summarize(r: dict, params, device: torch.device, name: str) -> dict:
    numel = sum(p.numel() for p in params.values())
    nbytes = 2 * numel
    big = max(params.values(), key=lambda p: p.numel())
    t_clone = best_of(lambda: big.clone(), device)
    copy_bw = 2 * big.numel() * 2 / t_clone
    scan_bw = 2 * nbytes / r["scan_s"]  # reads the params and the baseline
    d, c = r["dense"], max(r["changed"], 1)
    apply_ms = 1e3 * r["apply_s"]
    worst = max(r["trainer"]["to_host"], r["trainer"]["to_device"], r["engine"]["to_host"], r["engine"]["to_device"])
    return {
        "device": name, "torch": torch.__version__, "elements": numel, "gb": nbytes / 1e9,
        "changed": r["changed"], "density": r["changed"] / numel, "payload_bytes": r["payload_bytes"],
        "bit_exact": r["bit_exact"],
        "host_bytes_per_changed": {"trainer": r["trainer"], "engine": r["engine"]},
        "host_bytes_vs_dense": {"trainer": d["bytes_each_side"] / max(r["trainer_bytes"], 1),
                                "engine": d["bytes_each_side"] / max(r["engine_bytes"], 1)},
        "scan_GBps": scan_bw / 1e9, "device_copy_GBps": copy_bw / 1e9, "scan_pct_of_copy": 100 * scan_bw / copy_bw,
        "apply_ms": apply_ms, "dense_device_copy_ms": d["device_copy_ms"], "dense_pcie_ms": d["pcie_round_trip_ms"],
        "apply_speedup_vs_dense_copy": d["device_copy_ms"] / apply_ms,
        "apply_speedup_vs_dense_pcie": d["pcie_round_trip_ms"] / apply_ms,
        "refit_ms": {"scan": 1e3 * r["scan_s"], "encode": 1e3 * r["encode_s"], "apply": apply_ms,
                     "commit": 1e3 * r["commit_s"]},
        "encode_Mchanged_per_s": c / r["encode_s"] / 1e6, "decode_Mchanged_per_s": c / r["decode_s"] / 1e6,
        "decode_to_host_bytes_per_changed": r["decode_to_host"] / c,
        "nccl_dense_resync": "not run: there is no NCCL transport (docs/refit.md, \"GPU path\")",
        "targets": {"bit_exact": r["bit_exact"], "host_bytes_le_64_per_changed": worst <= 64,
                    "scan_ge_50pct_copy": 100 * scan_bw / copy_bw >= 50,
                    "apply_ge_10x_dense_copy": d["device_copy_ms"] / apply_ms >= 10},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--hidden", type=int, help="hidden size (default: 4096 on cuda, 1024 on cpu)")
    ap.add_argument("--layers", type=int, help="layers (default: 5 on cuda, about 2 GB; 2 on cpu)")
    ap.add_argument("--density", type=float, default=0.01, help="fraction of elements an RL step moves")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to measure (use --device cpu to run the same path on the host)")
        return 2
    hidden = args.hidden or (4096 if device.type == "cuda" else 1024)
    layers = args.layers or (5 if device.type == "cuda" else 2)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (device code path)"
    params = make_weights(layer_shapes(hidden, layers), device)
    with device_path() if device.type == "cpu" else contextlib.nullcontext():
        t0 = time.perf_counter()
        state = attach(params)
        warm = refit(params, state, 1, device, args.density)  # compiles and warms every kernel
        r = refit(params, state, 2, device, args.density)
        r["bit_exact"] = r["bit_exact"] and warm["bit_exact"]
        r["dense"] = dense_refit(r.pop("target"), state[1].tensors, device)
        summary = summarize(r, params, device, name)
    summary["wall_s"] = time.perf_counter() - t0
    print("SUMMARY " + json.dumps(summary))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0 if summary["targets"]["bit_exact"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
