"""Megatron-Core integration: model building on CPU/GPU, rank topology, the trainer source, dense reference.

Importing this package registers the Megatron-Core trainer source with the refit path
(:func:`nemo_dcr.refit.source.register_source`); megatron itself is imported only when used.
"""

from nemo_dcr.refit.source import register_source

from .source import MegatronSource, source_from_model

register_source("megatron-core", source_from_model)

__all__ = ["MegatronSource", "source_from_model"]
