"""Capture from the policy's own Megatron shards inside NeMo-RL (no export).

NeMo-RL builds the checkpoint engine inside every policy worker and stores it as the worker's
``checkpoint_engine`` attribute, as on the rollout side.  :func:`policy_shards` finds that
worker (:func:`~.rollout.find_owner`), reads its model chunks (``worker.model``: the
megatron-core model, DDP-wrapped, or a list of virtual-pipeline chunks) and its optimizer
(``worker.optimizer``), and builds the refit's own trainer source over them
(:func:`nemo_dcr.refit.source.source_for`: the registered megatron-core builder), so each sync
is the one refit path's capture / remap / encode on the live shards and NeMo-RL's export
iterator (Megatron-Bridge's HF export with its TP / EP gathers and PP broadcast) is never
started.  Anything else (a DTensor policy, another backend, a model the layout tables cannot
describe, a canonical table that differs from what vLLM loads) keeps the export path, with the
reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from nemo_dcr.refit.source import TrainerSource, source_for


@dataclass(frozen=True)
class ShardLookup:
    """Where one policy worker's refit reads the weights from.

    Attributes:
        source: the trainer source over the worker's own shards (None: use NeMo-RL's export).
        detail: what was found (``source`` set) or why the export is used.
    """

    source: TrainerSource | None
    detail: str


def policy_shards(engine: Any, table: Mapping[str, tuple[str, tuple[int, ...]]]) -> ShardLookup:
    """The trainer source of the Megatron policy worker hosting ``engine``, checked against ``table``.

    Args:
        engine: this policy worker's checkpoint engine (``worker.checkpoint_engine``).
        table: the canonical tensors the vLLM workers load (name -> (wire dtype, shape)).
    """
    from .rollout import find_owner

    worker = find_owner(engine)
    if worker is None:
        return ShardLookup(None, "no policy worker holds this checkpoint engine as .checkpoint_engine")
    model = getattr(worker, "model", None)
    if model is None:
        return ShardLookup(None, f"{type(worker).__name__} has no .model")
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    options = _source_options(chunks, table)
    try:
        source = source_for(chunks, **options)
    except TypeError as exc:  # no registered framework understands the model (DTensor, another backend)
        return ShardLookup(None, f"{type(worker).__name__}.model is not megatron-core ({str(exc)[:200]})")
    except Exception as exc:  # noqa: BLE001 - a model the layout tables cannot describe: say why, use the export
        return ShardLookup(None, f"megatron-core model not described by the layout tables: "
                                 f"{type(exc).__name__}: {str(exc)[:300]}")
    differ = table_differences(source.canonical, table)
    if differ:
        return ShardLookup(None, f"the shards' canonical tensors differ from what vLLM loads: {differ}")
    optimizer = getattr(worker, "optimizer", None)
    ddp = any(getattr(getattr(c, "ddp_config", None), "use_distributed_optimizer", False) for c in chunks)
    return ShardLookup(source, f"{type(worker).__name__}: {len(chunks)} megatron-core chunk(s), optimizer "
                               f"{type(optimizer).__name__}, capture ranges from "
                               f"{'the distributed optimizer' if ddp else 'an even split per replica group'}")


def _source_options(chunks: list, table: Mapping[str, tuple[str, tuple[int, ...]]]) -> dict:
    """The builder's options NeMo-RL's model does not carry: the real vocabulary (vLLM's table) and
    megatron's uneven-pipeline knobs (from the model's config)."""
    out: dict[str, Any] = {}
    embed = table.get("model.embed_tokens.weight")
    if embed is not None:
        out["vocab_size"] = int(embed[1][0])
    config = getattr(_unwrap(chunks[0]), "config", None)
    for knob in ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage"):
        value = getattr(config, knob, None)
        if value is not None:
            out[knob] = int(value)
    return out


def _unwrap(model):
    while hasattr(model, "module"):
        model = model.module
    return model


def table_differences(mine: Mapping[str, tuple[str, tuple[int, ...]]],
                      table: Mapping[str, tuple[str, tuple[int, ...]]]) -> str:
    """What differs between two canonical tables ('' when none): names on one side only, and
    names whose dtype or shape differ (at most 5 of each, named)."""
    only_mine = sorted(set(mine) - set(table))
    only_table = sorted(set(table) - set(mine))
    wrong = sorted(n for n in set(mine) & set(table) if (mine[n][0], tuple(mine[n][1])) != (table[n][0], tuple(table[n][1])))
    parts = []
    if only_table:
        parts.append(f"{len(only_table)} loaded by vLLM but not in the shards {only_table[:5]}")
    if only_mine:
        parts.append(f"{len(only_mine)} in the shards but not loaded by vLLM {only_mine[:5]}")
    if wrong:
        parts.append(f"{len(wrong)} of another dtype or shape "
                     f"{[(n, mine[n], table[n]) for n in wrong[:5]]}")
    return "; ".join(parts)
