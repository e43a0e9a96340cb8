"""How much could more context save?  Entropy of real RL deltas under candidate contexts.

Usage:
    python benchmarks/contexts.py RUN_DIR [--step K]

RUN_DIR holds ``step_0 .. step_K`` (``nemo-dcr make-deltas`` writes them).  For the delta
``step_{K-1} -> step_K`` (K >= 2, so the step before is known too) it prints, in bytes per changed
element, the empirical entropy of:

- positions: which elements changed, conditioned on the old exponent (what ``dcr`` uses), then on
  the exponent plus the row's change rate, the column's, both, or whether the element changed in
  the previous step (the last two need state the receiver does not keep today);
- signs: alone, and conditioned on the sign of the element's previous step;
- magnitudes (|ULP step|): alone and conditioned on the exponent;
- the bytes the ``dcr`` coder spends, for comparison.

Row and column rates are quantized to 10 levels and treated as free side information; the cost
of sending them (about 3 bits per row and column) is printed separately.  These are estimates
from the tensors' own empirical distributions, so they are lower bounds for a static coder.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nemo_dcr.checkpoint import load_checkpoint  # noqa: E402
from nemo_dcr.codec.dcr import encode_dcr  # noqa: E402
from nemo_dcr.types import bits_view, spec_of  # noqa: E402
from tests.oracles.keys import signed_steps  # noqa: E402

RATE_EDGES = [0, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1]


def h2(p: np.ndarray) -> np.ndarray:
    p = np.clip(p, 1e-12, 1 - 1e-12)
    return -(p * np.log2(p) + (1 - p) * np.log2(1 - p))


def set_bits(ctx: np.ndarray, changed: np.ndarray) -> float:
    """Sum over contexts of n * H2(changed fraction), in bits."""
    _, inv = np.unique(ctx, return_inverse=True)
    n = np.bincount(inv)
    k = np.bincount(inv, weights=changed)
    return float((n * h2(k / n) * ((k > 0) & (k < n))).sum())


def sym_bits(sym: np.ndarray, ctx: np.ndarray | None = None) -> float:
    """n * H(sym | ctx) from empirical distributions, in bits."""
    if sym.size == 0:
        return 0.0
    ctx = np.zeros_like(sym) if ctx is None else ctx
    _, inv = np.unique(np.stack([ctx, sym]), axis=1, return_inverse=True)
    joint = np.bincount(inv.ravel())
    _, cinv = np.unique(ctx, return_inverse=True)
    marg = np.bincount(cinv.ravel())
    return float(-(joint * np.log2(joint)).sum() + (marg * np.log2(marg)).sum())


def analyse(prev: dict, a: dict, b: dict) -> dict:
    tot = dict.fromkeys(["pos|exp", "pos|exp,row", "pos|exp,col", "pos|exp,row,col", "pos|exp,prev",
                         "row/col side info", "sign", "sign|prev sign", "mag", "mag|exp", "dcr bytes"], 0.0)
    m_all = 0
    for name in a:
        spec = spec_of(a[name].dtype)
        ones = (1 << spec.bits) - 1
        pb, ab, bb = (bits_view(t[name]).astype(np.int64) & ones for t in (prev, a, b))
        ch = (ab != bb).astype(np.float64)
        pos = np.flatnonzero(ch)
        if not pos.size:
            continue
        m_all += pos.size
        e = (ab >> spec.exp_shift) & ((1 << spec.exp_bits) - 1)
        tot["pos|exp"] += set_bits(e, ch)
        tot["pos|exp,prev"] += set_bits(e * 2 + (pb != ab), ch)
        if a[name].dim() == 2:
            rows, cols = a[name].shape
            r, c = np.divmod(np.arange(ab.size), cols)
            rq = np.digitize(np.bincount(r, weights=ch, minlength=rows) / cols, RATE_EDGES)[r]
            cq = np.digitize(np.bincount(c, weights=ch, minlength=cols) / rows, RATE_EDGES)[c]
            tot["pos|exp,row"] += set_bits(e * 16 + rq, ch)
            tot["pos|exp,col"] += set_bits(e * 16 + cq, ch)
            tot["pos|exp,row,col"] += set_bits((e * 16 + rq) * 16 + cq, ch)
            tot["row/col side info"] += 3 * (rows + cols)
        else:
            for k in ("pos|exp,row", "pos|exp,col", "pos|exp,row,col"):
                tot[k] += set_bits(e, ch)
        d = signed_steps(ab[pos], bb[pos], spec)
        sign = (d > 0).astype(np.int64)
        dprev = np.sign(signed_steps(pb[pos], ab[pos], spec)).astype(np.int64)
        tot["sign"] += sym_bits(sign)
        tot["sign|prev sign"] += sym_bits(sign, dprev)
        mag = np.abs(d)
        tot["mag"] += sym_bits(mag)
        tot["mag|exp"] += sym_bits(mag, e[pos])
        tot["dcr bytes"] += 8 * len(encode_dcr(bits_view(a[name]), pos, bits_view(b[name])[pos], spec))
    return {"changed": m_all, **{k: v / 8 / max(m_all, 1) for k, v in tot.items()}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run")
    ap.add_argument("--step", type=int, default=3, help="analyse step_{K-1} -> step_K (K >= 2)")
    args = ap.parse_args()
    if args.step < 2:
        ap.error("--step must be >= 2 (the step before is a context)")
    run = Path(args.run)
    paths = [run / f"step_{k}" for k in (args.step - 2, args.step - 1, args.step)]
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        ap.error(f"missing checkpoints: {', '.join(missing)} (make them with nemo-dcr make-deltas)")
    print(f"loading {', '.join(p.name for p in paths)} ...", flush=True)
    out = analyse(*(load_checkpoint(p) for p in paths))
    print(f"step {args.step - 1} -> {args.step}: {out.pop('changed'):,} changed; bytes per changed element:")
    for k, v in out.items():
        print(f"  {k:<20} {v:6.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
