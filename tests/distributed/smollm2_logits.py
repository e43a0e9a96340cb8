"""torchrun worker: SmolLM2 loaded from HF into megatron TP x PP; logits vs HF fp32 logits.

Args: ``--checkpoint`` (fp32 HF weights, safetensors), ``--hf-logits`` ([1, seq, vocab]
fp32 logits of the HF model for ``--hf-tokens``), ``--tp``, ``--pp``, ``--out`` (JSON).
Activations are passed between the pipeline stages with send/recv by hand.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist

from nemo_dcr.checkpoint import load_checkpoint
from nemo_dcr.tools.megatron import build as am
from nemo_dcr.tools.megatron.dense import load_hf
from nemo_dcr.tools.megatron.train import pipeline_logits
from nemo_dcr.layout import model_dims


def main() -> None:
    p = argparse.ArgumentParser()
    for k in ("checkpoint", "hf_logits", "hf_tokens", "out"):
        p.add_argument("--" + k.replace("_", "-"), required=True)
    p.add_argument("--tp", type=int, default=3)
    p.add_argument("--pp", type=int, default=2)
    args = p.parse_args()
    am.init_distributed(args.tp, args.pp, etp=1)
    dims = model_dims("smollm2")
    chunks = am.build_gpt_model(dims, torch.float32)
    loaded = load_hf(chunks, load_checkpoint(args.checkpoint), dims)
    tokens = torch.load(args.hf_tokens)
    logits = pipeline_logits(chunks[0], tokens, dims.hidden_size, torch.float32, dims.vocab_size)
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
