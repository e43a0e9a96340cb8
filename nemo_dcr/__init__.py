"""nemo_dcr: bit-exact delta-compressed refit for RL post-training.

The public API (imported on first use, so ``import nemo_dcr`` stays light)::

    from nemo_dcr import DeltaRefit, DcrConfig
    refit = DeltaRefit.from_config(DcrConfig(), model, optimizer, engine=engine)  # megatron-core chunks
    refit.attach()            # first sync; then one refit after every optimizer.step()

    from nemo_dcr import encode, decode, apply   # the payload codec (docs/wire_format.md)

Accessing :class:`DeltaRefit` here also registers the framework sources of
:mod:`nemo_dcr.integrations` (megatron-core), so ``from_config`` accepts their models.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_API = {
    "DeltaRefit": "nemo_dcr.refit",
    "RefitReport": "nemo_dcr.refit",
    "TrainerSource": "nemo_dcr.refit",
    "DcrConfig": "nemo_dcr.config.schema",
    "encode": "nemo_dcr.codec",
    "encode_deltas": "nemo_dcr.codec",
    "decode": "nemo_dcr.codec",
    "apply": "nemo_dcr.codec",
    "inspect": "nemo_dcr.codec",
    "Identity": "nemo_dcr.codec",
    "TensorEngine": "nemo_dcr.apply",
}

__all__ = sorted(_API)


def __getattr__(name: str):
    if name not in _API:
        raise AttributeError(f"module 'nemo_dcr' has no attribute {name!r}")
    if name == "DeltaRefit":
        importlib.import_module("nemo_dcr.integrations.megatron")  # registers the megatron-core source
    value = getattr(importlib.import_module(_API[name]), name)
    globals()[name] = value
    return value
