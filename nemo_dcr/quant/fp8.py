"""FP8 e4m3 weight quantization with block scales, the convention FP8 rollout engines load.

Convention (DeepSeek-V3 / Qwen3 FP8 checkpoints; vLLM's online block quantization): a 2-D
weight ``W`` of shape ``(m, n)`` is cut into ``bm x bn`` blocks (default 128 x 128) on the grid
``(ceil(m / bm), ceil(n / bn))``; edge blocks are partial (the weight is zero-padded, which
leaves every block's max unchanged). Per block, in float32:

1. ``amax = max |W|`` over the block (bf16 -> fp32 is exact, so ``amax`` is exact);
2. ``scale_inv = max(amax, 1e-4) / 448``  (fp32 division, round to nearest even; ``1e-4`` is
   the fp32 constant nearest to it, 448 is the largest finite e4m3fn value);
3. ``q = e4m3(clamp(fp32(W) * (1.0 / scale_inv), -448, 448))``, where ``1.0 / scale_inv`` is
   one fp32 division per block and the cast rounds to nearest, ties to even (subnormals
   included);
4. stored: ``X.weight`` = ``q`` (``torch.float8_e4m3fn``), ``X.weight_scale_inv`` =
   ``scale_inv`` (fp32, shape = grid). Dequantization is ``q * scale_inv`` per block.

Where it comes from: vLLM ``Fp8PerBlockOnlineLinearMethod.process_weights_after_loading``
(``vllm/model_executor/layers/quantization/online/fp8.py``) calls
``vllm.utils.deep_gemm.per_block_cast_to_fp8(weight, block_size=[128, 128], use_ue8m0=False)``,
which is DeepGEMM's ``per_block_cast_to_fp8`` (``deep_gemm/utils/math.py``): zero-pad to the
block grid, ``amax.clamp(1e-4)``, ``sf = amax / 448``, ``(x * (1.0 / sf)).to(e4m3fn)``, scales of
shape ``(cdiv(m, 128), cdiv(n, 128))`` (the shape vLLM's ``create_fp8_scale_parameter`` gives
``weight_scale_inv``). The DeepSeek-V3 inference code dequantizes with ``y = x * s``.
An older DeepGEMM helper multiplies by ``448 / amax`` instead of ``1 / (amax / 448)``: the two
reciprocals differ in the last bit for about a third of random blocks, which flipped 0.15% of
the FP8 bytes in a check on gaussian weights; this module follows vLLM's current one. The UE8M0
(power-of-two scale) variant used on Blackwell is not implemented.

The clamp in step 3 is what vLLM's CUDA kernels (``scaled_fp8_conversion``) do; with the scale
of step 2, ``|x * (1 / scale_inv)|`` exceeds 448 by a few fp32 ulps at most, which rounds to 448
anyway, so the clamp only makes the result independent of how a torch release casts values
above 448 (torch 2.13 on CPU saturates: 500.0 and inf become 448).

Granularity (:class:`Fp8Scheme`): ``block`` (above), ``channel`` (one scale per output row:
blocks of ``1 x n``) and ``tensor`` (one block covering the whole weight). Channel and tensor use
the same formula with those blocks; vLLM's per-tensor ``scaled_fp8_quant`` CUDA kernel has the
same ``amax / 448``, ``x * (1.0f / scale)`` and clamp but no ``1e-4`` floor, so the two agree for
weights with ``amax >= 1e-4`` as far as the device rounds its fp32 division and multiply like the
CPU does (not checked on a GPU here; neither is vLLM's ``torch.compile`` of the block function). Their scale tensor is called ``weight_scale`` (vLLM's name),
shape ``(m, 1)`` or ``(1, 1)``.

Inputs with NaN or Inf are refused (:class:`NonFiniteWeightError`); tensors that are not 2-D
are refused (:class:`Fp8ShapeError`). Ragged shapes are accepted, like vLLM does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

E4M3_MAX = 448.0
"""Largest finite ``torch.float8_e4m3fn`` value."""
AMAX_FLOOR = 1e-4
"""Lower bound applied to a block's amax before the scale is derived (zero blocks get it)."""
FP8_DTYPE = torch.float8_e4m3fn
GRANULARITIES = ("block", "channel", "tensor")


