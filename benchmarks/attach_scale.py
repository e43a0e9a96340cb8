"""Attach cost of a vLLM engine against parameter count (CPU): probe, attach, first sync, preflight.

Usage:
    python benchmarks/attach_scale.py [--sizes 135m,360m,1b] [--moe] [--json OUT]   (sizes: 50m, 135m, 360m, 1b)

For each size a Llama-shaped config (a 50M one, SmolLM2-135M, SmolLM2-360M, a TinyLlama-1.1B-shaped model;
``--moe`` adds two Qwen3-MoE-shaped models of about the same size with 8 and 64 experts, to show
that experts cost per element, not per expert call) gets random bf16 weights (written straight
to safetensors: nothing is downloaded), one vLLM engine (TP=1, in-process, one at a time) is
started on it, and this process measures:

* ``vllm_load``: ``vllm.LLM`` start (vLLM's own load, the reference every ratio divides by);
* ``probe``: recording and probing every canonical tensor through ``load_weights``
  (:mod:`nemo_dcr.apply.probe`), with its ``load_weights`` calls and peak probe bytes, and the
  peak RSS growth of the process while probing (sampled every 5 ms);
* ``attach``: building each rank's engine over the live params (placement, class indexes);
* ``first_sync``: ``DeltaRefit.attach`` of a trainer holding the same weights (checksums on both
  sides; nothing to send), of which ``preflight``: vLLM's in-place reload compared with what the
  engine holds, with the peak RSS growth of the process during it (trainer and engine side: the
  benchmark holds both);
* ``attach_rss_kept``: RSS growth from before the probe to after the first sync, less the
  trainer's own copy of the weights, after ``malloc_trim`` (what attaching leaves held: the
  engine's class indexes, the trainer's mirror and its indexes).

Printed per size: seconds, seconds per billion parameters and the ratio to ``vllm_load``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from pathlib import Path

SIZES = {
    "50m": dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=24, num_attention_heads=6,
                num_key_value_heads=2, vocab_size=32000, tie_word_embeddings=True),
    "135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                 num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True),
    "360m": dict(hidden_size=960, intermediate_size=2560, num_hidden_layers=32, num_attention_heads=15,
                 num_key_value_heads=5, vocab_size=49152, tie_word_embeddings=True),
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
               num_key_value_heads=4, vocab_size=32000, tie_word_embeddings=False),
}
MOE = {
    "moe8": dict(hidden_size=512, moe_intermediate_size=1024, num_experts=8, num_hidden_layers=8),
    "moe64": dict(hidden_size=512, moe_intermediate_size=128, num_experts=64, num_hidden_layers=8),
}
KEY = b"attach-scale-key-0123456789abcdef"


def write_random(kind: str, sizes: dict, out: Path) -> int:
    """Random bf16 weights of a ``kind`` model (names and shapes from transformers on the meta
    device) at ``out``; returns the parameter count."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from nemo_dcr.checkpoint import save_checkpoint

    extra = dict(num_experts_per_tok=2, norm_topk_prob=True, intermediate_size=1024, num_attention_heads=8,
                 num_key_value_heads=4, head_dim=64, vocab_size=32000) if kind == "qwen3_moe" else {}
    config = AutoConfig.for_model(kind, **{**extra, **sizes, "max_position_embeddings": 1024,
                                           "bos_token_id": 1, "eos_token_id": 2})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    g = torch.Generator().manual_seed(0)
    tensors = {n: (torch.randn(p.shape, generator=g) * 0.02).to(torch.bfloat16)
               for n, p in model.state_dict().items() if not (config.tie_word_embeddings and n == "lm_head.weight")}
    out.mkdir(parents=True)
    save_checkpoint(tensors, out)
    config.architectures = [type(model).__name__]
    config.save_pretrained(out)
    return sum(t.numel() for t in tensors.values())


