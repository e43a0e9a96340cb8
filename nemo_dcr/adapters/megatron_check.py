"""Worker run under torchrun: train a few steps, capture + sparse remap vs dense export.

Launched by ``nemo-dcr check-layout`` and by ``tests/distributed``::

    torchrun --nproc-per-node 4 -m nemo_dcr.adapters.megatron_check \
        --model dense-tiny --tp 2 --pp 2 --steps 2 --out result.json

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

from nemo_dcr.adapters import megatron as am
from nemo_dcr.adapters.megatron_memory import AllocationTracker
from nemo_dcr.adapters.megatron_params import capture_ranges, dense_export, local_params, load_hf
from nemo_dcr.adapters.megatron_train import MasterAdamW, pipeline_forward_backward
from nemo_dcr.capture import BaselineStore, capture, int_view


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="dense-tiny", choices=sorted(am.PRESETS))
    p.add_argument("--layers", type=int, default=None, help="override the preset's layers")
    for k in ("tp", "pp", "ep"):
        p.add_argument(f"--{k}", type=int, default=1)
    p.add_argument("--etp", type=int, default=None)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate (real steps)")
    p.add_argument("--update-lr", type=float, default=2e-5, help="Adam-like update size")
    p.add_argument("--train", choices=("auto", "real", "adam-like"), default="auto")
    p.add_argument("--hf-state", default=None, help="torch.save'd HF state dict to load")
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def _remap(plans, params, deltas):
    """Sparse canonical records (name, flat idx, bits) of this rank's deltas."""
    by_name = {lp.name: lp for lp in params}
    records = []
    for d in deltas:
        lp = by_name[d.name]
        res = plans[lp.chunk].remap(d.name, torch.from_numpy(d.positions))
        bits = torch.from_numpy(d.new_bits.view("int16"))
        for piece in res:
            records.append((piece.name, piece.index, bits[piece.selection]))
    return records


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
    am.init_distributed(args.tp, args.pp, args.ep, etp)
    if args.layers:
        preset = am.with_layers(preset, args.layers)
    chunks = am.build_gpt_model(preset, torch.bfloat16)
    if args.hf_state:
        load_hf(chunks, torch.load(args.hf_state, mmap=True), preset)
    from nemo_dcr.layout import build_plan

    layout = am.parallel_layout_from_state()
    plans = [build_plan(preset.family, am.model_dims(preset), layout)]
    params = local_params(chunks, preset)
    skip = {lp.name for lp in params if plans[lp.chunk].lookup(lp.name).duplicate_of}
    ranges = capture_ranges(params, skip)
    store = BaselineStore("device")
    for lp in params:
        store.register(lp.name, lp.param)
    hf = dense_export(chunks, preset)
    real = args.train == "real" or (args.train == "auto" and not preset.num_experts)
    opt = MasterAdamW(params, preset.tied, lr=args.lr)
    gen = torch.Generator().manual_seed(0)
    sizes = {k: getattr(layout, k) for k in ("tp", "pp", "vpp", "ep", "etp", "dp")}
    result = dict(model=args.model, layout=sizes, training="real AdamW" if real
                  else "Adam-like updates of the fp32 masters", steps=[], bad=[])
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
            deltas = capture({lp.name: lp.param for lp in params}, store, ranges, version=step)
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
    dist.all_gather_object(stats, dict(max_alloc_numel=tracker.max_numel, shard_numel=shard_numel))
    if dist.get_rank() == 0:
        total = sum(t.numel() for t in hf.values())
        result.update(
            bit_exact=not result["bad"], tensors=len(hf), elements_checked=total * args.steps,
            model_numel=total, max_alloc_numel=max(s["max_alloc_numel"] for s in stats),
            max_shard_numel=max(s["shard_numel"] for s in stats),
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
