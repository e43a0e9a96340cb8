"""FP8 rollout weights: the engine's quantizer, the trainer-side FP8 delta, engine-side checks.

Usage::

    from nemo_dcr import quant
    plan = quant.Fp8Plan.build({n: t.shape for n, t in bf16_state.items()})
    engine, amax = plan.quantize_model(bf16_state)             # full load / resync
    fp8_deltas, new_amax, stats = plan.deltas(bf16_deltas, new_state, amax)
    payload = codec.encode_deltas(fp8_deltas, engine_bits)      # same codec, fp8 + fp32 records
    quant.check_fp8_payload(engine, codec.decode(payload, engine).deltas, plan)  # engine, before apply
"""

from nemo_dcr.quant.check import (
    Fp8PayloadError,
    Fp8TransactionCheck,
    check_fp8_changes,
    check_fp8_payload,
    check_fp8_tensor,
)
from nemo_dcr.quant.delta import Fp8DeltaStats, Fp8TensorDelta, fp8_delta, requantized_delta, scale_tensor_name
from nemo_dcr.quant.fp8 import (
    AMAX_FLOOR,
    E4M3_MAX,
    Fp8Error,
    Fp8Scheme,
    Fp8ShapeError,
    Fp8Weight,
    NonFiniteWeightError,
    block_amax,
    dequantize,
    quantize,
)
from nemo_dcr.quant.linear import Fp8Linear, to_fp8_linears
from nemo_dcr.quant.fp8_plan import DEFAULT_KEEP, REQUANTIZE_FRACTION, Fp8Plan, Fp8Rule

__all__ = [
    "AMAX_FLOOR", "DEFAULT_KEEP", "E4M3_MAX", "REQUANTIZE_FRACTION", "Fp8DeltaStats", "Fp8Error", "Fp8Linear",
    "Fp8PayloadError", "Fp8Plan", "Fp8Rule", "Fp8Scheme", "Fp8ShapeError", "Fp8TensorDelta", "Fp8TransactionCheck",
    "Fp8Weight", "NonFiniteWeightError", "block_amax", "check_fp8_changes", "check_fp8_payload", "check_fp8_tensor",
    "dequantize", "fp8_delta", "quantize", "requantized_delta", "scale_tensor_name", "to_fp8_linears",
]
