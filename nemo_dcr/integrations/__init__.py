"""Framework integrations: the only place that imports megatron, transformers, vllm or NeMo-RL."""
