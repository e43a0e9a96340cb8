"""Compile every host kernel a refit uses, into numba's on-disk cache (``python -m nemo_dcr.refit.warm``).

:mod:`nemo_dcr.codec.warm` compiles the coder's and the kernels' entry points on tiny inputs of
every wire dtype.  A real refit then still compiled more on its first step (the capture scan that
returns old bits, the decode's position sort, the sampled checks' slices, the kept indexes'
updates): ~20 s of the main job's first step on two cores.  This module runs the codec warm-up and
then the whole refit path once in this process, on small bf16 and fp32 tensors: attach, delta
refits under the ``sampled`` and ``full`` checks with ``reference`` sized, and the sampled
checksum of captured runs and the remap through them (the megatron source's), the routing's walks
through a view's runs and its merge of pieces, so every later
process loads machine code.
``scripts/setup_env.sh`` runs it after installing.
"""

from __future__ import annotations

import sys
import time

import numpy as np
import torch

from nemo_dcr.apply import TensorEngine
from nemo_dcr.apply.placement import Runs
from nemo_dcr.codec.warm import warm as warm_codec
from nemo_dcr.config.schema import DcrConfig
from nemo_dcr.kernels.cpu import map_runs
from nemo_dcr.types import DTYPES, SparseDelta
from nemo_dcr.verify.sample import Sample, runs_checksum

from .canonical import CanonicalSource
from .delta_refit import DeltaRefit
from .routing import merge
from .wiring import colocated_wiring

KEY = b"nemo-dcr-warm-up-key-0123456789ab"


def _refits(verify: str) -> None:
    """Attach and three delta refits of small bf16 and fp32 tensors into an in-process engine."""
    g = torch.Generator().manual_seed(0)
    params = {"w.weight": torch.randn(96, 64, generator=g).bfloat16(), "n.weight": torch.randn(64, generator=g)}
    engine = TensorEngine({n: t.clone() for n, t in params.items()}, key=KEY)
    cfg = DcrConfig(transport="inprocess", reply_timeout_s=600, verify=verify, verify_steps=2,
                    telemetry_encodings=["reference"])
    refit = DeltaRefit(cfg, CanonicalSource(params), colocated_wiring(cfg, 0, KEY), engine, key=KEY)
    try:
        refit.attach()
        for _ in range(3):
            for t in params.values():
                flat = t.view(-1)
                idx = torch.randint(0, flat.numel(), (flat.numel() // 50,), generator=g)
                flat[idx] = flat[idx] * 1.01 + 0.001
            refit.step()
    finally:
        refit.close(30)


def _runs(sample: Sample) -> None:
    bits = np.arange(4096, dtype=np.uint16)
    for local, canon, length in ((np.array([0]), np.array([0]), np.array([4096])),
                                 (np.array([0, 2048]), np.array([4096, 0]), np.array([2048, 2048]))):
        runs_checksum(bits, local.astype(np.int64), canon.astype(np.int64), length.astype(np.int64), sample, "w")
        # the megatron source's remap of captured positions through the same runs
        map_runs(np.arange(0, 4096, 7, dtype=np.int64), local.astype(np.int64), length.astype(np.int64),
                 canon.astype(np.int64), np.zeros(local.size, np.int64), 1)
    # the routing's walks: a view's changes, the owner's canonical ones, the merge of ranks' pieces
    view = Runs(np.array([0, 100]), np.array([0, 50]), np.array([50, 50]))
    _, j, _ = view.select(np.arange(0, 150, 3))
    view.view_to_canon(j), view.view_to_local(j)
    a, b = np.arange(0, 64, 2), np.arange(1, 64, 2)
    for dtype in ("bf16", "fp32", "fp8_e4m3"):
        uint = DTYPES[dtype].uint
        for old in (True, False):
            merge([SparseDelta("w", dtype, (64,), p, p.astype(uint), p.astype(uint) if old else None) for p in (a, b)])


def warm() -> float:
    """Run the codec warm-up and one refit path per check mode; returns the seconds it took."""
    t0 = time.perf_counter()
    warm_codec()
    for verify in ("sampled", "full"):
        _refits(verify)
    _runs(Sample(1, 16, 256, 0))
    torch.set_num_threads(1)
    return time.perf_counter() - t0


if __name__ == "__main__":
    seconds = warm()
    print(f"[warm] compiled kernels ready in {seconds:.1f}s", file=sys.stderr)
