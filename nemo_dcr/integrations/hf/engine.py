"""A Hugging Face transformers causal LM as a refit engine (runs on CPU).

The live parameters of the model are the engine's tensors: payloads are scattered in place
into them through integer views (:class:`nemo_dcr.apply.TensorEngine`), so no state dict is
copied or reloaded.  ``generate`` holds the engine's read guard for the whole call, so a
generation never sees two versions.  Tied embeddings appear once (``named_parameters``
de-duplicates shared storage), which is also the canonical HF naming.

With an FP8 plan (``dcr.engine_format: fp8``, docs/fp8.md) the planned linear layers become
:class:`~nemo_dcr.quant.Fp8Linear` holding the quantized weights (``X.weight`` bytes and
``X.weight_scale_inv`` scales, weight-only FP8 on CPU); the engine's tensors are then those plus
the kept BF16 parameters.  Every transaction runs the engine-side FP8 checks before writing
(:class:`~nemo_dcr.quant.Fp8TransactionCheck`), and the layers a version touched drop their
dequantized copy before the version commits (readers wait for the commit, so none sees a stale one).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Mapping

import torch

from nemo_dcr import quant
from nemo_dcr.apply import ApplyResult, EngineChecksums, Parts, TensorEngine
from nemo_dcr.verify.sample import Sample


@dataclass(frozen=True)
class Generation:
    """Tokens generated and the single version that produced them."""

    tokens: torch.Tensor
    version: int


class HFEngine:
    """Wraps a transformers ``*ForCausalLM`` as an engine (the contract of
    :class:`nemo_dcr.apply.Engine`: canonical tensors held whole, one shard).

    Args:
        model: the model (converted in place to ``dtype``, put in eval mode).
        dtype: serving dtype of the parameters.
        version: the version the weights hold.
        key: HMAC key every payload must carry.
        fp8_plan: hold the plan's FP8 weights quantized (a :class:`~nemo_dcr.quant.Fp8Plan` built
            from this model's parameter names and shapes; None: every parameter in ``dtype``).
        keep_index: keep ``dcr`` class indexes (``dcr.engine_index``, see :class:`~nemo_dcr.apply.TensorEngine`).
        threads: worker threads over a part's records (``dcr.threads``, see :class:`~nemo_dcr.apply.TensorEngine`).
    """

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype = torch.bfloat16, version: int = 0,
                 key: bytes | None = None, fp8_plan: quant.Fp8Plan | None = None, keep_index: bool = True,
                 threads: int | str = "auto"):
        self.model = model.to(dtype).eval()
        tensors = {n: p.data for n, p in self.model.named_parameters()}
        bad = [n for n, t in tensors.items() if not t.is_contiguous()]
        if bad:
            raise ValueError(f"parameters must be contiguous for in-place apply: {bad[:5]}")
        self.fp8_plan = fp8_plan
        self._fp8_layers: dict[str, quant.Fp8Linear] = {}
        self.last_dense: list[dict] = []
        """The timings of the last :meth:`load_weights`."""
        if fp8_plan is not None:
            tensors = self._quantize(tensors, fp8_plan)
        self.engine = TensorEngine(tensors, version, key, keep_index, threads=threads)
        if fp8_plan is not None:
            self.engine.check = quant.Fp8TransactionCheck(fp8_plan)
        self.engine.build_indexes()  # the first refit then decodes in proportion to its changes

    def _quantize(self, tensors: dict[str, torch.Tensor], plan: quant.Fp8Plan) -> dict[str, torch.Tensor]:
        """Swap the planned linear layers for FP8 ones; returns the engine's tensors."""
        engine, _ = plan.quantize_model(tensors)
        layers = quant.to_fp8_linears(self.model, plan, engine)
        self._fp8_layers = {n: layer for w, layer in layers.items() for n in (w, plan.scale_names[w])}
        return {n: engine[n] for n in plan.engine_names()}

    @classmethod
    def from_config(cls, config, seed: int = 0, **kwargs) -> "HFEngine":
        """A randomly initialized model of ``config`` (any causal LM config)."""
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        return cls(AutoModelForCausalLM.from_config(config), **kwargs)

    @classmethod
    def from_embedded(cls, **kwargs) -> "HFEngine":
        """The embedded SmolLM2-135M-Instruct (see :mod:`nemo_dcr.integrations.hf.model`)."""
        from nemo_dcr.integrations.hf.model import load_embedded_model

        return cls(load_embedded_model(torch.float32), **kwargs)

    @property
    def version(self) -> int:
        """Version of the live weights."""
        return self.engine.version

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """Live parameters by canonical name (do not write into them)."""
        return self.engine.tensors

    def placement(self) -> list[dict]:
        """None: the parameters are the canonical tensors, held whole."""
        return self.engine.placement()

    def prepare(self, parts: Parts, resync: bool = False) -> ApplyResult:
        """Write and verify one version in place (``{0: parts}``), keeping its undo log."""
        return self.engine.prepare(parts, resync)

    def commit(self) -> ApplyResult:
        """Commit the prepared version; FP8 layers it touched drop their dequantized weight first
        (the write guard is still held, so the next generation sees only the new version)."""
        for name in (self.engine.pending.touched if self.engine.pending is not None else ()):
            layer = self._fp8_layers.get(name)
            if layer is not None:
                layer.refresh()
        return self.engine.commit()

    def rollback(self) -> ApplyResult:
        """Undo the prepared version bit for bit (no FP8 layer dropped its dequantized weight)."""
        return self.engine.rollback()

    def serving(self):
        """Hold the current version for one generation (a context manager yielding it)."""
        return self.engine.serving()

    def settle(self) -> float:
        """The contract's ``settle``: wait for the kept indexes' move; the seconds waited."""
        return self.engine.settle()

    def preflight(self) -> list[str]:
        """None: the parameters are the canonical tensors (a load of them is themselves)."""
        return self.engine.preflight()

    def checksums(self, full: bool = False, sample: Sample | None = None) -> EngineChecksums:
        """Per-tensor checksums (incremental, a full scan, or a sample's slice of the live tensors)."""
        return self.engine.checksums(full, sample)

    def digests(self) -> dict[str, str]:
        """sha256 of every engine tensor's bits."""
        return self.engine.digests()

    def load_weights(self, tensors: Mapping[str, torch.Tensor], version: int) -> EngineChecksums:
        """A conventional dense refit from canonical HF tensors: copied into the live parameters
        (an FP8 engine quantizes its FP8 weights first, then its layers drop their dequantized copy),
        no undo log, then a full checksum rescan; moves to ``version``.  :attr:`last_dense` keeps
        the seconds of the load itself (``load_seconds``: quantize and copy).

        Raises:
            KeyError: a tensor of the engine is missing from ``tensors`` (nothing written).
        """
        held = dict(tensors) if self.fp8_plan is None else self.fp8_plan.quantize_model(dict(tensors))[0]
        missing = sorted(set(self.tensors) - set(held))
        if missing:
            raise KeyError(f"dense load without {len(missing)} engine tensors, e.g. {missing[:3]}")
        took = []

        def write(params) -> None:
            t0 = time.perf_counter()
            for name, live in params.items():
                live.copy_(held[name])
            for layer in set(self._fp8_layers.values()):
                layer.refresh()
            took.append(time.perf_counter() - t0)

        checksums = self.engine.dense_refit(write, version)
        self.last_dense = [dict(rank=0, load_seconds=took[0])]
        return checksums

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int = 8) -> Generation:
        """Greedy generation from one version of the weights."""
        with self.engine.serving() as version:
            out = self.model.generate(input_ids, max_new_tokens=max_new_tokens, do_sample=False,
                                      attention_mask=torch.ones_like(input_ids), pad_token_id=0)
        return Generation(out, version)

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Next-token logits and the version that produced them."""
        with self.engine.serving() as version:
            return self.model(input_ids).logits, version