class RssPeak:
    """Peak resident-set growth of this process while active (sampled every 5 ms)."""

    def __enter__(self):
        self.base = self.peak = _rss()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.growth = self.peak - self.base


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _trim() -> None:
    """Hand malloc's free lists back to the system (glibc), so RSS counts what is still held."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def measure(model_dir: Path, params: int) -> dict:
    from nemo_dcr.checkpoint import load_checkpoint
    from nemo_dcr.config.schema import DcrConfig
    from nemo_dcr.integrations.vllm.engine import VllmEngine, canonical_dtypes, canonical_shapes, start_llm
    from nemo_dcr.refit import DeltaRefit, colocated_wiring
    from nemo_dcr.refit.canonical import CanonicalSource

    t0 = time.perf_counter()
    llm = start_llm(str(model_dir), max_model_len=256, skip_tokenizer_init=True, max_num_seqs=4)
    t_load = time.perf_counter() - t0
    before = _rss()
    with RssPeak() as rss:
        t0 = time.perf_counter()
        engine = VllmEngine(llm, canonical_shapes(model_dir), KEY, dtypes=canonical_dtypes(model_dir))
        t_engine = time.perf_counter() - t0
    stats = engine.probed[0]["stats"]
    cfg = DcrConfig(transport="inprocess", reply_timeout_s=3600, telemetry_encodings=[])
    loaded = _rss()
    tensors = {n: t.clone() for n, t in load_checkpoint(model_dir).items()}
    trainer = _rss() - loaded
    with RssPeak() as sync_rss:
        t0 = time.perf_counter()
        refit = DeltaRefit(cfg, CanonicalSource(tensors), colocated_wiring(cfg, 0, KEY), engine, key=KEY)
        report = refit.attach()
        t_sync = time.perf_counter() - t0
    _trim()
    kept = _rss() - before - trainer
    refit.close(60)
    engine.close()
    row = dict(params=params, vllm_load=t_load, probe=stats["seconds"], probe_calls=stats["load_calls"],
               probe_peak_bytes=stats["peak_bytes"], probe_rss_growth=rss.growth,
               attach=t_engine - stats["seconds"], first_sync=t_sync, preflight=report.times.get("preflight", 0.0),
               first_sync_rss_growth=sync_rss.growth, attach_rss_kept=kept, resynced=report.resynced)
    row["total"] = row["probe"] + row["attach"] + row["first_sync"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="135m,360m,1b")
    ap.add_argument("--moe", action="store_true")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    from nemo_dcr.integrations.vllm.engine import CPU_ENV

    for k, v in CPU_ENV.items():
        os.environ.setdefault(k, v)
    models = [(s, "llama", SIZES[s]) for s in a.sizes.split(",") if s]
    models += [(s, "qwen3_moe", MOE[s]) for s in MOE] if a.moe else []
    rows = {}
    for name, kind, sizes in models:
        with tempfile.TemporaryDirectory(prefix="nemo_dcr_attach_") as tmp:
            params = write_random(kind, sizes, Path(tmp) / name)
            rows[name] = r = measure(Path(tmp) / name, params)
        per_b = 1e9 / r["params"]
        print(f"{name:>6} {r['params'] / 1e6:8.1f}M params: vLLM load {r['vllm_load']:6.1f} s | probe {r['probe']:6.2f} s "
              f"({r['probe'] * per_b:6.1f} s/B, {r['probe_calls']} load_weights calls, peak probe buffers "
              f"{r['probe_peak_bytes'] / 2**20:7.1f} MiB, RSS +{r['probe_rss_growth'] / 2**20:7.1f} MiB) | attach "
              f"{r['attach']:6.2f} s | first sync {r['first_sync']:6.2f} s (preflight {r['preflight']:5.2f} s, RSS "
              f"+{r['first_sync_rss_growth'] / 2**20:7.1f} MiB; kept after attach {r['attach_rss_kept'] / 2**20:7.1f} MiB) | total "
              f"{r['total']:6.2f} s = {r['total'] * per_b:6.1f} s/B = {r['total'] / r['vllm_load']:.2f}x vLLM load",
              flush=True)
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
