"""Alias of :mod:`nemo_dcr.integrations.nemo_rl` for the selector string users already have in their YAML."""

from nemo_dcr.integrations.nemo_rl import SELECTOR, DcrCheckpointEngine

__all__ = ["SELECTOR", "DcrCheckpointEngine"]
