"""NeMo-RL integration: the checkpoint-engine plugin (see docs/nemo_rl.md)."""

from .plugin import SELECTOR, DcrCheckpointEngine, DcrWeightSynchronizer

__all__ = ["SELECTOR", "DcrCheckpointEngine", "DcrWeightSynchronizer"]
