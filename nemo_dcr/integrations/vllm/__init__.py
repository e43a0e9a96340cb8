"""vLLM integration: the worker extension that applies refits in place."""
