"""Topology as a value: parallel sizes, this rank's coordinates, pipeline layer assignment.

Nothing here talks to ``torch.distributed`` or ``megatron.core.parallel_state``; the megatron
adapter reads those and builds a :class:`ParallelLayout`. Everything is plain integers, so the
whole layout stage is testable on one CPU process.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from nemo_dcr.layout.dims import ModelDims


class LayoutError(ValueError):
    """An impossible parallel layout, model config, or parameter name."""


@dataclass(frozen=True)
class ParallelLayout:
    """Parallel sizes of a Megatron-Core job and the coordinates of one rank in it.

    A rank holds ``vpp`` model chunks (Megatron's ``model`` list); every chunk shares these
    coordinates and the chunk index is passed separately (see :func:`chunk_layers`).
    """

    tp: int = 1
    """Tensor-parallel size (dense layers, attention, embeddings, shared experts)."""
    pp: int = 1
    """Pipeline-parallel size."""
    vpp: int = 1
    """Virtual pipeline size: model chunks per pipeline rank (1 = not interleaved)."""
    ep: int = 1
    """Expert-parallel size: routed experts are split evenly over EP ranks."""
    etp: int = 1
    """Expert tensor-parallel size (Megatron's ``expert_tensor_parallel_size``; megatron
    defaults it to ``tp`` when unset, pass the resolved value)."""
    dp: int = 1
    """Data-parallel size of the dense part (replicas of the TP*PP model)."""
    cp: int = 1
    """Context-parallel size (only enters the world-size check; weights are not split by CP)."""
    tp_rank: int = 0
    """This rank's coordinate in the tensor-parallel group."""
    pp_rank: int = 0
    """This rank's pipeline stage."""
    ep_rank: int = 0
    """This rank's coordinate in the expert-parallel group."""
    etp_rank: int = 0
    """This rank's coordinate in the expert tensor-parallel group."""
    dp_rank: int = 0
    """This rank's coordinate in the data-parallel group."""
    num_layers_in_first_pipeline_stage: int | None = None
    """Megatron's uneven-pipeline knob: layers on stage 0 (None = even split)."""
    num_layers_in_last_pipeline_stage: int | None = None
    """Megatron's uneven-pipeline knob: layers on the last stage (None = even split)."""

    @property
    def world_size(self) -> int:
        """Total ranks: ``tp * cp * dp * pp``."""
        return self.tp * self.cp * self.dp * self.pp

    @property
    def expert_dp(self) -> int:
        """Expert data-parallel size: ``tp * cp * dp / (etp * ep)``."""
        return (self.tp * self.cp * self.dp) // (self.etp * self.ep)

    def sizes(self) -> dict[str, int | None]:
        """The parallel sizes and pipeline knobs (every field but this rank's coordinates)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if not f.name.endswith("_rank")}

    def describe(self) -> str:
        """``TP8 PP8(7/../6) EP32 ETP1 DP16`` style summary of the sizes (``(first/../last)``: the
        uneven-pipeline knobs, ``=`` for an even one; VPP and CP only when above 1)."""
        first, last = self.num_layers_in_first_pipeline_stage, self.num_layers_in_last_pipeline_stage
        pp = f"PP{self.pp}" + (f"({first or '='}/../{last or '='})" if first is not None or last is not None else "")
        vpp = f" VPP{self.vpp}" if self.vpp > 1 else ""
        cp = f" CP{self.cp}" if self.cp > 1 else ""
        return f"TP{self.tp} {pp}{vpp} EP{self.ep} ETP{self.etp} DP{self.dp}{cp}"

    def validate(self, world_size: int | None = None, dims: ModelDims | None = None) -> None:
        """Raise :class:`LayoutError` for impossible combinations.

        Args:
            world_size: when given, must equal ``tp * cp * dp * pp``.
            dims: when given, also check divisibility of heads, groups, FFN, experts and the
                pipeline split against the model.
        """
        self._check_sizes()
        if world_size is not None and world_size != self.world_size:
            raise LayoutError(
                f"world size {world_size} != tp*cp*dp*pp = "
                f"{self.tp}*{self.cp}*{self.dp}*{self.pp} = {self.world_size}"
            )
        if dims is not None:
            _check_against_model(self, dims)
            for stage in range(self.pp):
                for chunk in range(self.vpp):
                    chunk_layers(dims.num_layers, self, chunk, pp_rank=stage)

    def _check_sizes(self) -> None:
        for f in ("tp", "pp", "vpp", "ep", "etp", "dp", "cp"):
            if getattr(self, f) < 1:
                raise LayoutError(f"{f}={getattr(self, f)} must be >= 1")
        for size, rank in (("tp", "tp_rank"), ("pp", "pp_rank"), ("ep", "ep_rank"),
                           ("etp", "etp_rank"), ("dp", "dp_rank")):
            if not 0 <= getattr(self, rank) < getattr(self, size):
                raise LayoutError(
                    f"{rank}={getattr(self, rank)} out of range for {size}={getattr(self, size)}"
                )
        dense = self.tp * self.cp * self.dp
        if dense % (self.etp * self.ep):
            raise LayoutError(
                f"etp*ep = {self.etp}*{self.ep} must divide tp*cp*dp = {dense} "
                "(experts are carved out of the same ranks as the dense model)"
            )
        if self.vpp > 1 and self.pp == 1:
            raise LayoutError("vpp > 1 needs pp > 1 (megatron ignores interleaving at pp=1)")

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of all fields (JSON-serializable)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ParallelLayout:
        """Inverse of :meth:`to_dict`; unknown keys raise."""
        known = {f.name for f in dataclasses.fields(cls)}
        extra = set(d) - known
        if extra:
            raise LayoutError(f"unknown ParallelLayout keys {sorted(extra)}; known {sorted(known)}")
        return cls(**d)

    def to_json(self) -> str:
        """JSON text of :meth:`to_dict`."""
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ParallelLayout:
        """Inverse of :meth:`to_json`."""
        return cls.from_dict(json.loads(text))


def _check_against_model(lay: ParallelLayout, dims: ModelDims) -> None:
    """Divisibility rules Megatron-Core asserts when it builds the model."""
    checks = [(dims.num_attention_heads, lay.tp, "num_attention_heads", "tp")]
    if not dims.multi_latent_attention:
        g = dims.kv_heads
        if g % lay.tp and lay.tp % g:
            raise LayoutError(f"tp={lay.tp} and num_query_groups={g}: one must divide the other")
    if dims.has_dense_mlp:
        checks.append((dims.ffn_hidden_size, lay.tp, "ffn_hidden_size", "tp"))
    if dims.num_experts:
        checks.append((dims.num_experts, lay.ep, "num_experts", "ep"))
        checks.append((dims.moe_ffn_hidden_size, lay.etp, "moe_ffn_hidden_size", "etp"))
        if dims.shared_expert_ffn_hidden_size:
            checks.append((dims.shared_expert_ffn_hidden_size, lay.tp, "shared_expert_ffn", "tp"))
    elif lay.ep > 1 or lay.etp > 1:
        raise LayoutError(f"ep={lay.ep}, etp={lay.etp} need a model with experts")
    for value, div, vname, dname in checks:
        if value % div:
            raise LayoutError(f"{dname}={div} does not divide {vname}={value}")


def _stage_layers(num_layers: int, lay: ParallelLayout, pp_rank: int) -> int:
    """Layers on one pipeline stage (all its VPP chunks together)."""
    first, last = lay.num_layers_in_first_pipeline_stage, lay.num_layers_in_last_pipeline_stage
    if first is None and last is None:
        if num_layers % lay.pp:
            raise LayoutError(f"num_layers={num_layers} not divisible by pp={lay.pp}")
        return num_layers // lay.pp
    middle_layers = num_layers - (first or 0) - (last or 0)
    middle_stages = lay.pp - (first is not None) - (last is not None)
    if middle_layers < 0 or (middle_stages <= 0 and middle_layers):
        raise LayoutError(
            f"uneven pipeline: first={first}, last={last} do not fit num_layers={num_layers} "
            f"on pp={lay.pp}"
        )
    if middle_stages > 0 and middle_layers % middle_stages:
        raise LayoutError(
            f"uneven pipeline: {middle_layers} middle layers not divisible by "
            f"{middle_stages} middle stages"
        )
    if pp_rank == 0 and first is not None:
        return first
    if pp_rank == lay.pp - 1 and last is not None:
        return last
    return middle_layers // middle_stages if middle_stages > 0 else 0


def chunk_layers(
    num_layers: int, lay: ParallelLayout, vpp_chunk: int = 0, pp_rank: int | None = None
) -> tuple[int, int]:
    """Global layer offset and layer count of one model chunk.

    Matches megatron-core 0.16 ``get_transformer_layer_offset`` and
    ``get_num_layers_to_build`` (without ``pipeline_model_parallel_layout`` and without
    ``account_for_embedding/loss_in_pipeline_split``). Local layer ``i`` of the chunk is global
    layer ``offset + i``.

    Example: 8 layers, pp=2, vpp=2 gives stage 0 chunks [0, 1] and [4, 5], stage 1 chunks
    [2, 3] and [6, 7].

    Args:
        num_layers: transformer layers of the whole model.
        lay: the parallel layout (pp, vpp, uneven-stage knobs).
        vpp_chunk: model chunk index on the rank, ``0 <= vpp_chunk < lay.vpp``.
        pp_rank: pipeline stage; defaults to ``lay.pp_rank``.

    Returns:
        ``(offset, count)``.
    """
    pp_rank = lay.pp_rank if pp_rank is None else pp_rank
    if not 0 <= vpp_chunk < lay.vpp:
        raise LayoutError(f"vpp_chunk={vpp_chunk} out of range for vpp={lay.vpp}")
    if lay.pp == 1:
        return 0, num_layers
    stage = _stage_layers(num_layers, lay, pp_rank)
    if stage % lay.vpp:
        raise LayoutError(f"{stage} layers on stage {pp_rank} not divisible by vpp={lay.vpp}")
    count = stage // lay.vpp
    return _chunk_offset(num_layers, lay, vpp_chunk, pp_rank), count


def _chunk_offset(num_layers: int, lay: ParallelLayout, chunk: int, pp_rank: int) -> int:
    """Port of the offset arithmetic of megatron-core's ``get_transformer_layer_offset``."""
    first, last = lay.num_layers_in_first_pipeline_stage, lay.num_layers_in_last_pipeline_stage
    if first is None and last is None:
        per_rank = num_layers // lay.pp
        if lay.vpp == 1:
            return pp_rank * per_rank
        return chunk * (num_layers // lay.vpp) + pp_rank * (per_rank // lay.vpp)
    middle_stages = lay.pp - (first is not None) - (last is not None)
    middle_layers = num_layers - (first or 0) - (last or 0)
    middle_rank = pp_rank if first is None else pp_rank - 1
    if lay.vpp == 1:
        per_rank = middle_layers // middle_stages if middle_stages > 0 else 0
        return 0 if pp_rank == 0 else middle_rank * per_rank + (first or 0)
    first_c, last_c = (first or 0) // lay.vpp, (last or 0) // lay.vpp
    middle_c = middle_layers // lay.vpp
    total = first_c + middle_c + last_c
    if pp_rank == 0:
        return chunk * total
    per_middle = middle_c // middle_stages if middle_stages > 0 else 0
    return chunk * total + first_c + middle_rank * per_middle
