"""Typed mapping objects: one Megatron parameter kind -> (local shape, index transform).

A family table (see :mod:`nemo_dcr.layout.families`) pairs a Megatron name pattern with one of
these. ``build`` is called once per parameter while the plan is built; the returned transform
is reused for every step.

Name templates use ``{L}`` for the global layer and ``{X}`` for the global expert.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from nemo_dcr.layout.dims import ModelDims
from nemo_dcr.layout.parallel import LayoutError, ParallelLayout
from nemo_dcr.layout.transforms import (
    BlockSplit,
    Compose,
    InterleavedRowSplit,
    Rename,
    Shape,
    ShardDim,
    Transform,
    Transpose,
    Truncate,
    chain,
)


@dataclass(frozen=True)
class MegatronSpec:
    """Which Megatron-Core layer spec built the model (decides names and a few shardings)."""

    transformer_engine: bool = False
    """TE spec: norms fused into ``linear_qkv``/``linear_fc1`` (``layer_norm_weight``), MLA
    down-projections replicated (TELinear ``duplicated``) instead of column-parallel."""
    moe_grouped_gemm: bool = False
    """Experts as one grouped module instead of ``local_experts.N`` (SequentialMLP)."""
    legacy_grouped_gemm: bool = False
    """With ``moe_grouped_gemm``: legacy ``GroupedMLP`` (``experts.weight1/weight2``,
    transposed) instead of TE's ``experts.linear_fc1.weightN``."""


@dataclass(frozen=True)
class Ctx:
    """What a mapping needs to build one parameter's transform."""

    dims: ModelDims
    layout: ParallelLayout
    spec: MegatronSpec
    shape_of: Callable[[str], Shape]
    """Canonical shape of a resolved HF name."""
    layer: int | None = None
    """Global layer of the parameter (None for embeddings and the final norm)."""
    expert: int | None = None
    """Global expert of the parameter (SequentialMLP / TE grouped)."""

    def name(self, template: str, expert: int | None = None) -> str:
        """Resolve ``{L}`` and ``{X}`` in a template."""
        x = self.expert if expert is None else expert
        return template.format(L=self.layer, X=x)

    def split(self, expert: bool) -> tuple[int, int]:
        """(parts, rank) of the tensor-parallel group that shards this parameter."""
        lay = self.layout
        return (lay.etp, lay.etp_rank) if expert else (lay.tp, lay.tp_rank)


@dataclass(frozen=True)
class Built:
    """A built parameter: its local shape, transform, and canonical targets."""

    local_shape: Shape
    transform: Transform
    targets: tuple[str, ...]
    tp_replicated: bool = False


def _div(a: int, b: int, what: str) -> int:
    if a % b:
        raise LayoutError(f"{what}: {a} not divisible by {b}")
    return a // b


@dataclass(frozen=True)
class Replicated:
    """Same tensor on every tensor-parallel rank (norms, router, expert bias)."""

    hf: str

    def build(self, ctx: Ctx) -> Built:
        name = ctx.name(self.hf)
        return Built(ctx.shape_of(name), Rename(name), (name,), tp_replicated=True)


@dataclass(frozen=True)
class Sharded:
    """ColumnParallel (``dim=0``) or RowParallel (``dim=1``) shard of one HF tensor."""

    hf: str
    dim: int
    expert: bool = False

    def build(self, ctx: Ctx) -> Built:
        name = ctx.name(self.hf)
        full = ctx.shape_of(name)
        parts, rank = ctx.split(self.expert)
        local = list(full)
        local[self.dim] = _div(full[self.dim], parts, name)
        return Built(tuple(local), ShardDim(full, self.dim, parts, rank, name), (name,))


def Column(hf: str, expert: bool = False) -> Sharded:  # noqa: N802 - table constructor
    """ColumnParallelLinear weight: output rows split over TP."""
    return Sharded(hf, 0, expert)


def Row(hf: str, expert: bool = False) -> Sharded:  # noqa: N802 - table constructor
    """RowParallelLinear weight: input columns split over TP."""
    return Sharded(hf, 1, expert)


