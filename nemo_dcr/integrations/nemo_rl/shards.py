"""Capture from the policy's own Megatron shards inside NeMo-RL (no export).

NeMo-RL builds the checkpoint engine inside every policy worker and keeps it as the worker's
``checkpoint_engine`` attribute, as on the rollout side, so ``prepare()`` finds the worker
(:func:`~.rollout.find_owner`).  A Megatron policy worker (NeMo-RL's ``MegatronPolicyWorkerImpl``)
keeps its megatron-core model as ``self.model`` (DDP-wrapped; a list of chunks is accepted too)
and its optimizer as ``self.optimizer``.  :func:`policy_shards` builds the refit's own trainer
source over those chunks (:func:`nemo_dcr.refit.source.source_for`: the registered megatron-core
builder, :class:`~nemo_dcr.integrations.megatron.MegatronSource`, the same one the main job
uses; its capture ranges come from the distributed optimizer's buffers when the chunks use it),
so each sync runs the one refit path's capture / remap / encode on the live shards.  NeMo-RL's
export iterator (``_iter_params_with_optional_kv_scales``, a generator around Megatron-Bridge's
``export_hf_weights`` with its TP / EP gathers and PP broadcast) is then never started.

Anything else keeps the export path, with the reason: no worker found, a worker without a
megatron-core ``model`` (a DTensor policy, another backend), a model the layout tables cannot
describe, or shards whose canonical tensors differ from what the vLLM workers load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from nemo_dcr.refit.source import TrainerSource, source_for

EMBEDDING = "model.embed_tokens.weight"
"""The canonical embedding, whose rows are the real (unpadded) vocabulary."""


@dataclass(frozen=True)
class ShardLookup:
    """Where one policy worker's refit reads the weights from.

    Attributes:
        source: the trainer source over the worker's own shards (None: NeMo-RL's export).
        detail: what was found (``source`` set) or why the export is used.
    """

    source: TrainerSource | None
    detail: str


def policy_shards(worker: Any, table: Mapping[str, tuple[str, tuple[int, ...]]]) -> ShardLookup:
    """The trainer source over the megatron-core chunks of the policy ``worker``, checked against
    ``table`` (never raises: whatever fails is the reason to use the export).

    Args:
        worker: the NeMo-RL policy worker hosting this checkpoint engine (None: not found).
        table: the canonical tensors the vLLM workers load (name -> (wire dtype, shape)).
    """
    if worker is None:
        return ShardLookup(None, "no policy worker holds this checkpoint engine as .checkpoint_engine")
    what = type(worker).__name__
    model = getattr(worker, "model", None)
    if model is None:
        return ShardLookup(None, f"{what} has no .model")
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    cp = _context_parallel(chunks)
    if cp > 1:
        return ShardLookup(None, f"{what}.model runs context parallelism (context_parallel_size={cp}): capture "
                                 "ranges over context-parallel replicas are not derived yet")
    try:
        source = source_for(model, **_source_options(chunks, table))
    except TypeError as exc:  # no registered framework understands the model (DTensor, another backend)
        return ShardLookup(None, f"{what}.model is a {type(chunks[0]).__name__}, no megatron-core model "
                                 f"({str(exc)[:200]})")
    except Exception as exc:  # noqa: BLE001 - a model the layout tables cannot describe: say why, use the export
        return ShardLookup(None, f"{what}.model is not described by the layout tables: "
                                 f"{type(exc).__name__}: {str(exc)[:300]}")
    differ = table_differences(source.canonical, table)
    if differ:
        return ShardLookup(None, f"the shards' canonical tensors differ from what vLLM loads: {differ}")
    ddp = any(getattr(getattr(c, "ddp_config", None), "use_distributed_optimizer", False) for c in chunks)
    return ShardLookup(source, f"{what}: {len(chunks)} megatron-core chunk(s), optimizer "
                               f"{type(getattr(worker, 'optimizer', None)).__name__}, capture ranges from "
                               f"{'the distributed optimizer' if ddp else 'an even split per replica group'}")


def _source_options(chunks: list, table: Mapping[str, tuple[str, tuple[int, ...]]]) -> dict:
    """What the builder needs that the model does not carry: the real vocabulary (the rows of the
    embedding vLLM loads; megatron keeps only the padded one) and megatron's uneven-pipeline knobs
    (from the model's config)."""
    from nemo_dcr.integrations.megatron.params import unwrap

    out: dict[str, Any] = {}
    if EMBEDDING in table:
        out["vocab_size"] = int(table[EMBEDDING][1][0])
    config = getattr(unwrap(chunks[0]), "config", None)
    for knob in ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage"):
        value = getattr(config, knob, None)
        if value is not None:
            out[knob] = int(value)
    return out


def _context_parallel(chunks: list) -> int:
    from nemo_dcr.integrations.megatron.params import unwrap

    return int(getattr(getattr(unwrap(chunks[0]), "config", None), "context_parallel_size", 1) or 1)


def table_differences(mine: Mapping[str, tuple[str, tuple[int, ...]]],
                      table: Mapping[str, tuple[str, tuple[int, ...]]]) -> str:
    """What differs between two canonical tables ('' when nothing): names on one side only, and
    names whose dtype or shape differ (at most 5 of each, named)."""
    only_mine = sorted(set(mine) - set(table))
    only_table = sorted(set(table) - set(mine))
    wrong = sorted(n for n in set(mine) & set(table)
                   if (mine[n][0], tuple(mine[n][1])) != (table[n][0], tuple(table[n][1])))
    parts = []
    if only_table:
        parts.append(f"{len(only_table)} loaded by vLLM but not in the shards {only_table[:5]}")
    if only_mine:
        parts.append(f"{len(only_mine)} in the shards but not loaded by vLLM {only_mine[:5]}")
    if wrong:
        parts.append(f"{len(wrong)} of another dtype or shape {[(n, mine[n], table[n]) for n in wrong[:5]]}")
    return "; ".join(parts)
