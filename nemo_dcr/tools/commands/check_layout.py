"""``nemo-dcr check-layout``: preflight a parallel layout before a big job.

Launches its own gloo processes on CPU (``torchrun`` running
:mod:`nemo_dcr.tools.megatron.check_layout`), builds the megatron-core model at the requested
layout, and runs the refit path (``DeltaRefit``: a full first sync into an empty engine, then a
delta refit after each of a few optimizer steps: real AdamW where megatron-core can train on
CPU, Adam-like updates of the fp32 masters for MoE/MLA and for virtual pipeline); after every
refit the engine is compared bitwise with an independent dense export, tensor by tensor.

Impossible layouts are rejected before anything is launched.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile

from .launch import EXIT_TIMEOUT, JobTimeoutError, check_timeout, run_job

MODELS = {"smollm2": "smollm2", "qwen3-moe-tiny": "qwen3-moe-tiny",
          "deepseek-tiny": "deepseek-tiny", "dense-tiny": "dense-tiny"}


def register(subparsers) -> None:
    """Add the ``check-layout`` subcommand."""
    p = subparsers.add_parser("check-layout", help=__doc__.splitlines()[0],
                              description=__doc__)
    p.add_argument("--model", required=True, choices=sorted(MODELS))
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline parallel size")
    p.add_argument("--ep", type=int, default=1, help="expert parallel size")
    p.add_argument("--etp", type=int, default=None, help="expert tensor parallel (default: tp)")
    p.add_argument("--vpp", type=int, default=1, help="virtual pipeline chunks per stage")
    p.add_argument("--first-stage-layers", type=int, default=None,
                   help="uneven pipeline: layers on the first stage")
    p.add_argument("--last-stage-layers", type=int, default=None,
                   help="uneven pipeline: layers on the last stage")
    p.add_argument("--dp", type=int, default=1, help="data parallel size")
    p.add_argument("--ddp", action="store_true",
                   help="wrap the model in megatron DDP with the distributed optimizer (capture its slices)")
    p.add_argument("--steps", type=int, default=2, help="optimizer steps to check")
    p.add_argument("--layers", type=int, default=None, help="override the model's layers")
    p.add_argument("--timeout", type=float, default=900,
                   help=f"seconds before the job (torchrun and every rank) is stopped; exit {EXIT_TIMEOUT}")
    p.add_argument("--json", action="store_true", help="print the JSON report")
    p.set_defaults(func=run)


def _validate(args) -> int:
    """World size after checking the layout against the model; raises LayoutError."""
    from nemo_dcr.layout import LayoutError, ParallelLayout, model_dims

    if args.steps < 1:
        raise LayoutError(f"--steps={args.steps}: at least one optimizer step is checked")
    dims = model_dims(MODELS[args.model], args.layers)
    etp = args.etp if args.etp is not None else (args.tp if dims.num_experts else 1)
    first, last = args.first_stage_layers, args.last_stage_layers
    if (first is not None or last is not None) and args.pp < 2:
        raise LayoutError("--first/--last-stage-layers need pp > 1")
    for flag, n in (("--first-stage-layers", first), ("--last-stage-layers", last)):
        if n is not None and n <= 0:
            raise LayoutError(f"{flag}={n} must be > 0 (megatron-core)")
        if n is not None and n % args.vpp:
            raise LayoutError(f"{flag}={n} not divisible by vpp={args.vpp} (megatron-core)")
    if args.vpp > 1 and args.pp == 2 and first is not None and last is not None:
        raise LayoutError(
            "uneven first and last stage with pp=2 and vpp>1: megatron-core 0.16.1's "
            "get_transformer_layer_offset divides by zero middle stages; set only one of them")
    lay = ParallelLayout(tp=args.tp, pp=args.pp, vpp=args.vpp, ep=args.ep, etp=etp, dp=args.dp,
                         num_layers_in_first_pipeline_stage=first,
                         num_layers_in_last_pipeline_stage=last)
    lay.validate(dims=dims)
    return lay.world_size


def run(args: argparse.Namespace) -> int:
    """Validate, launch, report.  Exit code 0 when bit-exact, 1 otherwise, 2 bad layout, 124 timeout."""
    from nemo_dcr.layout import LayoutError

    check_timeout(args.timeout)
    try:
        world = _validate(args)
    except LayoutError as e:
        print(f"check-layout: impossible layout: {e}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = _command(args, world, out)
        if args.model == "smollm2":
            from nemo_dcr.integrations.hf.model import save_embedded_checkpoint

            save_embedded_checkpoint(os.path.join(tmp, "model.safetensors"))
            cmd += ["--checkpoint", os.path.join(tmp, "model.safetensors")]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        try:
            proc = run_job(cmd, env, args.timeout, capture=True)
        except JobTimeoutError as exc:
            print(f"check-layout: {exc}", file=sys.stderr)
            return EXIT_TIMEOUT
        if proc.returncode != 0 or not os.path.exists(out):
            print(f"check-layout: workers failed (rc={proc.returncode}):\n"
                  f"{proc.stderr[-3000:]}", file=sys.stderr)
            return 1
        with open(out) as f:
            result = json.load(f)
    report = dict(bit_exact=result["bit_exact"], tensors=result["tensors"],
                  elements_checked=result["elements_checked"], layout=result["layout"],
                  non_bit_exact=result["bad"], training=result["training"],
                  updates=result["updates"], forward=result["forward"],
                  stage_chunk_layers=result["stage_chunk_layers"], steps=result["steps"],
                  attach=result["attach"], ddp=result["ddp"])
    print(json.dumps(report, indent=1) if args.json else _text(args.model, report))
    return 0 if report["bit_exact"] else 1


def _command(args, world: int, out: str) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
           "--master-port", str(_free_port()), "-m", "nemo_dcr.tools.megatron.check_layout",
           "--model", MODELS[args.model], "--tp", str(args.tp), "--pp", str(args.pp),
           "--ep", str(args.ep), "--vpp", str(args.vpp), "--steps", str(args.steps),
           "--out", out]
    for flag, n in (("--first-stage-layers", args.first_stage_layers),
                    ("--last-stage-layers", args.last_stage_layers)):
        if n is not None:
            cmd += [flag, str(n)]
    if args.etp is not None:
        cmd += ["--etp", str(args.etp)]
    if args.layers is not None:
        cmd += ["--layers", str(args.layers)]
    if args.ddp:
        cmd += ["--ddp"]
    return cmd


def _text(model: str, r: dict) -> str:
    verdict = "BIT-EXACT" if r["bit_exact"] else "NOT BIT-EXACT"
    lines = [f"{model} {r['layout']}: {verdict} ({r['tensors']} tensors, "
             f"{r['elements_checked']} elements checked, {r['training']})"]
    lines += [f"  not bit-exact: {name}" for name in r["non_bit_exact"]]
    return "\n".join(lines)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
