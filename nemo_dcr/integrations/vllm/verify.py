"""Independent checks of a refit vLLM engine, for tests and benchmarks.

They do not use the placement, the payloads or the checksums under test: after a refit, every
parameter of every rank (as the model holds it, prepacked layouts included) must equal, byte for
byte, the same parameter of a *fresh* vLLM engine loaded from the dense target checkpoint with the
same configuration, and greedy generations must be token-identical.  The functions that run in
the workers are passed to ``LLM.collective_rpc`` as callables.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def param_bytes(worker) -> dict[str, tuple[str, list[int], bytes]]:
    """(dtype, shape, raw bytes) of every named param of a worker's model (runs in the worker)."""
    import torch

    out = {}
    for name, p in worker.model_runner.model.named_parameters():
        t = p.detach().contiguous().cpu()
        out[name] = (str(t.dtype), list(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return out


def engine_params(llm) -> list[dict[str, tuple[str, list[int], bytes]]]:
    """:func:`param_bytes` of every rank, in rank order."""
    return llm.collective_rpc(param_bytes)


def param_differences(got: Sequence[dict], want: Sequence[dict]) -> list[str]:
    """Every difference between two engines' params (rank by rank); empty when all are identical.

    Each line names the rank and param and, for equal shapes, how many bytes differ.
    """
    if len(got) != len(want):
        return [f"{len(got)} ranks vs {len(want)} ranks"]
    out = []
    for rank, (a, b) in enumerate(zip(got, want)):
        for name in sorted(set(a) | set(b)):
            if name not in a or name not in b:
                out.append(f"rank {rank} {name}: only in {'got' if name in a else 'want'}")
                continue
            (da, sa, ba), (db, sb, bb) = a[name], b[name]
            if (da, sa) != (db, sb):
                out.append(f"rank {rank} {name}: {da}{sa} vs {db}{sb}")
            elif ba != bb:
                n = int((np.frombuffer(ba, np.uint8) != np.frombuffer(bb, np.uint8)).sum())
                out.append(f"rank {rank} {name}: {n} of {len(ba)} bytes differ")
    return out
