"""Capture and layout-remap throughput per parallel layout, on one rank's shard.

For each layout the shard of one rank (coordinates 0) is built from the layout plan's local
shapes as random bf16 tensors, a fraction ``--density`` of the elements is changed, and

* capture throughput: MB of shard scanned per second (integer-view compare vs baseline),
* remap throughput: million changed elements per second, by the layout plan's transforms (pure
  index math in torch ops) and by the megatron source's path, the captured slice's runs
  (:class:`~nemo_dcr.integrations.megatron.source.RunTable`: one compiled merge walk per delta,
  the transforms only for a delta it declines), with the ratio of the two from the same run and
  the seconds the tables took to build (once per param, at the first refit),
* memory: largest tensor any op allocated during capture + remap, and peak-RSS growth,
  both relative to the shard's size,

are printed.  Runs on CPU (one process; the per-rank work is identical on every rank).

    python benchmarks/remap.py [--density 0.02] [--repeat 3]
"""

from __future__ import annotations

import argparse
import resource
import time

import torch

from nemo_dcr.capture import BaselineStore, capture
from nemo_dcr.integrations.megatron.source import RunTable, _row_runs
from nemo_dcr.tools.megatron.memory import AllocationTracker
from nemo_dcr.layout import ModelDims, ParallelLayout, build_plan

SMOLLM2 = ModelDims(num_layers=30, hidden_size=576, num_attention_heads=9, vocab_size=49152,
                    num_query_groups=3, ffn_hidden_size=1536, tie_word_embeddings=True)
QWEN3_MOE = ModelDims(num_layers=8, hidden_size=1024, num_attention_heads=16, vocab_size=32000,
                      num_query_groups=4, head_dim=64, ffn_hidden_size=2048, qk_layernorm=True,
                      num_experts=32, moe_ffn_hidden_size=512)
DEEPSEEK = ModelDims(num_layers=8, hidden_size=1024, num_attention_heads=16, vocab_size=32000,
                     ffn_hidden_size=2048, num_experts=32, moe_ffn_hidden_size=512,
                     shared_expert_ffn_hidden_size=1024, first_dense_layers=1,
                     multi_latent_attention=True, q_lora_rank=384, kv_lora_rank=256,
                     qk_head_dim=64, qk_pos_emb_head_dim=32, v_head_dim=64)

LAYOUTS = [
    ("smollm2", "llama", SMOLLM2, ParallelLayout()),
    ("smollm2", "llama", SMOLLM2, ParallelLayout(tp=3, pp=2)),
    ("qwen3-moe", "qwen3_moe", QWEN3_MOE, ParallelLayout(tp=2, pp=2, ep=2, etp=1, dp=2)),
    ("qwen3-moe", "qwen3_moe", QWEN3_MOE, ParallelLayout(tp=2, pp=2, ep=2, etp=2, dp=2)),
    ("deepseek-mla", "deepseek_v3", DEEPSEEK, ParallelLayout(tp=2, pp=2, ep=4, etp=1, dp=2)),
]


def _rss_peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def bench(family: str, dims: ModelDims, layout: ParallelLayout, density: float,
          repeat: int) -> dict:
    """Measure one layout; returns the figures as a dict."""
    plan = build_plan(family, dims, layout)
    gen = torch.Generator().manual_seed(0)
    params = {n: (torch.randn(p.local_shape, generator=gen) * 0.02).to(torch.bfloat16)
              for n, p in plan.params.items()}
    store = BaselineStore("device")
    for n, t in params.items():
        store.register(n, t)
    for t in params.values():
        flat = t.view(-1)
        k = int(flat.numel() * density)
        pos = torch.randperm(flat.numel(), generator=gen)[:k]
        flat[pos] = (flat[pos].float() * 1.01 + 1e-4).to(torch.bfloat16)
    shard_bytes = sum(t.numel() * 2 for t in params.values())
    t0 = time.perf_counter()
    canonical = {n: ("bf16", s) for n, s in plan.canonical_shapes().items()}
    tables = {n: RunTable.of(_row_runs(plan, n, 0, p.numel, int(p.local_shape[-1]) if p.local_shape else 1),
                             lambda idx, n=n: plan.remap(n, idx)) for n, p in plan.params.items()}
    table_s = time.perf_counter() - t0

    def walked(d) -> int:
        got = tables[d.name].pieces(d, canonical) if tables[d.name] is not None and d.nnz else None
        if got is None:
            return plan.remap(d.name, torch.from_numpy(d.positions)).numel()
        return sum(g.nnz for g in got)

    tracker, cap_s, rem_s, walk_s = AllocationTracker(), [], [], []
    rss0 = _rss_peak_bytes()
    for _ in range(repeat):
        t0 = time.perf_counter()
        with tracker:
            deltas = capture(params, store)
            t1 = time.perf_counter()
            nnz = sum(plan.remap(d.name, torch.from_numpy(d.positions)).numel() for d in deltas)
            t2 = time.perf_counter()
            if sum(walked(d) for d in deltas) != nnz:
                raise AssertionError("the run tables and the transforms mapped different counts")
        cap_s.append(t1 - t0)
        rem_s.append(t2 - t1)
        walk_s.append(time.perf_counter() - t2)
    changed = sum(d.nnz for d in deltas)
    return dict(shard_mb=shard_bytes / 1e6, changed=changed, remapped=nnz,
                capture_mb_s=shard_bytes / 1e6 / min(cap_s),
                remap_melem_s=changed / 1e6 / min(rem_s),
                runs_melem_s=changed / 1e6 / min(walk_s),
                runs_over_transforms=min(walk_s) / min(rem_s), table_s=table_s,
                max_alloc_vs_shard=tracker.max_bytes / shard_bytes,
                rss_growth_vs_shard=(_rss_peak_bytes() - rss0) / shard_bytes)


def main() -> None:
    p = argparse.ArgumentParser(description="capture + remap throughput per layout")
    p.add_argument("--density", type=float, default=0.02, help="fraction of changed elements")
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    print(f"torch threads={torch.get_num_threads()} density={args.density}")
    print(f"{'model':12} {'layout':24} {'shard MB':>9} {'capture MB/s':>13} "
          f"{'remap Melem/s':>14} {'runs Melem/s':>13} {'runs/remap':>11} {'tables s':>9} "
          f"{'max alloc/shard':>16} {'RSS growth/shard':>17}")
    for name, family, dims, lay in LAYOUTS:
        r = bench(family, dims, lay, args.density, args.repeat)
        desc = f"tp{lay.tp} pp{lay.pp} ep{lay.ep} etp{lay.etp} dp{lay.dp}"
        print(f"{name:12} {desc:24} {r['shard_mb']:9.1f} {r['capture_mb_s']:13.0f} "
              f"{r['remap_melem_s']:14.1f} {r['runs_melem_s']:13.1f} {r['runs_over_transforms']:11.3f} "
              f"{r['table_s']:9.2f} {r['max_alloc_vs_shard']:16.3f} "
              f"{r['rss_growth_vs_shard']:17.3f}")


if __name__ == "__main__":
    main()