@dataclass(frozen=True)
class QKV:
    """GQA ``linear_qkv`` (weight or bias) -> ``q_proj``, ``k_proj``, ``v_proj``.

    Megatron's full tensor stacks, per query group, ``q_per_group`` q heads then one k and one
    v head: ``[q0 q1 k0 v0 | q2 q3 k1 v1 | ...]`` (rows of ``head_dim``); TP then cuts the full
    tensor into equal row slices (also when ``tp > groups``, where a slice is part of a group).
    """

    q: str
    k: str
    v: str

    def build(self, ctx: Ctx) -> Built:
        d = ctx.dims
        names = (ctx.name(self.q), ctx.name(self.k), ctx.name(self.v))
        qshape = ctx.shape_of(names[0])
        cols = qshape[1] if len(qshape) == 2 else 1
        hd, groups = d.kv_channels, d.kv_heads
        q_rows = d.num_attention_heads * hd
        rows = q_rows + 2 * groups * hd
        full = (rows,) + tuple(qshape[1:])
        parts, rank = ctx.split(False)
        split = InterleavedRowSplit(groups, (q_rows // groups, hd, hd), cols, names)
        local = (_div(rows, parts, names[0]),) + tuple(qshape[1:])
        return Built(local, Compose(ShardDim(full, 0, parts, rank), split), names)


@dataclass(frozen=True)
class GateUp:
    """SwiGLU ``linear_fc1`` -> ``gate_proj``, ``up_proj``.

    Each TP (or expert-TP) shard holds ``[gate_shard; up_shard]``: the local rows are split in
    two halves first, then each half is a row shard of its HF tensor.
    """

    gate: str
    up: str
    expert: bool = False

    def build(self, ctx: Ctx) -> Built:
        gate, up = ctx.name(self.gate), ctx.name(self.up)
        return _gate_up(ctx, gate, up, self.expert)


def _gate_up(ctx: Ctx, gate: str, up: str, expert: bool) -> Built:
    full = ctx.shape_of(gate)
    parts, rank = ctx.split(expert)
    half = _div(full[0], parts, gate)
    split = InterleavedRowSplit(1, (half, half), full[1], ("gate", "up"))
    route = (("gate", ShardDim(full, 0, parts, rank, gate)),
             ("up", ShardDim(full, 0, parts, rank, up)))
    return Built((2 * half, full[1]), Compose(split, route), (gate, up))


@dataclass(frozen=True)
class VocabRows:
    """VocabParallelEmbedding / output layer: TP row shard of the padded vocabulary.

    Rows at or past the real vocabulary (Megatron's padding) map to nothing.
    """

    hf: str

    def build(self, ctx: Ctx) -> Built:
        name = ctx.name(self.hf)
        vocab, hidden = ctx.shape_of(name)
        padded = ctx.dims.padded_vocab(ctx.layout.tp)
        if padded < vocab:
            raise LayoutError(f"padded vocab {padded} < vocab {vocab}")
        parts, rank = ctx.split(False)
        local = (_div(padded, parts, "padded vocab"), hidden)
        t = chain(ShardDim((padded, hidden), 0, parts, rank), Truncate(vocab * hidden, name))
        return Built(local, t, (name,))


def _local_experts(ctx: Ctx) -> list[int]:
    n = _div(ctx.dims.num_experts, ctx.layout.ep, "num_experts / ep")
    return [ctx.layout.ep_rank * n + j for j in range(n)]


@dataclass(frozen=True)
class GroupedFC1:
    """Legacy ``GroupedMLP.weight1`` -> per-expert ``gate_proj``/``up_proj``.

    Sharding pattern: ``weight1`` is ``[hidden, E_local * 2F/etp]`` but its memory is read as
    ``[E_local, hidden, 2F/etp]``: expert ``e`` is the transpose of its ``linear_fc1`` shard
    ``[gate_shard; up_shard]``.
    """

    gate: str
    up: str

    def build(self, ctx: Ctx) -> Built:
        experts = _local_experts(ctx)
        hidden = ctx.dims.hidden_size
        per = _div(2 * ctx.dims.moe_ffn_hidden_size, ctx.layout.etp, "moe ffn / etp")
        keys = tuple(f"e{x}" for x in experts)
        route, targets = [], []
        for key, x in zip(keys, experts):
            b = _gate_up(ctx, ctx.name(self.gate, x), ctx.name(self.up, x), True)
            route.append((key, b.transform))
            targets += b.targets
        t = chain(BlockSplit(hidden * per, keys), Transpose(hidden, per), tuple(route))
        return Built((hidden, len(experts) * per), t, tuple(targets))


@dataclass(frozen=True)
class GroupedFC2:
    """Legacy ``GroupedMLP.weight2`` ``[E_local * F/etp, hidden]`` -> per-expert ``down_proj``.

    Expert ``e`` is rows ``[e*F/etp, (e+1)*F/etp)``, the transpose of its ``linear_fc2`` shard.
    """

    down: str

    def build(self, ctx: Ctx) -> Built:
        experts = _local_experts(ctx)
        hidden = ctx.dims.hidden_size
        ffn = ctx.dims.moe_ffn_hidden_size
        per = _div(ffn, ctx.layout.etp, "moe ffn / etp")
        keys = tuple(f"e{x}" for x in experts)
        route = tuple(
            (k, ShardDim((hidden, ffn), 1, ctx.layout.etp, ctx.layout.etp_rank,
                         ctx.name(self.down, x)))
            for k, x in zip(keys, experts)
        )
        t = chain(BlockSplit(per * hidden, keys), Transpose(per, hidden), route)
        targets = tuple(ctx.name(self.down, x) for x in experts)
        return Built((len(experts) * per, hidden), t, targets)


Mapping = Replicated | Sharded | QKV | GateUp | VocabRows | GroupedFC1 | GroupedFC2
