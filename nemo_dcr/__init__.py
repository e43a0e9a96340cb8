"""nemo_dcr: bit-exact delta-compressed refit for RL post-training."""

__version__ = "0.1.0"
