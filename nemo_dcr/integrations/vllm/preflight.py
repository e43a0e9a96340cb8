"""The engine checked against its own load of what it holds (``dcr.preflight``, first sync of a job).

After the first sync, every canonical element the engine holds equals the trainer's (the
checksums agree) and every element is held (coverage), so the engine's own dense load of the
canonical tensors it holds is its dense load of the trainer's weights.  :func:`check` runs that
load in place, through vLLM's own weight reload (``load_weights`` plus each layer's post-load
processing, copied back into the same storage), and compares every param, buffer and tensor
attribute of every module with what the refit left: any param a placement missed, a derived
tensor gone stale, a rearrangement not followed shows up as a difference.

The canonical tensors are rebuilt one at a time from the views (in-place tensors) and shadows
(transformed tensors); elements a rank does not hold stay zero, since its loaders never read
them.  vLLM's CPU MoE reload leaves the experts in the loader layout (it prepacks only on the
first load), so prepacked experts are compared in that layout with their loader-layout copies
and repacked afterwards.
"""

from __future__ import annotations

import hashlib
from typing import Iterator

import torch

from nemo_dcr.apply import TensorEngine
from nemo_dcr.apply.probe import SHADOW
from nemo_dcr.types import int_view

_NAN = {2: 0x7FC5, 4: 0x7FC00005}


def unknown(shape, dtype: torch.dtype) -> torch.Tensor:
    """A flat tensor of a NaN pattern: a shadow whose canonical values are not known yet."""
    t = torch.empty(int(torch.Size(shape).numel()), dtype=dtype)
    int_view(t).fill_(_NAN[t.element_size()])
    return t


def held_weights(engine: TensorEngine, dtypes) -> Iterator[tuple[str, torch.Tensor]]:
    """``(canonical name, tensor)`` of every tensor the engine holds, its held elements in place."""
    for name, tp in engine.placed.items():
        view = engine.tensors[name]
        if tp.param.startswith(SHADOW):
            yield name, view.param.reshape(tp.shape)
            continue
        full = torch.zeros(tp.shape, dtype=dtypes.get(name, view.dtype))
        view.scatter_canonical(full.reshape(-1))
        yield name, full


def state_tensors(worker, packed) -> dict[str, torch.Tensor]:
    """Everything a forward pass of the worker's model may read, bar its KV cache: params,
    buffers, tensor attributes of every module (``attr:<module>.<name>``), and the loader-layout
    copies of prepacked experts.  The KV cache (the runner's ``kv_caches``, which vLLM binds to
    each attention layer's ``kv_cache``) is serving state, rewritten by every generation."""
    model = worker.model_runner.model
    caches = {c.untyped_storage().data_ptr() for c in getattr(worker.model_runner, "kv_caches", None) or []
              if isinstance(c, torch.Tensor)}
    out = {f"param:{n}": p.data for n, p in model.named_parameters()}
    out.update({f"buffer:{n}": b for n, b in model.named_buffers()})
    for prefix, module in model.named_modules():
        for a, v in vars(module).items():
            if isinstance(v, torch.Tensor) and not a.startswith(("_", "dcr")) \
                    and v.untyped_storage().data_ptr() not in caches:
                out[f"attr:{prefix}.{a}"] = v
    out.update({f"unpacked:{n}": layer.unpacked[n] for n, layer in packed.items()})
    return out


def digests(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """dtype, shape and sha256 of each tensor's bytes."""
    out = {}
    for n, t in tensors.items():
        c = t.detach().contiguous().cpu()
        data = c.reshape(-1).view(torch.uint8).numpy() if c.numel() else b""
        out[n] = f"{c.dtype}{list(c.shape)}:{hashlib.sha256(data).hexdigest()}"
    return out


def check(worker) -> list[str]:
    """Compare this rank with vLLM's in-place reload of the canonical tensors it holds.

    Returns:
        One line per differing tensor (empty: bit-identical).

    Raises:
        NotImplementedError: this vLLM has no in-place weight reload.
    """
    try:
        from vllm.model_executor.model_loader.reload.inplace import reload_weights
    except ImportError as exc:
        raise NotImplementedError(f"this vLLM has no in-place weight reload ({exc}); run `nemo-dcr check-engine` "
                                  "before the job instead, or set dcr.preflight: false") from None
    model = worker.model_runner.model
    before = digests(state_tensors(worker, worker.dcr_packed))
    weights = held_weights(worker.dcr_engine, worker.dcr_dtypes)
    reload_weights(worker.vllm_config, model, weights_iterator=weights, weights_path=None, is_checkpoint_format=True)
    after = digests(state_tensors(worker, worker.dcr_packed))
    for name, layer in worker.dcr_packed.items():
        key = f"param:{name}"
        if after[key] != before[key] and after[key] == before[f"unpacked:{name}"]:
            layer.repack(name)  # the reload left the loader layout (the refit's copy): pack it as the first load did
            after[key] = digests({key: layer.live[name]})[key]
    return [f"{n}: {'missing after the reload' if n not in after else 'differs from the engine own load'}"
            for n in sorted(before) if before[n] != after.get(n)]
