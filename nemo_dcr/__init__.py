"""nemo_dcr: bit-exact delta-compressed refit for RL post-training.

The public API (imported on first use, so ``import nemo_dcr`` stays light).

Trainer side, on every trainer rank (collective)::

    from nemo_dcr import DeltaRefit, DcrConfig
    refit = DeltaRefit.from_config(DcrConfig(), model_chunks, optimizer, engine=engine)
    refit.attach()            # first sync; then one refit after every optimizer.step()

Engine side, in an engine process of its own (the trainer ranks and the engine ranks share one
transport; see docs/refit.md, "Separate engine processes")::

    from nemo_dcr import EngineServer, TensorEngine
    server = EngineServer(TensorEngine(live_tensors), transport, senders=trainer_ranks)
    server.serve()            # until the trainers close the refit

and on the trainer ranks of such a job ``DeltaRefit.from_config(cfg, model, wiring=engine_wiring(
transport, trainer_ranks, engine_ranks))``.  A vLLM engine is ``VllmEngine`` and its worker extension
``WORKER_EXTENSION`` in :mod:`nemo_dcr.integrations.vllm`.

The payload codec (docs/wire_format.md) is :mod:`nemo_dcr.codec` (``codec.encode``, ``codec.decode``,
``codec.apply``, ``codec.inspect``).  Framework sources (megatron-core) are registered by the
``nemo_dcr.sources`` entry points, whichever import path is used.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_API = {
    "DeltaRefit": "nemo_dcr.refit",
    "RefitReport": "nemo_dcr.refit",
    "TrainerSource": "nemo_dcr.refit",
    "EngineServer": "nemo_dcr.refit",
    "Engine": "nemo_dcr.refit",
    "Wiring": "nemo_dcr.refit",
    "colocated_wiring": "nemo_dcr.refit",
    "engine_wiring": "nemo_dcr.refit",
    "DcrConfig": "nemo_dcr.config",
    "ConfigError": "nemo_dcr.config",
    "TensorEngine": "nemo_dcr.apply",
}
"""Public name -> the module that defines it (no name here is also a subpackage of nemo_dcr)."""

__all__ = sorted(_API)


def __getattr__(name: str):
    if name not in _API:
        raise AttributeError(f"module 'nemo_dcr' has no attribute {name!r}")
    value = getattr(importlib.import_module(_API[name]), name)
    globals()[name] = value
    return value
