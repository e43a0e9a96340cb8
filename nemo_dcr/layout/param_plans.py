"""Plan, then execute: per-parameter transforms built once per (family, dims, layout, chunk)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from nemo_dcr.layout.dims import ModelDims
from nemo_dcr.layout.families import FAMILIES, MLA_FAMILIES, Rule, rule_applies
from nemo_dcr.layout.mappings import Ctx, MegatronSpec
from nemo_dcr.layout.parallel import LayoutError, ParallelLayout, chunk_layers
from nemo_dcr.layout.shapes import canonical_shapes
from nemo_dcr.layout.transforms import RemapResult, Shape, Transform


@dataclass(frozen=True)
class ParamPlan:
    """How one Megatron-local parameter maps to the canonical tensors."""

    name: str
    """Megatron local name (as ``named_parameters()`` of the model chunk gives it)."""
    local_shape: Shape
    """Shape of the local shard."""
    transform: Transform
    """Local flat index -> canonical (name, flat index)."""
    targets: tuple[str, ...]
    """Canonical tensors this parameter writes into."""
    pattern: str
    """The family-table pattern that matched."""
    is_expert: bool = False
    """Routed-expert parameter: sharded over EP and expert-TP, replicated over expert-DP."""
    tp_replicated: bool = False
    """Identical on every (expert-)TP rank: one TP rank suffices to cover it."""
    duplicate_of: str | None = None
    """Another Megatron param holding the same values (tied output layer copy)."""

    @property
    def numel(self) -> int:
        """Elements of the local shard."""
        n = 1
        for s in self.local_shape:
            n *= s
        return n


@dataclass
class LayoutPlan:
    """All parameters of one model chunk on one rank, ready to remap changed indices.

    Build with :func:`build_plan`; reuse for every step.
    """

    family: str
    dims: ModelDims
    layout: ParallelLayout
    spec: MegatronSpec
    vpp_chunk: int
    params: dict[str, ParamPlan]
    patterns: tuple[str, ...]
    _shapes: dict[str, Shape] = field(repr=False, default_factory=dict)

    def lookup(self, megatron_name: str) -> ParamPlan:
        """The :class:`ParamPlan` of a name; ``module.`` wrapper prefixes are ignored.

        Raises:
            LayoutError: unknown name; the message lists the known patterns.
        """
        name = megatron_name
        while name.startswith("module."):
            name = name[len("module."):]
        plan = self.params.get(name)
        if plan is None:
            raise LayoutError(
                f"unknown megatron parameter {megatron_name!r} for family {self.family!r} "
                f"(pp_rank={self.layout.pp_rank}, vpp_chunk={self.vpp_chunk}); "
                f"known patterns: {list(self.patterns)}"
            )
        return plan

    def remap(self, megatron_name: str, local_flat_idx: torch.Tensor) -> RemapResult:
        """Map flat indices of a local shard to canonical (name, flat index) pieces.

        Args:
            megatron_name: local parameter name.
            local_flat_idx: 1-D int64 positions in the local shard.

        Returns:
            One piece per canonical tensor hit; positions that map to nothing (vocabulary
            padding) appear in no piece.
        """
        plan = self.lookup(megatron_name)
        idx = torch.as_tensor(local_flat_idx, dtype=torch.int64).reshape(-1)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= plan.numel):
            raise LayoutError(
                f"{megatron_name}: index out of range [0, {plan.numel}) for local shape "
                f"{plan.local_shape}"
            )
        return plan.transform.remap(idx)

    def canonical_shapes(self) -> dict[str, Shape]:
        """Every canonical tensor of the whole model (not only this rank's), name -> shape."""
        return dict(self._shapes)

    def local_targets(self) -> set[str]:
        """Canonical tensors some parameter of this plan writes into."""
        return {t for p in self.params.values() for t in p.targets}


def _expand(rule: Rule, ctx: Ctx, local_layer: int | None, plans: dict[str, ParamPlan],
            n_local_experts: int) -> None:
    """Add the parameters one rule yields for one layer (or globally) to ``plans``."""
    experts = range(n_local_experts) if rule.scope == "expert" else [None]
    for j in experts:
        x = None if j is None else ctx.layout.ep_rank * n_local_experts + j
        c = Ctx(ctx.dims, ctx.layout, ctx.spec, ctx.shape_of, ctx.layer, x)
        if not rule_applies(rule, c):
            return
        name = rule.pattern.format(i=local_layer, j=j)
        built = rule.mapping.build(c)
        is_expert = rule.scope == "expert" or "legacy_grouped" in rule.when
        plans[name] = ParamPlan(name, built.local_shape, built.transform, built.targets,
                                rule.pattern, is_expert, built.tp_replicated, rule.duplicate_of)


def build_plan(
    family: str,
    dims: ModelDims,
    layout: ParallelLayout,
    *,
    vpp_chunk: int = 0,
    spec: MegatronSpec = MegatronSpec(),
) -> LayoutPlan:
    """Build the plan of one model chunk of one rank.

    Args:
        family: a key of :data:`~nemo_dcr.layout.families.FAMILIES` (``llama``,
            ``qwen3_moe``, ``deepseek_v3`` and their aliases).
        dims: model dimensions.
        layout: parallel sizes and this rank's coordinates.
        vpp_chunk: model chunk index on this rank (0 without virtual pipeline).
        spec: which Megatron layer spec built the model.

    Raises:
        LayoutError: unknown family or impossible layout.
    """
    if family not in FAMILIES:
        raise LayoutError(f"unknown family {family!r}; known {sorted(FAMILIES)}")
    if (family in MLA_FAMILIES) != dims.multi_latent_attention:
        raise LayoutError(
            f"family {family!r} needs multi_latent_attention={family in MLA_FAMILIES}"
        )
    layout.validate(dims=dims)
    rules = FAMILIES[family]
    shapes = canonical_shapes(family, dims)

    def shape_of(name: str) -> Shape:
        if name not in shapes:
            raise LayoutError(f"family {family!r} has no canonical tensor {name!r}")
        return shapes[name]

    offset, count = chunk_layers(dims.num_layers, layout, vpp_chunk)
    first = layout.pp_rank == 0 and vpp_chunk == 0
    last = layout.pp_rank == layout.pp - 1 and vpp_chunk == layout.vpp - 1
    n_exp = dims.num_experts // layout.ep if dims.num_experts else 0
    plans: dict[str, ParamPlan] = {}
    base = Ctx(dims, layout, spec, shape_of)
    for rule in rules:
        if (rule.scope == "first" and first) or (rule.scope == "last" and last):
            _expand(rule, base, None, plans, n_exp)
    for i in range(count):
        ctx = Ctx(dims, layout, spec, shape_of, layer=offset + i)
        for rule in rules:
            if rule.scope in ("layer", "expert"):
                _expand(rule, ctx, i, plans, n_exp)
    patterns = tuple(dict.fromkeys(r.pattern for r in rules))
    return LayoutPlan(family, dims, layout, spec, vpp_chunk, plans, patterns, shapes)


def build_chunk_plans(
    family: str, dims: ModelDims, layout: ParallelLayout, *, spec: MegatronSpec = MegatronSpec()
) -> list[LayoutPlan]:
    """One :class:`LayoutPlan` per virtual-pipeline chunk of this rank (Megatron's model list)."""
    return [build_plan(family, dims, layout, vpp_chunk=v, spec=spec) for v in range(layout.vpp)]
