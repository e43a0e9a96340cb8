"""Compile every host kernel once, into numba's on-disk cache (``python -m nemo_dcr.codec.warm``).

Compiled kernels are built on first use per argument types and cached next to the source, so only
the first process after an install pays the compile time (tens of seconds on two cores).  Many
processes starting together (torchrun ranks, an engine process) would each compile the same
kernels at once; ``scripts/setup_env.sh`` runs this module after installing, so every later process
loads machine code from the cache instead.  It runs the real entry points on tiny inputs of every
wire dtype: a ``dcr`` round trip with and without a kept class index, the folded steps of the
delta statistics, the scan, the in-place writes and reads, and the checksums.
"""

from __future__ import annotations

import sys
import time

import numpy as np
import torch

from ..kernels import read_bits, scan_changes, write_bits
from ..types import DTYPES, tensor_from_bits
from ..verify.checksum import hash_sum, tensor_checksum, updated_checksum
from .dcr import decode_dcr, encode_dcr
from .dcr.class_index import DcrIndex
from .dcr.jit_bits import fold_steps


def _one_dtype(spec, rng: np.random.Generator) -> None:
    base = rng.integers(0, 1 << spec.bits, 4096, dtype=np.uint64).astype(spec.uint)
    pos = np.unique(rng.integers(0, base.size, 64)).astype(np.int64)
    new = base.copy()
    new[pos] ^= spec.uint.type(1)
    body = encode_dcr(base, pos, new[pos], spec)
    decode_dcr(body, base, spec, "warm")
    index = DcrIndex.build(base, spec)
    body = encode_dcr(base, pos, new[pos], spec, index, base[pos])
    decode_dcr(body, base, spec, "warm", index, with_old=True)
    index.update(pos, base[pos], new[pos])
    fold_steps(base[pos], new[pos], spec.bits)
    t = tensor_from_bits(base, spec, base.shape)
    scan_changes(tensor_from_bits(new, spec, new.shape), t)
    write_bits(t, pos, new[pos])
    read_bits(t, pos)
    tensor_checksum(base)
    hash_sum(pos, base[pos])
    updated_checksum(0, pos, base[pos], new[pos])


def warm() -> float:
    """Run every kernel once per wire dtype; returns the seconds it took."""
    t0 = time.perf_counter()
    rng = np.random.default_rng(0)
    for spec in DTYPES.values():
        _one_dtype(spec, rng)
    torch.set_num_threads(1)
    return time.perf_counter() - t0


if __name__ == "__main__":
    seconds = warm()
    print(f"[warm] compiled kernels ready in {seconds:.1f}s", file=sys.stderr)
