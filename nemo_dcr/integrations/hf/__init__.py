"""Hugging Face transformers integration: the embedded model and a transformers engine."""
