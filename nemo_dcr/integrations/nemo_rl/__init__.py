"""NeMo-RL integration: the checkpoint-engine plugin on the one refit path (see docs/nemo_rl.md)."""

from .options import SELECTOR, PluginOptions
from .plugin import DcrCheckpointEngine

__all__ = ["SELECTOR", "DcrCheckpointEngine", "PluginOptions"]
