"""Worker run under torchrun: train a few steps, capture + sparse remap vs dense export.

Launched by ``nemo-dcr check-layout`` and by ``tests/distributed``::

    torchrun --nproc-per-node 4 -m nemo_dcr.integrations.megatron.check \
        --model dense-tiny --tp 2 --pp 2 --steps 2 --out result.json
    torchrun --nproc-per-node 4 -m nemo_dcr.integrations.megatron.check \
        --model dense-tiny --tp 2 --pp 2 --vpp 2 --out result.json

With virtual pipeline (``--vpp > 1``) every rank builds its ``vpp`` model chunks, loads all of
them, captures every chunk and remaps each with its own plan (``build_chunk_plans``).  The
CPU pipeline driver runs one chunk per stage, so the fp32 masters of all chunks are driven by
Adam-like updates (``updates: "adam_like"``): the layout check needs changed bits in every
chunk, not a forward pass.

Every rank captures its own slice of its own shard, remaps the changed elements with the
layout plan (no gather), and sends only the sparse canonical records to rank 0, which applies
them to an HF copy and compares it bitwise (int16 views) with a dense export.  Rank 0 writes
the JSON result.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.distributed as dist

from nemo_dcr.integrations.megatron import build as am
from nemo_dcr.integrations.megatron.memory import AllocationTracker
from nemo_dcr.integrations.megatron.params import capture_ranges, dense_export, load_hf, local_params
from nemo_dcr.integrations.megatron.train import MasterAdamW, pipeline_forward_backward
from nemo_dcr.capture import BaselineStore, capture
from nemo_dcr.types import int_view


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="dense-tiny", choices=sorted(am.PRESETS))
    p.add_argument("--layers", type=int, default=None, help="override the preset's layers")
    for k in ("tp", "pp", "ep", "vpp"):
        p.add_argument(f"--{k}", type=int, default=1)
    p.add_argument("--etp", type=int, default=None)
    p.add_argument("--first-stage-layers", type=int, default=None,
                   help="uneven pipeline: layers on the first stage")
    p.add_argument("--last-stage-layers", type=int, default=None,
                   help="uneven pipeline: layers on the last stage")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate (real steps)")
    p.add_argument("--update-lr", type=float, default=2e-5, help="Adam-like update size")
    p.add_argument("--train", choices=("auto", "real", "adam-like"), default="auto")
    p.add_argument("--hf-state", default=None, help="torch.save'd HF state dict to load")
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def _remap(plans, params, deltas):
    """Sparse canonical records (name, flat idx, bits) of this rank's deltas.

    Deltas are keyed by :attr:`LocalParam.key`; each is remapped by its chunk's plan.
    """
    by_name = {lp.key: lp for lp in params}
    records = []
    for d in deltas:
        lp = by_name[d.name]
        res = plans[lp.chunk].remap(lp.name, torch.from_numpy(d.positions))
        bits = torch.from_numpy(d.new_bits.view("int16"))
        for piece in res:
            records.append((piece.name, piece.index, bits[piece.selection]))
    return records


def _check_chunks(chunks, plans, preset) -> list[list[int]]:
    """Global layers of each chunk; raise unless megatron built what the plans expect.

    Compares, chunk by chunk, the parameter names megatron built with the plan's names, and
    the global layer numbers (``layer_number - 1``) with ``chunk_layers``' offsets.
    """
    from nemo_dcr.layout import chunk_layers

    out = []
    for c, (model, plan) in enumerate(zip(chunks, plans)):
        built = {n for n, _ in model.named_parameters()}
        if built != set(plan.params):
            raise RuntimeError(
                f"chunk {c}: megatron params not in the plan {sorted(built - set(plan.params))}, "
                f"plan params not built {sorted(set(plan.params) - built)}")
        layers = [layer.layer_number - 1 for layer in model.decoder.layers]
        offset, count = chunk_layers(preset.layers, plan.layout, c)
        if layers != list(range(offset, offset + count)):
            raise RuntimeError(f"chunk {c}: megatron built layers {layers}, the plan expects "
                               f"{list(range(offset, offset + count))}")
        out.append(layers)
    return out


def _apply(hf: dict, records_per_rank) -> int:
    n = 0
    for records in records_per_rank:
        for name, idx, bits in records:
            int_view(hf[name])[idx] = bits
            n += int(idx.numel())
    return n


def _compare(hf: dict, ref: dict) -> list[str]:
    bad = [k for k in ref if k not in hf or not torch.equal(int_view(hf[k]), int_view(ref[k]))]
    return bad + [k for k in hf if k not in ref]


def run(args) -> dict:
    preset = am.PRESETS[args.model]
    # megatron defaults expert-TP to TP; a dense model has no experts, so pin it to 1
    etp = args.etp or (args.tp if preset.num_experts else 1)
    am.init_distributed(args.tp, args.pp, args.ep, etp, vpp=args.vpp)
    if args.layers:
        preset = am.with_layers(preset, args.layers)
    uneven = dict(first_stage_layers=args.first_stage_layers,
                  last_stage_layers=args.last_stage_layers)
    chunks = am.build_gpt_model(preset, torch.bfloat16, vpp=args.vpp, **uneven)
    if args.hf_state:
        load_hf(chunks, torch.load(args.hf_state, mmap=True), preset)
    from nemo_dcr.layout import build_chunk_plans

    layout = am.parallel_layout_from_state(**uneven)
    plans = build_chunk_plans(preset.family, am.model_dims(preset), layout)
    if len(plans) != len(chunks):
        raise RuntimeError(f"{len(chunks)} model chunks but {len(plans)} layout plans")
    chunk_layers = _check_chunks(chunks, plans, preset)
    params = local_params(chunks, preset)
    skip = {lp.key for lp in params if plans[lp.chunk].lookup(lp.name).duplicate_of}
    ranges = capture_ranges(params, skip)
    store = BaselineStore("device")
    for lp in params:
        store.register(lp.key, lp.param)
    hf = dense_export(chunks, preset)
    # the CPU pipeline driver runs one chunk per stage: no training forward with vpp > 1
    trainable = not preset.num_experts and len(chunks) == 1
    if args.train == "real" and not trainable:
        raise SystemExit("--train real: needs a dense model and vpp == 1 on CPU")
    real = args.train == "real" or (args.train == "auto" and trainable)
    opt = MasterAdamW(params, preset.tied, lr=args.lr)
    gen = torch.Generator().manual_seed(0)
    sizes = {k: getattr(layout, k) for k in ("tp", "pp", "vpp", "ep", "etp", "dp")}
    for k in ("first_stage_layers", "last_stage_layers"):
        if uneven[k] is not None:
            sizes[k] = uneven[k]
    result = dict(model=args.model, layout=sizes, layers=preset.layers,
                  chunks_per_rank=len(chunks),
                  training="real AdamW" if real else "Adam-like updates of the fp32 masters",
                  updates="adamw" if real else "adam_like",
                  forward="pipeline forward/backward" if real else
                  "none (not needed for the layout check)", steps=[], bad=[])
    tracker = AllocationTracker()
    shard_numel = sum(lp.param.numel() for lp in params)
    for step in range(1, args.steps + 1):
        if real:
            tokens = torch.randint(0, preset.vocab, (1, args.tokens + 1), generator=gen)
            pipeline_forward_backward(chunks[0], tokens[:, :-1], tokens[:, 1:], preset.hidden,
                                      torch.bfloat16)
            opt.step()
        else:
            opt.adam_like_update(step, lr=args.update_lr)
        t0 = time.perf_counter()
        with tracker:
            deltas = capture({lp.key: lp.param for lp in params}, store, ranges, version=step)
            records = _remap(plans, params, deltas)
        elapsed = time.perf_counter() - t0
        gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(records, gathered, dst=0)
        ref = dense_export(chunks, preset)
        store.commit(step)
        if dist.get_rank() == 0:
            applied = _apply(hf, gathered)
            bad = _compare(hf, ref)
            result["bad"] = sorted(set(result["bad"]) | set(bad))
            result["steps"].append(dict(step=step, changed=applied, capture_remap_s=elapsed,
                                        density=applied / sum(t.numel() for t in ref.values())))
    stats = [None] * dist.get_world_size()
    dist.all_gather_object(stats, dict(max_alloc_numel=tracker.max_numel, shard_numel=shard_numel,
                                       pp_rank=layout.pp_rank, chunk_layers=chunk_layers))
    if dist.get_rank() == 0:
        total = sum(t.numel() for t in hf.values())
        result.update(
            bit_exact=not result["bad"], tensors=len(hf), elements_checked=total * args.steps,
            model_numel=total, max_alloc_numel=max(s["max_alloc_numel"] for s in stats),
            max_shard_numel=max(s["shard_numel"] for s in stats),
            stage_chunk_layers={str(s["pp_rank"]): s["chunk_layers"] for s in stats},
        )
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    result = run(args)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
