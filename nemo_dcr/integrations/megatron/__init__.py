"""Megatron-Core integration: model building on CPU/GPU, rank topology, the trainer source, dense reference."""
