"""Megatron-Core integration: the trainer source over a rank's model chunks, its topology and ranges.

:func:`source_from_model` is registered with the refit path as the ``megatron-core`` entry point
of ``nemo_dcr.sources`` (``pyproject.toml``), so ``DeltaRefit.from_config(cfg, model_chunks)``
accepts megatron-core chunks whichever module was imported first; megatron itself is imported
only when used.  Building models on CPU (the shim, the fp32-master step) is scaffolding of the
tools: :mod:`nemo_dcr.tools.megatron`.
"""

from .source import MegatronSource, source_from_model

__all__ = ["MegatronSource", "source_from_model"]
