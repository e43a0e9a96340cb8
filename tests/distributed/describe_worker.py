"""One process (gloo, world 1): the model description derived from built megatron-core models, and
what from_config refuses.  Prints one JSON object."""

from __future__ import annotations

import dataclasses
import json
import os

import torch
import torch.distributed as dist


def _built(dims, **config_changes):
    from nemo_dcr.tools.megatron import build as am

    chunks = am.build_gpt_model(dims, torch.bfloat16)
    for k, v in config_changes.items():
        setattr(chunks[0].config, k, v)
    return chunks


def _error(fn) -> str:
    try:
        fn()
    except (ValueError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def main() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", rank=0, world_size=1)
    from nemo_dcr.tools.megatron import build as am
    from nemo_dcr.integrations.megatron.describe import dims_from_model
    from nemo_dcr.layout import MODELS
    from nemo_dcr.refit import source_for

    am.init_distributed(1, 1)
    out = {}
    for name in ("dense-tiny", "qwen3-moe-tiny", "deepseek-tiny"):
        want = MODELS[name]
        if want.num_experts:
            am.init_distributed(1, 1, 1, 1)
        got = dims_from_model(_built(want), vocab_size=want.vocab_size)
        diff = {f.name: (getattr(got, f.name), getattr(want, f.name)) for f in dataclasses.fields(want)
                if getattr(got, f.name) != getattr(want, f.name) and f.name not in ("padded_vocab_size", "head_dim")}
        if got.kv_channels != want.kv_channels:  # head_dim None means hidden / heads
            diff["kv_channels"] = (got.kv_channels, want.kv_channels)
        out[name] = dict(diff={k: list(map(str, v)) for k, v in diff.items()}, family=got.family,
                         padded=got.padded_vocab(1))
    tiny = MODELS["dense-tiny"]
    out["errors"] = dict(
        bias=_error(lambda: dims_from_model(_built(tiny, add_bias_linear=True))),
        norm=_error(lambda: dims_from_model(_built(tiny, normalization="LayerNorm"))),
        vocab=_error(lambda: dims_from_model(_built(tiny), vocab_size=5000)),
        not_a_model=_error(lambda: source_for(object())),
    )
    print(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
