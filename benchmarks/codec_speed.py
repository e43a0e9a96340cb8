"""Host speed of the refit data path on real steps, as ratios against references from the same run.

Usage:
    python benchmarks/codec_speed.py RUN [--pair A B] [--sparse RUN2 --sparse-pair A B] [--reps N] [--json OUT]

RUN holds ``step_0 .. step_K`` from ``nemo-dcr make-deltas``.  One core (``torch`` and numba on
one thread); every time is CPU time of this process (``time.process_time``), the best of N, so
other jobs on a shared machine slow the figures less than wall time would.

* memcpy (copy into a preallocated buffer) is the reference for the scan, checksum and apply;
* scan: model GB/s (both tensors read) of the compiled scan vs memcpy and numpy's ``!=`` scan;
* class scans: what ranking costs without a kept index, per pass over the model (the mean of
  the encoder's rank pass and the decoder's class histogram);
* checksum: GB/s of the compiled checksum vs the numpy one;
* apply: ``write_bits`` of the delta into a copy vs a dense copy of the model;
* ``dcr`` encode/decode: M changed elements/s, compiled with kept indexes, compiled with one
  pass over the base, and the oracles of tests/oracles: vectorized numpy, group-by-group (one
  repetition); bytes per changed element (all identical, checked); index build time and memory;
* per refit: encode (kept indexes, base checksums known) + engine apply (decode, undo log,
  write, read-back check, index update) + sender commit (bits, checksums, index update), at the
  pair's density and on a random tenth of it, and the ratio of the two.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nemo_dcr.apply import TensorEngine, apply_version  # noqa: E402
from nemo_dcr.checkpoint import load_checkpoint  # noqa: E402
from nemo_dcr.codec import DcrIndexes, Identity, encode_deltas  # noqa: E402
from nemo_dcr.codec.dcr import DcrIndex, decode_dcr, encode_dcr  # noqa: E402
from nemo_dcr.codec.dcr.jit_decode import onepass_hist  # noqa: E402
from nemo_dcr.codec.dcr.jit_encode import onepass_ranks  # noqa: E402
from nemo_dcr.kernels import write_bits  # noqa: E402
from nemo_dcr.kernels.scan import changed_bits_np  # noqa: E402
from nemo_dcr.types import DTYPES, SparseDelta, bits_view, spec_of  # noqa: E402
from nemo_dcr.verify.checksum import checksums_after, tensor_checksum, tensor_checksum_np  # noqa: E402
from tests.oracles import decode_dcr_np, decode_dcr_per_group, encode_dcr_np, encode_dcr_per_group  # noqa: E402


def best(fn, reps: int) -> float:
    t = float("inf")
    for _ in range(reps):
        t0 = time.process_time()
        fn()
        t = min(t, time.process_time() - t0)
    return t


def load_pair(run: str, a: int, b: int):
    """``{name: (base tensor, target tensor)}`` of two steps (flat, contiguous)."""
    ta, tb = load_checkpoint(Path(run) / f"step_{a}"), load_checkpoint(Path(run) / f"step_{b}")
    return {n: (ta[n].reshape(-1).contiguous(), tb[n].reshape(-1).contiguous()) for n in ta}


def deltas_of(pair) -> list[SparseDelta]:
    out = []
    for n, (a, b) in pair.items():
        old, new = bits_view(a), bits_view(b)
        pos, nb = changed_bits_np(new, old)
        out.append(SparseDelta(n, spec_of(a.dtype).name, tuple(a.shape), pos, nb, old[pos]))
    return out


def subsample(deltas, frac: float, seed: int = 0) -> list[SparseDelta]:
    rng = np.random.default_rng(seed)
    out = []
    for d in deltas:
        keep = np.sort(rng.choice(d.nnz, int(round(d.nnz * frac)), replace=False)) if d.nnz else np.zeros(0, int)
        out.append(SparseDelta(d.name, d.dtype, d.shape, d.positions[keep], d.new_bits[keep], d.old_bits[keep]))
    return out


def _rank_scans(olds, deltas):
    """The one-pass class scans the coder makes without a kept index (encoder ranks; decoder
    histogram), over every tensor."""
    for x, d in zip(olds, deltas):
        spec = DTYPES[d.dtype]
        onepass_ranks(x, d.positions, spec.exp_shift, spec.n_exponents - 1, np.empty(d.nnz, np.int64))
        onepass_hist(x, spec.exp_shift, spec.n_exponents - 1)


def kernels(pair, deltas, reps: int) -> dict:
    """memcpy, scan, checksum and apply figures (GB/s of model and ratios)."""
    olds = [bits_view(a) for a, _ in pair.values()]
    news = [bits_view(b) for _, b in pair.values()]
    nbytes = sum(x.nbytes for x in olds)
    dst = [np.empty_like(x) for x in olds]
    dst_t = [a.clone() for a, _ in pair.values()]
    r = {"memcpy": best(lambda: [np.copyto(d, x) for d, x in zip(dst, olds)], reps),
         "scan": best(lambda: [changed_bits_np(b, a) for a, b in zip(olds, news)], reps),
         "scan numpy !=": best(lambda: [np.flatnonzero(b != a) for a, b in zip(olds, news)], reps),
         "checksum": best(lambda: [tensor_checksum(x) for x in olds], reps),
         "class scans (no index)": best(lambda: _rank_scans(olds, deltas), reps) / 2,
         "checksum numpy": best(lambda: [tensor_checksum_np(x) for x in olds], max(1, reps // 2)),
         "write_bits delta": best(lambda: [write_bits(d, x.positions, x.new_bits)
                                           for d, x in zip(dst_t, deltas)], reps)}
    return {"model_bytes": nbytes, **{k: {"s": v, "GBps": nbytes / v / 1e9} for k, v in r.items()}}


def coders(pair, deltas, reps: int) -> dict:
    """``dcr`` encode/decode M changed/s of each implementation; identical bytes checked."""
    items = [(bits_view(pair[d.name][0]), d, spec_of(pair[d.name][0].dtype)) for d in deltas if d.nnz]
    nnz = sum(d.nnz for _, d, _ in items)
    t0 = time.process_time()
    idx = [DcrIndex.build(b, s) for b, _, s in items]
    build = time.process_time() - t0
    bodies = [encode_dcr_np(b, d.positions, d.new_bits, s) for b, d, s in items]
    same = bodies == [encode_dcr(b, d.positions, d.new_bits, s, ix) for (b, d, s), ix in zip(items, idx)]
    same &= all(np.array_equal(decode_dcr(body, b, s, d.name, ix)[1], d.new_bits)
                for body, (b, d, s), ix in zip(bodies, items, idx))
    enc = {"compiled, kept index": lambda: [encode_dcr(b, d.positions, d.new_bits, s, ix) for (b, d, s), ix in zip(items, idx)],
           "compiled, one pass": lambda: [encode_dcr(b, d.positions, d.new_bits, s) for b, d, s in items],
           "numpy vectorized": lambda: [encode_dcr_np(b, d.positions, d.new_bits, s) for b, d, s in items],
           "per-group": lambda: [encode_dcr_per_group(b, d.positions, d.new_bits, s) for b, d, s in items]}
    dec = {"compiled, kept index": lambda: [decode_dcr(x, b, s, d.name, ix) for x, (b, d, s), ix in zip(bodies, items, idx)],
           "compiled, one pass": lambda: [decode_dcr(x, b, s, d.name) for x, (b, d, s) in zip(bodies, items)],
           "numpy vectorized": lambda: [decode_dcr_np(x, b, s, d.name) for x, (b, d, s) in zip(bodies, items)],
           "per-group": lambda: [decode_dcr_per_group(x, b, s, d.name) for x, (b, d, s) in zip(bodies, items)]}
    out = {"changed": nnz, "bytes_per_changed": sum(map(len, bodies)) / nnz, "identical": bool(same),
           "index_build_s": build, "index_bytes_per_element": sum(i.nbytes for i in idx) / sum(i.n for i in idx)}
    for kind, fns in (("encode", enc), ("decode", dec)):
        for name, fn in fns.items():
            t = best(fn, 1 if name in ("per-group", "numpy vectorized") else reps)
            out[f"{kind} {name}"] = {"s": t, "M_changed_per_s": nnz / t / 1e6}
    return out


class Side:
    """A sender (engine bits, checksums, kept indexes) and an engine holding the same tensors."""

    def __init__(self, pair):
        self.base = {n: a.clone() for n, (a, _) in pair.items()}
        self.bits = {n: bits_view(t) for n, t in self.base.items()}
        self.checksums = {n: tensor_checksum(b) for n, b in self.bits.items()}
        self.indexes = DcrIndexes()
        self.engine = TensorEngine({n: t.clone() for n, t in self.base.items()})

    def refit(self, deltas, version: int) -> dict:
        """One refit (version -> version + 1) with phase CPU times."""
        t0 = time.process_time()
        data = encode_deltas(deltas, self.bits, Identity(base_version=version, target_version=version + 1), "dcr",
                             None, self.checksums, self.indexes)
        t1 = time.process_time()
        apply_version(self.engine, {0: [data]})
        t2 = time.process_time()
        self.checksums = checksums_after(self.checksums, [d for d in deltas if d.nnz])
        for d in deltas:
            if d.nnz:
                write_bits(self.base[d.name], d.positions, d.new_bits)
        self.indexes.update(deltas)
        t3 = time.process_time()
        return {"encode": t1 - t0, "apply": t2 - t1, "commit": t3 - t2, "total": t3 - t0, "bytes": len(data)}


def inverse(deltas):
    return [SparseDelta(d.name, d.dtype, d.shape, d.positions, d.old_bits, d.new_bits) for d in deltas]


def per_refit(pair, deltas, reps: int) -> dict:
    """Per-refit phases at the pair's density and at a tenth of it; forward and back are both timed."""
    side = Side(pair)
    numel = sum(a.numel() for a, _ in pair.values())
    out, version = {}, 0
    for label, ds in (("full", deltas), ("tenth", subsample(deltas, 0.1))):
        runs = []
        for _ in range(reps):
            for d in (ds, inverse(ds)):
                runs.append(side.refit(d, version))
                version += 1
        nnz = sum(d.nnz for d in ds)
        top = min(runs, key=lambda r: r["total"])
        out[label] = {"changed": nnz, "density": nnz / numel, **top, "M_changed_per_s": nnz / top["total"] / 1e6}
    out["ratio_full_over_tenth"] = out["full"]["total"] / out["tenth"]["total"]
    out["builds"] = {"sender": side.indexes.builds, "engine": side.engine.indexes.builds}
    return out


