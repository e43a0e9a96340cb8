"""Named layouts: a sensible job for each model the planner knows, printed by name with every plan.

Each preset is a whole :class:`PlanSetup` (trainer and engine layouts, machines, links).  The
large ones are GPU jobs on 8-GPU H200 nodes; ``smollm2`` is the main job of this repository
(``scripts/main.sh``: megatron-core TP=3/PP=2 on 6 CPU ranks, a transformers engine hosted by
trainer rank 0, gloo over the host's loopback).
"""

from __future__ import annotations

import os
from dataclasses import replace

from nemo_dcr.layout import LayoutError, ParallelLayout

from .inputs import EngineDeployment, Hardware, Links, PlanSetup

H200_NODE = Hardware()
CPU_HOST = Hardware(gpus_per_node=64, host_cores_per_node=os.cpu_count() or 1, codec_device="cpu", gpus=False,
                    name="this CPU host (all ranks on one machine, host cores shared)")
LOOPBACK = Links(nvlink_gbps=8.0, nvlink_latency_s=1e-3, ib_gbps=8.0, ib_latency_s=1e-3, intra_node_name="loopback")
"""gloo over the host loopback between processes of one machine: 1 GB/s and 1 ms per exchange
(ASSUMPTION, not measured; the main job's payloads are under 1 MB, so latency dominates)."""

PRESETS: dict[str, PlanSetup] = {
    "kimi-k2-1024": PlanSetup(
        ParallelLayout(tp=8, pp=8, ep=32, etp=1, dp=16, num_layers_in_first_pipeline_stage=7,
                       num_layers_in_last_pipeline_stage=6),
        EngineDeployment(tp=8, dp=8, ep=64, replicas=4), preset="kimi-k2-1024"),
    "deepseek-v3-256": PlanSetup(
        ParallelLayout(tp=8, pp=4, ep=32, etp=1, dp=8, num_layers_in_first_pipeline_stage=16,
                       num_layers_in_last_pipeline_stage=13),
        EngineDeployment(tp=8, dp=4, ep=32, replicas=2), preset="deepseek-v3-256"),
    "qwen3-235b-128": PlanSetup(
        ParallelLayout(tp=4, pp=2, ep=16, etp=1, dp=16), EngineDeployment(tp=4, dp=4, ep=16, replicas=4),
        preset="qwen3-235b-128"),
    "llama3-70b-64": PlanSetup(
        ParallelLayout(tp=8, pp=2, dp=4), EngineDeployment(tp=8, replicas=8), preset="llama3-70b-64"),
    "smollm2-main-job": PlanSetup(
        ParallelLayout(tp=3, pp=2), EngineDeployment(), links=LOOPBACK, hardware=CPU_HOST, placement="colocated",
        preset="smollm2-main-job"),
    "tiny-cpu": PlanSetup(ParallelLayout(), EngineDeployment(), links=LOOPBACK, hardware=CPU_HOST,
                          placement="colocated", preset="tiny-cpu"),
    "generic-gpu": PlanSetup(ParallelLayout(), EngineDeployment(), preset="generic-gpu"),
}
"""Preset name -> setup."""

DEFAULT_PRESET = {"kimi-k2": "kimi-k2-1024", "deepseek-v3": "deepseek-v3-256", "qwen3-235b-a22b": "qwen3-235b-128",
                  "llama3-70b": "llama3-70b-64", "smollm2": "smollm2-main-job", "dense-tiny": "tiny-cpu",
                  "qwen3-moe-tiny": "tiny-cpu", "deepseek-tiny": "tiny-cpu"}
"""Model -> its default preset (others, e.g. a config.json: ``generic-gpu``, to be sized by flags)."""

PRESET_NOTES = {
    "kimi-k2-1024": "trainer 128 nodes x 8 H200 (1024 GPUs): TP8, PP8 with 7 layers on the first and 6 on the "
                    "last stage, EP32, ETP1, DP16 (expert-DP 4); engine 4 replicas of 64 GPUs "
                    "(vLLM TP8 x DP8 attention, EP64: 6 experts per GPU), 32 nodes",
    "deepseek-v3-256": "trainer 32 nodes (256 GPUs): TP8, PP4 (16/16/16/13 layers), EP32, DP8; engine 2 "
                       "replicas of 32 GPUs (TP8 x DP4, EP32)",
    "qwen3-235b-128": "trainer 16 nodes (128 GPUs): TP4, PP2, EP16, DP16; engine 4 replicas of 16 GPUs "
                      "(TP4 x DP4, EP16)",
    "llama3-70b-64": "trainer 8 nodes (64 GPUs): TP8, PP2, DP4; engine 8 replicas of TP8",
    "smollm2-main-job": "the main job (scripts/main.sh): megatron-core TP3/PP2 on 6 CPU ranks, one engine rank "
                        "(vLLM in a process of its own, or transformers in trainer rank 0), gloo over "
                        "loopback, all on this host's cores",
    "tiny-cpu": "one CPU rank each side",
    "generic-gpu": "one H200 rank each side in one cluster; size it with --tp/--pp/--ep/--dp/--engine-*",
}


def preset_for(model: str, name: str | None = None) -> PlanSetup:
    """The named preset, or the model's default one.

    Raises:
        LayoutError: unknown preset name (lists the known ones).
    """
    key = name or DEFAULT_PRESET.get(model, "generic-gpu")
    if key not in PRESETS:
        raise LayoutError(f"unknown preset {key!r}; known: {', '.join(sorted(PRESETS))}")
    return PRESETS[key]


def with_overrides(setup: PlanSetup, trainer: dict, engine: dict, links: dict, hardware: dict,
                   placement: str | None) -> PlanSetup:
    """The preset with the given fields replaced (changed layouts or machines are named
    ``<preset>+custom``; links and placement are printed with every plan)."""
    new = replace(setup, trainer=replace(setup.trainer, **trainer), engine=replace(setup.engine, **engine),
                  links=replace(setup.links, **links), hardware=replace(setup.hardware, **hardware))
    if links.get("cross_cluster_gbps") and placement is None:
        placement = "cross-cluster"
    if placement is not None:
        new = replace(new, placement=placement)
    if (new.trainer, new.engine, new.hardware) != (setup.trainer, setup.engine, setup.hardware):
        new = replace(new, preset=f"{setup.preset}+custom")
    return new
