"""Which tensors an FP8 engine holds in FP8, and the whole-model quantize / delta steps.

The default :class:`Fp8Rule` follows the DeepSeek-V3 / Qwen3 FP8 checkpoints: the 2-D weights of
the linear layers (attention projections, MLP / expert projections) are FP8; embeddings,
``lm_head``, norms, the MoE router (``mlp.gate.weight``, not ``gate_proj``), biases and every
tensor that is not 2-D stay BF16. Patterns are :mod:`fnmatch` globs on canonical (HF) names.

Plan, then execute: :class:`Fp8Plan` is built once from the canonical names and shapes and
reused every step. Engine tensor names: a quantized ``X.weight`` becomes ``X.weight``
(``float8_e4m3fn``) plus ``X.weight_scale_inv`` (fp32, block grid; ``X.weight_scale`` for the
channel and tensor granularities); kept tensors keep their name and dtype.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase

import numpy as np
import torch

from nemo_dcr.quant.delta import Fp8DeltaStats, Fp8TensorDelta, fp8_delta, requantized_delta, scale_tensor_name
from nemo_dcr.quant.fp8 import Fp8Error, Fp8Scheme, quantize
from nemo_dcr.types import SparseDelta

Tensors = dict[str, torch.Tensor]

REQUANTIZE_FRACTION = 0.1
"""Above this fraction of changed elements an FP8 weight is re-quantized whole (docs/fp8.md: the
delta costs ~90 ns per change, a full quantization ~5-10 ns per element)."""

DEFAULT_KEEP = ("*embed_tokens*", "*lm_head*", "*norm*", "*.mlp.gate.weight", "*router*", "*.bias")


@dataclass(frozen=True)
class Fp8Rule:
    """Name patterns choosing the FP8 tensors.

    Attributes:
        quantize: a 2-D tensor matching one of these (and none of ``keep``) is FP8.
        keep: tensors matching one of these stay in their training dtype.
    """

    quantize: tuple[str, ...] = ("*.weight",)
    keep: tuple[str, ...] = DEFAULT_KEEP

    def is_fp8(self, name: str, shape: Sequence[int]) -> bool:
        """Whether tensor ``name`` of ``shape`` is held in FP8."""
        return (len(shape) == 2 and any(fnmatchcase(name, p) for p in self.quantize)
                and not any(fnmatchcase(name, p) for p in self.keep))


@dataclass(frozen=True)
class Fp8Plan:
    """Per-tensor FP8 decisions for one model, built once.

    Attributes:
        scheme: block / channel / tensor scales.
        fp8: canonical name -> shape of every FP8 weight.
        kept: canonical names of the tensors kept as they are.
        scale_names: canonical weight name -> its scale tensor's name.
    """

    scheme: Fp8Scheme
    fp8: dict[str, tuple[int, int]]
    kept: tuple[str, ...]
    scale_names: dict[str, str] = field(default_factory=dict)

    @classmethod
    def build(cls, shapes: Mapping[str, Sequence[int]], rule: Fp8Rule = Fp8Rule(),
              scheme: Fp8Scheme = Fp8Scheme()) -> Fp8Plan:
        """Plan for a model with these canonical tensor names and shapes."""
        fp8 = {n: tuple(int(s) for s in shape) for n, shape in shapes.items() if rule.is_fp8(n, shape)}
        scale_names = {n: scale_tensor_name(n, scheme) for n in fp8}
        clash = sorted(set(scale_names.values()) & set(shapes))
        if clash:
            raise Fp8Error(f"scale tensor names already used by the model: {clash[:5]}")
        for n, shape in fp8.items():
            scheme.grid(shape)  # validates the shape
        return cls(scheme, fp8, tuple(n for n in shapes if n not in fp8), scale_names)

    def engine_names(self) -> list[str]:
        """Names of every tensor the FP8 engine holds."""
        return list(self.kept) + [x for n in self.fp8 for x in (n, self.scale_names[n])]

    def quantize_model(self, tensors: Mapping[str, torch.Tensor]) -> tuple[Tensors, Tensors]:
        """Full quantization (initial load, dense refit, resync).

        Returns:
            The engine's tensors (kept ones as given, FP8 weights and scales) and the
            trainer-side state (block maxima of each FP8 weight).
        """
        self._check_names(tensors)
        engine, amax = {n: tensors[n] for n in self.kept}, {}
        for n in self.fp8:
            qw = quantize(tensors[n], self.scheme, n)
            engine[n], engine[self.scale_names[n]], amax[n] = qw.weight, qw.scale, qw.amax
        return engine, amax

    def deltas(self, bf16_deltas: Sequence[SparseDelta], tensors: Mapping[str, torch.Tensor],
               amax: Mapping[str, torch.Tensor], engine_bits: Mapping[str, np.ndarray] | None = None,
               ) -> tuple[list[SparseDelta], Tensors, dict[str, Fp8DeltaStats]]:
        """The engine-side changes for a step, from the BF16 changes of every canonical tensor.

        Args:
            bf16_deltas: canonical BF16 deltas (with old bits), at most one per tensor.
            tensors: the new canonical targets of at least the FP8 weights that changed.
            amax: block maxima state of every FP8 weight (from :meth:`quantize_model` or the
                previous call); not modified.
            engine_bits: see :meth:`weight_delta`.

        Returns:
            Deltas for the engine's tensors (kept tensors' deltas unchanged; each FP8 weight
            gives a weight and a scale delta), the new state (commit it once the engine
            acknowledged) and per-weight counts.
        """
        out, new_amax, stats = [], dict(amax), {}
        for d in bf16_deltas:
            if d.name not in self.fp8:
                if d.name not in self.kept:
                    raise Fp8Error(f"{d.name}: not a tensor of this plan ({len(self.fp8) + len(self.kept)} known)")
                out.append(d)
                continue
            if d.name not in tensors or d.name not in amax:
                raise Fp8Error(f"{d.name}: the FP8 delta needs its new target and its amax state")
            fd = self.weight_delta(d, tensors[d.name], amax[d.name], engine_bits)
            out += [fd.weight, fd.scale]
            new_amax[d.name], stats[d.name] = fd.amax, fd.stats
        return out, new_amax, stats

    def weight_delta(self, d: SparseDelta, target: torch.Tensor, amax: torch.Tensor,
                     engine_bits: Mapping[str, np.ndarray] | None = None) -> Fp8TensorDelta:
        """The FP8 byte and scale changes of FP8 weight ``d.name`` from its BF16 changes ``d``.

        Both paths give exactly ``quantize(target)``'s changes: :func:`~.delta.fp8_delta` (cost ~
        changes), or, with ``engine_bits`` and more than :data:`REQUANTIZE_FRACTION` of the elements
        changed (a first sync, large steps), :func:`~.delta.requantized_delta` (cost ~ elements).

        Args:
            d: the weight's BF16 delta (with old bits).
            target: its whole new target.
            amax: its block maxima state.
            engine_bits: engine tensor name -> flat bits of what the engine holds (the weight's
                FP8 bytes and its scales); None: always the delta path.
        """
        scale = self.scale_names[d.name]
        if engine_bits is None or d.nnz <= REQUANTIZE_FRACTION * d.numel:
            return fp8_delta(d, target, amax, self.scheme, scale)
        return requantized_delta(d, target, engine_bits[d.name], engine_bits[scale], self.scheme, scale)

    def _check_names(self, tensors: Mapping[str, torch.Tensor]) -> None:
        missing = [n for n in (*self.fp8, *self.kept) if n not in tensors]
        if missing:
            raise Fp8Error(f"{len(missing)} planned tensors missing, e.g. {missing[:5]}")
        for n, shape in self.fp8.items():
            if tuple(tensors[n].shape) != shape:
                raise Fp8Error(f"{n}: planned shape {list(shape)}, got {list(tensors[n].shape)}")