def report(k: dict, c: dict, r: dict) -> None:
    mc = k["memcpy"]["GBps"]
    print(f"model {k['model_bytes'] / 1e6:.0f} MB, {c['changed']:,} changed; CPU time of one core, best of N")
    for name in ("memcpy", "scan", "scan numpy !=", "class scans (no index)", "checksum", "checksum numpy"):
        print(f"  {name:<18} {k[name]['GBps']:7.2f} GB/s of model   {k[name]['GBps'] / mc * 100:5.0f}% of memcpy")
    print(f"  write_bits of the delta {k['write_bits delta']['s'] * 1e3:7.1f} ms   dense copy "
          f"{k['memcpy']['s'] * 1e3:7.1f} ms   x{k['memcpy']['s'] / k['write_bits delta']['s']:.1f} faster")
    print(f"  dcr {c['bytes_per_changed']:.3f} B per changed element, identical bytes: {c['identical']}; "
          f"index build {c['index_build_s']:.2f} s, {c['index_bytes_per_element']:.2f} B per element")
    for kind in ("encode", "decode"):
        ref = c[f"{kind} numpy vectorized"]["s"]
        for name in ("compiled, kept index", "compiled, one pass", "numpy vectorized", "per-group"):
            v = c[f"{kind} {name}"]
            print(f"  {kind} {name:<22} {v['s'] * 1e3:8.1f} ms {v['M_changed_per_s']:7.2f} M changed/s  "
                  f"x{ref / v['s']:.1f} vs numpy")
    for label in ("full", "tenth"):
        x = r[label]
        print(f"  refit at {100 * x['density']:.3f}%: {x['total'] * 1e3:7.1f} ms (encode {x['encode'] * 1e3:.1f}, "
              f"apply {x['apply'] * 1e3:.1f}, commit {x['commit'] * 1e3:.1f}) {x['M_changed_per_s']:.1f} M changed/s")
    print(f"  refit time ratio {r['ratio_full_over_tenth']:.1f}x for 10x the changes; index builds {r['builds']}")