class Fp8Error(ValueError):
    """Base of every FP8 quantization, delta and payload error; nothing was written."""


class Fp8ShapeError(Fp8Error):
    """A weight is not 2-D, or a scale tensor does not match its weight's block grid."""


class NonFiniteWeightError(Fp8Error):
    """A weight to quantize holds NaN or Inf."""


@dataclass(frozen=True)
class Fp8Scheme:
    """How weights are cut into scaled blocks.

    Attributes:
        granularity: ``block`` (``block`` x ``block`` tiles), ``channel`` (one scale per
            output row) or ``tensor`` (one scale).
        block: ``(rows, cols)`` of a block for the ``block`` granularity.
    """

    granularity: str = "block"
    block: tuple[int, int] = (128, 128)

    def __post_init__(self):
        if self.granularity not in GRANULARITIES:
            raise Fp8Error(f"unknown FP8 granularity {self.granularity!r}; known {GRANULARITIES}")
        if len(self.block) != 2 or min(self.block) < 1:
            raise Fp8Error(f"block must be two positive sizes, got {self.block!r}")

    @property
    def scale_suffix(self) -> str:
        """Suffix replacing ``weight`` in the scale tensor's name (vLLM's parameter names)."""
        return "weight_scale_inv" if self.granularity == "block" else "weight_scale"

    def block_for(self, shape: tuple[int, ...]) -> tuple[int, int]:
        """Block size used for a weight of ``shape``."""
        m, n = check_matrix_shape(shape)
        if self.granularity == "channel":
            return 1, n
        if self.granularity == "tensor":
            return m, n
        return int(self.block[0]), int(self.block[1])

    def grid(self, shape: tuple[int, ...]) -> tuple[int, int]:
        """Shape of the scale tensor of a weight of ``shape``."""
        (m, n), (bm, bn) = check_matrix_shape(shape), self.block_for(shape)
        return -(-m // bm), -(-n // bn)


def check_matrix_shape(shape, name: str = "weight") -> tuple[int, int]:
    """``(m, n)`` of a non-empty 2-D shape, or :class:`Fp8ShapeError`."""
    shape = tuple(int(s) for s in shape)
    if len(shape) != 2 or min(shape) < 1:
        raise Fp8ShapeError(f"{name}: FP8 block quantization needs a non-empty 2-D weight, got shape {list(shape)}")
    return shape


def check_finite(name: str, values: torch.Tensor, where: str = "") -> None:
    """Raise :class:`NonFiniteWeightError` naming the first NaN/Inf element of ``values``."""
    bad = ~torch.isfinite(values)
    if bool(bad.any()):
        first = int(bad.reshape(-1).nonzero()[0])
        raise NonFiniteWeightError(f"{name}: {int(bad.sum())} NaN/Inf values{where}, first at flat index {first} "
                                   f"({float(values.reshape(-1)[first])}); refusing to quantize")


def scale_inv_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """fp32 dequantization scale of each block from its fp32 ``amax`` (step 2)."""
    return amax.to(torch.float32).clamp(min=AMAX_FLOOR) / E4M3_MAX


def quantize_values(values: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """e4m3 of ``values`` with the (broadcast) fp32 ``scale_inv`` of their blocks (step 3)."""
    return quantize_with_reciprocal(values, 1.0 / scale_inv.to(torch.float32))


def quantize_with_reciprocal(values: torch.Tensor, reciprocal: torch.Tensor) -> torch.Tensor:
    """Step 3 given ``reciprocal = 1.0 / scale_inv`` (fp32, computed once per block)."""
    scaled = values.to(torch.float32) * reciprocal
    return scaled.clamp_(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)


def _padded_blocks(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``w`` zero-padded to whole blocks, viewed as ``(gm, bm, gn, bn)``."""
    (m, n), (bm, bn) = w.shape, block
    gm, gn = -(-m // bm), -(-n // bn)
    if (gm * bm, gn * bn) != (m, n):
        padded = torch.zeros((gm * bm, gn * bn), dtype=w.dtype, device=w.device)
        padded[:m, :n] = w
        w = padded
    return w.reshape(gm, bm, gn, bn)


def _blocks_and_amax(w: torch.Tensor, block: tuple[int, int], name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 padded blocks ``(gm, bm, gn, bn)`` of ``w`` and their exact amax; refuses NaN/Inf."""
    check_matrix_shape(w.shape, name)
    blocks = _padded_blocks(w.detach().to(torch.float32), block)
    amax = blocks.abs().amax(dim=(1, 3))
    if not bool(torch.isfinite(amax).all()):  # NaN and Inf propagate into their block's amax
        check_finite(name, w)
    return blocks, amax


def block_amax(w: torch.Tensor, block: tuple[int, int], name: str = "weight") -> torch.Tensor:
    """Exact fp32 ``max |w|`` of every block, shape = grid (step 1); refuses NaN/Inf."""
    return _blocks_and_amax(w, block, name)[1]


@dataclass(frozen=True)
class Fp8Weight:
    """A quantized weight: what an FP8 engine holds for it, plus the exact block maxima.

    Attributes:
        weight: ``float8_e4m3fn``, the weight's shape.
        scale: fp32 dequantization scales (``weight_scale_inv``), shape = grid.
        amax: fp32 exact block maxima before the floor (trainer-side state of the delta).
    """

    weight: torch.Tensor
    scale: torch.Tensor
    amax: torch.Tensor


def quantize(w: torch.Tensor, scheme: Fp8Scheme = Fp8Scheme(), name: str = "weight") -> Fp8Weight:
    """Quantize a whole 2-D weight with ``scheme`` (the formula of the module docstring)."""
    block = scheme.block_for(w.shape)
    blocks, amax = _blocks_and_amax(w, block, name)
    scale = scale_inv_from_amax(amax)
    m, n = w.shape
    q = quantize_values(blocks, scale[:, None, :, None])
    q = q.reshape(blocks.shape[0] * block[0], blocks.shape[2] * block[1])[:m, :n].contiguous()
    return Fp8Weight(q, scale.contiguous(), amax.contiguous())


def expand_scales(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """Per-element scale of a ``shape`` weight from its block ``scale`` grid."""
    full = scale.repeat_interleave(block[0], dim=0).repeat_interleave(block[1], dim=1)
    return full[: shape[0], : shape[1]]


def dequantize(q: torch.Tensor, scale: torch.Tensor, scheme: Fp8Scheme = Fp8Scheme(),
               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``q * scale`` per block in fp32, cast to ``dtype`` (what a weight-only FP8 forward uses)."""
    check_scale_shape(q.shape, scale.shape, scheme)
    full = expand_scales(scale.to(torch.float32), tuple(q.shape), scheme.block_for(q.shape))
    return (q.to(torch.float32) * full).to(dtype)


def check_scale_shape(weight_shape, scale_shape, scheme: Fp8Scheme, name: str = "weight") -> None:
    """:class:`Fp8ShapeError` unless ``scale_shape`` is the block grid of ``weight_shape``."""
    want = scheme.grid(check_matrix_shape(weight_shape, name))
    if tuple(int(s) for s in scale_shape) != want:
        raise Fp8ShapeError(f"{name}: scale shape {list(scale_shape)} does not match the {scheme.granularity} grid "
                            f"{list(want)} of weight shape {list(weight_shape)} "
                            f"(block {scheme.block_for(weight_shape)})")
