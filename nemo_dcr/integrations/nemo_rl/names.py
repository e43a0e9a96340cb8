"""Weights NeMo-RL refits through paths the plugin does not take: refused by name at startup.

NeMo-RL's vLLM worker does more with a refit than ``model.load_weights`` (its ``_load_weights``):
it hands ``draft.*`` tensors (Eagle3) to the speculative drafter, feeds an MTP drafter the
policy stream, renames Gemma-3 vision-tower weights, and post-processes FP8 KV-cache scales
(``process_weights_after_loading``).  The plugin applies in place into ``model_runner.model``
only, so each of these would be left stale or half-applied; they are refused before the first
sync, naming what was found and where.  Exported names that no vLLM worker's loader places (a
tied ``lm_head``, ``rotary_emb.inv_freq``) are skipped as vLLM skips them and listed once in
the log by policy rank 0 (:func:`~.sync_log.log_unloaded`).
"""

from __future__ import annotations

import re
from typing import Any, Iterable

DRAFT_PREFIX = "draft."
"""NeMo-RL exports the Eagle3 drafter's weights under this prefix."""
KV_SCALE = re.compile(r"\.(k_scale|v_scale|q_scale|prob_scale|kv_scale)$")
"""FP8 KV-cache scale tensors NeMo-RL appends to the export when vLLM's KV cache is FP8."""
MTP = re.compile(r"(^|\.)mtp\.")
"""Multi-token-prediction layers (a co-trained MTP drafter)."""
WHAT = "use another policy.generation.refit_transport for this model"


class UnsupportedWeights(ValueError):
    """Weights the plugin cannot refit the way NeMo-RL would (named)."""


def unsupported_names(names: Iterable[str]) -> dict[str, list[str]]:
    """Exported names by the reason the plugin refuses them (empty: none)."""
    out: dict[str, list[str]] = {}
    for n in sorted(names):
        if n.startswith(DRAFT_PREFIX):
            out.setdefault("drafter (Eagle3) weights NeMo-RL loads into vLLM's drafter", []).append(n)
        elif KV_SCALE.search(n):
            out.setdefault("FP8 KV-cache scales NeMo-RL post-processes after loading", []).append(n)
        elif MTP.search(n):
            out.setdefault("MTP layers NeMo-RL feeds to vLLM's MTP drafter", []).append(n)
    return out


def refuse_unsupported(names: Iterable[str], worker: Any = None) -> None:
    """Refuse a vLLM worker whose canonical table or model the plugin cannot refit as NeMo-RL does.

    Args:
        names: the exported names NeMo-RL gave the worker (``state_dict_info``).
        worker: the vLLM worker (its drafter, KV-cache dtype and architecture are checked).

    Raises:
        UnsupportedWeights: naming the tensors (at most 5 per reason) or the worker's feature.
    """
    problems = [f"{why}: {len(ns)} tensors {ns[:5]}" for why, ns in unsupported_names(names).items()]
    if worker is not None:
        problems += _worker_features(worker)
    if problems:
        raise UnsupportedWeights(f"nemo_dcr cannot refit these weights as NeMo-RL does ({WHAT}): "
                                 + "; ".join(problems))


def _worker_features(worker: Any) -> list[str]:
    runner = getattr(worker, "model_runner", None)
    out = []
    drafter = getattr(runner, "drafter", None)
    if getattr(drafter, "model", None) is not None:
        out.append(f"vLLM runs a speculative drafter ({type(drafter.model).__name__}) that NeMo-RL refits "
                   "through its own loader path")
    uses_fp8_kv = getattr(worker, "_uses_fp8_kv_cache", None)
    if callable(uses_fp8_kv) and uses_fp8_kv():
        out.append("vLLM's KV cache is FP8: its scales are post-processed after loading")
    arch = getattr(getattr(getattr(runner, "vllm_config", None), "model_config", None), "architectures", None) or []
    if "Gemma3ForConditionalGeneration" in arch:
        out.append("Gemma3ForConditionalGeneration: NeMo-RL renames its vision-tower weights before loading")
    return out