_COMPILE = """
import time, numpy as np
t0 = time.perf_counter()
from nemo_dcr.codec.dcr import DcrIndex, decode_dcr, encode_dcr
from nemo_dcr.kernels import scan_changes, write_bits
from nemo_dcr.verify.checksum import tensor_checksum, updated_checksum
from nemo_dcr.types import DTYPES, tensor_from_bits
t1 = time.perf_counter()
spec = DTYPES["bf16"]
base = np.arange(10000, dtype=np.uint16)
pos = np.arange(0, 10000, 7, dtype=np.int64)
new = base[pos] ^ np.uint16(1 << 9)
ix = DcrIndex.build(base, spec)
body = encode_dcr(base, pos, new, spec, ix)
encode_dcr(base, pos, new, spec)
decode_dcr(body, base, spec, "t", ix)
decode_dcr(body, base, spec, "t")
ix.update(pos, base[pos], new)
t = tensor_from_bits(base, spec, (10000,))
scan_changes(t, t.clone())
write_bits(t, pos, new)
updated_checksum(tensor_checksum(base), pos, base[pos], new)
print(t1 - t0, time.perf_counter() - t1)
"""


def compile_times() -> dict:
    """Import and first-call seconds of every bf16 kernel in fresh processes: with an empty
    numba cache (compiles), then with the cache that run wrote."""
    import os
    import resource
    import subprocess
    import tempfile

    out = {}
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache)
        for label in ("cold", "cached"):
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            res = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True,
                                 cwd=Path(__file__).resolve().parent.parent, check=True)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            imp, first = map(float, res.stdout.split())
            cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
            out[label] = {"import_s": imp, "first_calls_s": first, "process_cpu_s": cpu}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run")
    p.add_argument("--pair", nargs=2, type=int, default=(1, 2))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json")
    args = p.parse_args()
    torch.set_num_threads(1)
    pair = load_pair(args.run, *args.pair)
    deltas = deltas_of(pair)
    jit = compile_times()
    k, c, r = kernels(pair, deltas, args.reps), coders(pair, deltas, args.reps), per_refit(pair, deltas, args.reps)
    report(k, c, r)
    print("  numba first use in a fresh process (bf16 kernels), wall s import / first calls, CPU s of the process: " +
          ", ".join(f"{k} {v['import_s']:.1f} / {v['first_calls_s']:.1f}, {v['process_cpu_s']:.1f}" for k, v in jit.items()))
    if args.json:
        Path(args.json).write_text(json.dumps({"kernels": k, "coders": c, "refit": r, "jit": jit}, indent=1))
    return 0 if c["identical"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
