"""``nemo-dcr plan``: what a delta refit will cost per rank, from a config, before the GPUs exist.

Examples::

    nemo-dcr plan --model kimi-k2 --density 0.03 --cross-cluster-gbps 5 --json
    nemo-dcr plan --model path/to/config.json --tp 8 --pp 4 --ep 16 --dp 8 --engine-tp 8 --png plan.png
    nemo-dcr plan --calibrate [--calibrate-run RUN]   # measure this machine's CPU kernel figures
    nemo-dcr plan --validate runs/demo                # predicted vs measured for the main job

Every rank's work comes from the layout tables the remap uses (docs/plan.md); figures are the
calibration (CPU), named assumptions (GPU) and measured codec points (bytes per change).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

LAYOUT_FLAGS = {"tp": ("trainer", "tp"), "pp": ("trainer", "pp"), "vpp": ("trainer", "vpp"), "ep": ("trainer", "ep"),
                "etp": ("trainer", "etp"), "dp": ("trainer", "dp"),
                "first_stage_layers": ("trainer", "num_layers_in_first_pipeline_stage"),
                "last_stage_layers": ("trainer", "num_layers_in_last_pipeline_stage"),
                "engine_tp": ("engine", "tp"), "engine_ep": ("engine", "ep"), "engine_dp": ("engine", "dp"),
                "engine_replicas": ("engine", "replicas"), "nvlink_gbps": ("links", "nvlink_gbps"),
                "ib_gbps": ("links", "ib_gbps"), "cross_cluster_gbps": ("links", "cross_cluster_gbps"),
                "object_store_gbps": ("links", "object_store_gbps"), "gpus_per_node": ("hardware", "gpus_per_node"),
                "host_cores": ("hardware", "host_cores_per_node"), "codec_device": ("hardware", "codec_device")}
"""Flag (argparse dest) -> (part of the setup, field it sets): the trainer's are
:class:`~nemo_dcr.layout.ParallelLayout` fields, the engine's
:class:`~nemo_dcr.tools.planner.inputs.EngineDeployment` fields."""


def register(subparsers) -> None:
    """Add the ``plan`` parser."""
    p = subparsers.add_parser("plan", help="per-rank cost of a refit from a model config and layouts",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="kimi-k2", help="kimi-k2, deepseek-v3, qwen3-235b-a22b, llama3-70b, "
                   "smollm2, ... or a Hugging Face config.json path")
    p.add_argument("--preset", default=None, help="named layout (default: the model's; see docs/plan.md)")
    for flag in ("tp", "pp", "vpp", "ep", "etp", "dp", "first-stage-layers", "last-stage-layers", "engine-tp",
                 "engine-ep", "engine-dp", "engine-replicas", "gpus-per-node", "host-cores"):
        p.add_argument(f"--{flag}", type=int, default=None)
    for flag in ("nvlink-gbps", "ib-gbps", "cross-cluster-gbps", "object-store-gbps"):
        p.add_argument(f"--{flag}", type=float, default=None, help="Gbit/s (NVLink per GPU, others per node; "
                       "object store aggregate)")
    p.add_argument("--codec-device", choices=("cpu", "gpu"), default=None)
    p.add_argument("--placement", choices=("colocated", "cluster", "cross-cluster"), default=None)
    p.add_argument("--fanout", choices=("direct", "relay"), default=None,
                   help="engine replicas fed by the owners each (direct) or by a relay root per view (relay)")
    p.add_argument("--density", type=float, default=None, help="changed fraction, every layer type")
    p.add_argument("--densities", default=None, help="`nemo-dcr diff --json` output or a run's telemetry")
    p.add_argument("--cpu-figures", default=None, help="calibration JSON (default: the committed one)")
    p.add_argument("--gpu-figures", default=None, help="measured GPU kernel figures (default: named assumptions)")
    p.add_argument("--codec-points", default=None, help="codec points JSON (default: the committed table)")
    p.add_argument("--target-seconds", type=float, default=20.0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--png", default=None, help="write the per-rank timeline here")
    p.add_argument("--rows", type=int, default=6, help="busiest ranks shown per side in the table")
    p.add_argument("--calibrate", action="store_true", help="measure CPU kernel figures and write them")
    p.add_argument("--calibrate-run", default=None, help="make-deltas run folder for the calibration data")
    p.add_argument("--calibrate-out", default=None, help="where to write them (default: the committed file)")
    p.add_argument("--validate", default=None, metavar="RUN_DIR", help="compare with a run's summary.json")
    p.set_defaults(func=run)


def _figures(args):
    from nemo_dcr.tools.planner.figures import default_figures

    return default_figures(args.density, args.densities, args.cpu_figures, args.gpu_figures, args.codec_points)


def _model(spec: str):
    from nemo_dcr.layout import dims_from_hf_config, model_dims, unmodelled_fields
    from nemo_dcr.tools.planner.figures import read_json

    if spec.endswith(".json") or Path(spec).is_file():
        cfg = read_json(spec, "model config")
        extra = unmodelled_fields(cfg)
        notes = [f"not modelled (no layout table, not served): {extra}"] if extra else []
        return Path(spec).parent.name or Path(spec).stem, dims_from_hf_config(cfg), notes
    from nemo_dcr.layout import HF_CONFIGS

    extra = unmodelled_fields(HF_CONFIGS.get(spec, {}))
    return spec, model_dims(spec), [f"not modelled (not served, no layout table): {extra}"] if extra else []


def _setup(args, model: str):
    from dataclasses import replace

    from nemo_dcr.tools.planner.presets import preset_for, with_overrides

    groups: dict[str, dict] = {"trainer": {}, "engine": {}, "links": {}, "hardware": {}}
    for flag, (group, name) in LAYOUT_FLAGS.items():
        value = getattr(args, flag)
        if value is not None:
            groups[group][name] = value
    base = preset_for(model, args.preset)
    setup = with_overrides(base, groups["trainer"], groups["engine"], groups["links"], groups["hardware"],
                           args.placement)
    return setup if args.fanout is None else replace(setup, fanout=args.fanout)


def run(args: argparse.Namespace) -> int:
    """Calibrate, validate, or plan and print."""
    from nemo_dcr.tools.planner import calibrate, render, validate
    from nemo_dcr.tools.planner.estimate import make_plan, what_it_takes

    if args.calibrate:
        doc = calibrate.calibrate(args.calibrate_run)
        path = calibrate.write(doc, args.calibrate_out or calibrate.CPU_FIGURES)
        print(json.dumps(doc, indent=1))
        print(f"wrote {path}")
        return 0
    fig = _figures(args)
    if args.validate:
        result = validate.validate(args.validate, fig)
        print(json.dumps(result, indent=1))
        return 0 if result["ok"] else 1
    model, dims, notes = _model(args.model)
    setup = _setup(args, model)
    plan = make_plan(model, dims, setup, fig, notes=notes)
    takes = {"what_it_takes": what_it_takes(plan, args.target_seconds)}
    if args.png:
        takes["timeline_png"] = str(render.timeline_png(plan, args.png))
    if args.json:
        print(json.dumps(render.to_json(plan, takes), indent=1))
    else:
        print(render.table(plan, args.rows, takes))
    return 0
