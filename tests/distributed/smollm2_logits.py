"""torchrun worker: SmolLM2 loaded from HF into megatron TP x PP; logits vs HF fp32 logits.

Args: ``--hf-state`` (torch.save'd fp32 HF state dict), ``--hf-logits`` ([1, seq, vocab]
fp32 logits of the HF model for ``--hf-tokens``), ``--tp``, ``--pp``, ``--out`` (JSON).
Activations are passed between the pipeline stages with send/recv by hand.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist

from nemo_dcr.integrations.megatron import build as am
from nemo_dcr.integrations.megatron.params import load_hf
from nemo_dcr.integrations.megatron.train import pipeline_logits


def main() -> None:
    p = argparse.ArgumentParser()
    for k in ("hf_state", "hf_logits", "hf_tokens", "out"):
        p.add_argument("--" + k.replace("_", "-"), required=True)
    p.add_argument("--tp", type=int, default=3)
    p.add_argument("--pp", type=int, default=2)
    args = p.parse_args()
    am.init_distributed(args.tp, args.pp, etp=1)
    preset = am.PRESETS["smollm2"]
    chunks = am.build_gpt_model(preset, torch.float32)
    loaded = load_hf(chunks, torch.load(args.hf_state, mmap=True), preset)
    tokens = torch.load(args.hf_tokens)
    logits = pipeline_logits(chunks[0], tokens, preset.hidden, torch.float32, preset.vocab)
    if logits is not None and dist.get_rank() == dist.get_world_size() - 1:
        ref = torch.load(args.hf_logits)
        got = logits.transpose(0, 1) if logits.shape[0] != ref.shape[0] else logits
        diff = (got - ref).abs()
        with open(args.out, "w") as f:
            json.dump(dict(max_abs_diff=float(diff.max()), ref_max_abs=float(ref.abs().max()),
                           argmax_agree=float((got.argmax(-1) == ref.argmax(-1)).float().mean()),
                           shape=list(got.shape), params_loaded=loaded), f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
