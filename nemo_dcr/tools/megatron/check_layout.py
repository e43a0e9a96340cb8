"""Worker run under torchrun: the refit path on real megatron-core shards vs a dense export.

Launched by ``nemo-dcr check-layout`` and by ``tests/distributed``::

    torchrun --nproc-per-node 4 -m nemo_dcr.tools.megatron.check_layout \\
        --model dense-tiny --tp 2 --pp 2 --steps 2 --out result.json

Every rank builds its chunks (``--vpp`` chunks per rank with virtual pipeline), optionally wraps
them in megatron's ``DistributedDataParallel`` with the distributed optimizer (``--ddp``: capture
ranges then come from the DDP buffers), and runs :class:`nemo_dcr.refit.DeltaRefit` built by
``DeltaRefit.from_config`` from the model itself, into an engine hosted by rank 0 that starts
empty: the first sync is a full resync through the path, every step a delta refit.  After each
refit the engine's tensors are compared bitwise (integer views) with an independent dense export
(gather + whole-tensor conversion, :mod:`.convert`).  Rank 0 writes the JSON result.

MoE and MLA presets and virtual pipeline drive the fp32 masters with Adam-like updates (the CPU
pipeline driver runs one chunk per stage and megatron's local MoE/MLA forward does not run on CPU
at these layouts); dense models without virtual pipeline train with real AdamW steps.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from nemo_dcr.apply import TensorEngine
from nemo_dcr.checkpoint import atomic_write, load_checkpoint
from nemo_dcr.config.schema import DcrConfig
from nemo_dcr.layout import MODELS, model_dims
from nemo_dcr.refit import DeltaRefit
from nemo_dcr.telemetry import TOTAL
from nemo_dcr.types import int_view

from . import build as am
from .dense import dense_export, load_hf
from .memory import AllocationTracker
from nemo_dcr.integrations.megatron.params import local_params
from nemo_dcr.integrations.megatron.source import check_chunks, source_from_model
from .train import MasterAdamW, pipeline_forward_backward


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="dense-tiny", choices=sorted(MODELS))
    p.add_argument("--layers", type=int, default=None, help="override the model's layers")
    for k in ("tp", "pp", "ep", "vpp"):
        p.add_argument(f"--{k}", type=int, default=1)
    p.add_argument("--etp", type=int, default=None)
    p.add_argument("--first-stage-layers", type=int, default=None, help="uneven pipeline: layers on the first stage")
    p.add_argument("--last-stage-layers", type=int, default=None, help="uneven pipeline: layers on the last stage")
    p.add_argument("--ddp", action="store_true", help="wrap chunks in megatron DDP with the distributed optimizer")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate (real steps)")
    p.add_argument("--update-lr", type=float, default=2e-5, help="Adam-like update size")
    p.add_argument("--train", choices=("auto", "real", "adam-like"), default="auto")
    p.add_argument("--encoding", default="dcr", choices=("dcr", "reference", "raw"))
    p.add_argument("--checkpoint", default=None, help="HF weights (safetensors) to load")
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def _compare(engine: TensorEngine | None, ref: dict | None) -> list[str]:
    if engine is None:
        return []
    live = engine.tensors
    bad = [n for n in ref if n not in live or not torch.equal(int_view(live[n]), int_view(ref[n]))]
    return bad + [n for n in live if n not in ref]


def _empty_engine(source, cfg: DcrConfig) -> TensorEngine:
    from nemo_dcr.types import DTYPES

    return TensorEngine({n: torch.zeros(s, dtype=DTYPES[d].torch_dtype) for n, (d, s) in source.canonical.items()},
                        keep_index=cfg.engine_index)


def _train(args, dims, chunks, real: bool, opt, gen, step: int) -> None:
    if real:
        tokens = torch.randint(0, dims.vocab_size, (1, args.tokens + 1), generator=gen)
        pipeline_forward_backward(chunks[0], tokens[:, :-1], tokens[:, 1:], dims.hidden_size, torch.bfloat16)
        opt.step()
    else:
        opt.adam_like_update(step, lr=args.update_lr)


def run(args) -> dict:
    dims = model_dims(args.model, args.layers)
    etp = args.etp or (args.tp if dims.num_experts else 1)  # dense models: expert-TP 1
    am.init_distributed(args.tp, args.pp, args.ep, etp, vpp=args.vpp)
    uneven = dict(num_layers_in_first_pipeline_stage=args.first_stage_layers, num_layers_in_last_pipeline_stage=args.last_stage_layers)
    chunks = am.build_gpt_model(dims, torch.bfloat16, vpp=args.vpp, **uneven)
    if args.checkpoint:
        load_hf(chunks, load_checkpoint(args.checkpoint), dims)
    if args.ddp:
        chunks = am.wrap_ddp(chunks)
    source = source_from_model(chunks, vocab_size=dims.vocab_size, **uneven)
    stage_layers = check_chunks(chunks, source.plans, dims)
    cfg = DcrConfig(encoding=args.encoding, verify="full")
    engine = _empty_engine(source, cfg) if dist.get_rank() == 0 else None
    refit = DeltaRefit.from_config(cfg, source, engine=engine, engine_rank=0)
    trainable = not dims.num_experts and len(chunks) == 1 and not args.ddp
    if args.train == "real" and not trainable:
        raise SystemExit("--train real: needs a dense model, vpp == 1 and no --ddp on CPU")
    real = args.train == "real" or (args.train == "auto" and trainable)
    opt = MasterAdamW(local_params(chunks, dims), dims.tie_word_embeddings, lr=args.lr)
    layout = source.layout
    sizes = {k: getattr(layout, k) for k in ("tp", "pp", "vpp", "ep", "etp", "dp")}
    sizes.update({k: v for k, v in uneven.items() if v is not None})
    result = dict(model=args.model, layout=sizes, layers=dims.num_layers, chunks_per_rank=len(chunks),
                  ddp=args.ddp, training="real AdamW" if real else "Adam-like updates of the fp32 masters",
                  updates="adamw" if real else "adam_like", encoding=args.encoding,
                  forward="pipeline forward/backward" if real else "none (not needed for the layout check)",
                  steps=[], bad=[])
    attach = refit.attach()
    result["bad"] = _compare(engine, dense_export(chunks, dims))
    result["attach"] = dict(resynced=attach.resynced, payload_bytes=attach.payload_bytes)
    tracker, gen = AllocationTracker(), torch.Generator().manual_seed(0)
    for step in range(1, args.steps + 1):
        _train(args, dims, chunks, real, opt, gen, step)
        with tracker:
            report = refit.step()
        bad = _compare(engine, dense_export(chunks, dims))
        result["bad"] = sorted(set(result["bad"]) | set(bad))
        result["steps"].append(dict(step=step, changed=report.changed, density=report.density, mode=report.mode,
                                    committed=report.committed, payload_bytes=report.payload_bytes,
                                    seconds=report.times[TOTAL]))
    refit.close()
    stats = [None] * dist.get_world_size()
    shard = sum(p.numel() * p.element_size() for p in source.params.values())
    dist.all_gather_object(stats, dict(torch_bytes=tracker.max_bytes, shard_bytes=shard,
                                       pp_rank=layout.pp_rank, chunk_layers=stage_layers))
    numel = {n: int(torch.tensor(s).prod()) for n, (_, s) in source.canonical.items()}
    width = next(iter(source.params.values())).element_size()
    result.update(bit_exact=not result["bad"], tensors=len(numel), elements_checked=sum(numel.values()) * args.steps,
                  model_bytes=sum(numel.values()) * width, max_tensor_bytes=max(numel.values()) * width,
                  max_torch_alloc_bytes=max(s["torch_bytes"] for s in stats),
                  max_shard_bytes=max(s["shard_bytes"] for s in stats),
                  stage_chunk_layers={str(s["pp_rank"]): s["chunk_layers"] for s in stats})
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    result = run(args)
    if dist.get_rank() == 0:
        text = json.dumps(result, indent=1)
        atomic_write({Path(args.out): lambda f: f.write(text.encode())})
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
