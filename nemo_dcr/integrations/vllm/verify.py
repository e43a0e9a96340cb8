"""Independent checks of a refit vLLM engine: every param and buffer against a fresh engine.

They do not use the placement, the payloads or the checksums under test: after a refit, every
parameter, buffer and tensor attribute of every module of every rank (as the model holds it,
prepacked layouts included) must equal, element by element on integer views, the same tensor of
a *fresh* vLLM engine loaded densely from the target checkpoint with the same configuration
(its loader and post-load processing), and greedy generations must be token-identical.  The
functions that run in the workers are passed to ``LLM.collective_rpc`` as callables.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

State = dict[str, tuple[str, list[int], bytes]]
"""``kind:name`` (``param:``, ``buffer:``, ``attr:``) -> (dtype, shape, raw bytes), of one rank."""


@dataclass(frozen=True)
class StateDiff:
    """One tensor that differs between two engines.

    Attributes:
        rank: TP rank.
        name: ``param:<name>``, ``buffer:<name>`` or ``attr:<module>.<name>``.
        differing: elements whose bits differ (-1: the tensor is on one side only, or its dtype
            or shape differs).
        numel: elements of the tensor.
        note: what differs when it is not the bits.
    """

    rank: int
    name: str
    differing: int
    numel: int
    note: str = ""

    def __str__(self) -> str:
        what = self.note or f"{self.differing} of {self.numel} elements differ"
        return f"rank {self.rank} {self.name}: {what}"


def state_bytes(worker) -> State:
    """(dtype, shape, raw bytes) of every param, buffer and tensor attribute of a worker's model
    (runs in the worker; nemo_dcr's own copies, ``dcr*`` attributes, and the KV cache are not the
    engine's state)."""
    import torch

    from .preflight import state_tensors

    out = {}
    for name, t in state_tensors(worker, {}).items():
        c = t.detach().contiguous().cpu()
        out[name] = (str(c.dtype), list(c.shape), c.reshape(-1).view(torch.uint8).numpy().tobytes()
                     if c.numel() else b"")
    return out


def engine_state(llm) -> list[State]:
    """:func:`state_bytes` of every rank, in rank order."""
    return llm.collective_rpc(state_bytes)


def _width(dtype: str) -> int:
    import torch

    return getattr(torch, dtype.removeprefix("torch.")).itemsize


def state_differences(got: Sequence[State], want: Sequence[State]) -> list[StateDiff]:
    """Every difference between two engines' states (rank by rank); empty when all are identical."""
    if len(got) != len(want):
        return [StateDiff(-1, "ranks", -1, 0, f"{len(got)} ranks vs {len(want)} ranks")]
    out = []
    for rank, (a, b) in enumerate(zip(got, want)):
        for name in sorted(set(a) | set(b)):
            if name not in a or name not in b:
                side = "the refit engine" if name in a else "the fresh one"
                out.append(StateDiff(rank, name, -1, 0, f"only in {side}"))
                continue
            (da, sa, ba), (db, sb, bb) = a[name], b[name]
            numel = int(np.prod(sa)) if sa else 1
            if (da, sa) != (db, sb):
                out.append(StateDiff(rank, name, -1, numel, f"{da}{sa} vs {db}{sb}"))
            elif ba != bb:
                w = _width(da)
                ia = np.frombuffer(ba, np.uint8).reshape(-1, w)
                ib = np.frombuffer(bb, np.uint8).reshape(-1, w)
                out.append(StateDiff(rank, name, int((ia != ib).any(axis=1).sum()), numel))
    return out
