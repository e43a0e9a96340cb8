"""What vLLM does after loading, judged without vLLM (``nemo_dcr.integrations.vllm.kinds`` on
stand-in modules): kernel backends that shuffle expert weights and quantized layers are refused
naming the backend, in-place backends pass, views of placed params are in place, engine features
that move weights behind the placement are refused, and the truth check's verdict follows its
findings."""

from __future__ import annotations

from enum import Enum
from types import SimpleNamespace

import pytest
import torch

from nemo_dcr.apply.probe import Kind, ParamTruth, Probe, ProbeStats
from nemo_dcr.integrations.vllm import kinds
from nemo_dcr.integrations.vllm.check import EXIT_DIFFERS, EXIT_EXACT, EXIT_REFUSED, EngineCheck
from nemo_dcr.integrations.vllm.verify import StateDiff


class Backend(Enum):
    FLASHINFER_TRTLLM = "FlashInfer TRTLLM"
    TRITON = "TRITON"
    CPU = "CPU"


def _method(name: str, backend: Backend | None = None):
    return type(name, (), {})() if backend is None else type(name, (), {"unquantized_backend": backend})()


def _model(method):
    model = torch.nn.Module()
    model.experts = torch.nn.Module()
    model.experts.w13_weight = torch.nn.Parameter(torch.zeros(2, 4, 3, dtype=torch.bfloat16), requires_grad=False)
    model.experts.w13_bias = torch.nn.Parameter(torch.zeros(2, 4, dtype=torch.bfloat16), requires_grad=False)
    model.experts.quant_method = method
    model.experts.register_buffer("w13_t", model.experts.w13_weight.data[0])  # a view of a placed param
    return model


def _probe(model) -> Probe:
    params = {n: ParamTruth(n, Kind.IN_PLACE, (f"hf.{n}",), "sparse writes in place") for n, _ in model.named_parameters()}
    return Probe({}, {}, {}, params, {}, {}, ProbeStats(0, 0, 0, 0, 0))


@pytest.mark.parametrize("backend,packed,refused", [(Backend.TRITON, False, False), (Backend.CPU, True, False),
                                                     (Backend.FLASHINFER_TRTLLM, False, True)])
def test_moe_backends_are_in_place_followed_or_refused_by_name(backend, packed, refused):
    model = _model(_method("UnquantizedFusedMoEMethod", backend))
    probe = _probe(model)
    kinds.mark_views(model, probe)
    kinds.check_backends(model, probe, {"experts.w13_weight"} if packed else set())
    w13 = probe.params["experts.w13_weight"]
    assert probe.params["buffer:experts.w13_t"].kind == Kind.IN_PLACE  # a view: written with its base
    if refused:
        assert "FLASHINFER_TRTLLM fused-MoE backend rearranges expert weights" in kinds.refusals(probe)["experts.w13_weight"]
    else:
        assert kinds.refusals(probe) == {}
        assert w13.kind == (Kind.REARRANGED if packed else Kind.IN_PLACE)
        assert probe.params["experts.w13_bias"].kind == Kind.IN_PLACE  # the CPU kernel packs weights only


def test_quantized_layers_are_refused_naming_the_method():
    model = _model(_method("Fp8MoEMethod"))
    probe = _probe(model)
    kinds.check_backends(model, probe, set())
    assert kinds.refusals(probe)["experts.w13_weight"].startswith("quantized by Fp8MoEMethod")


def test_engine_features_that_move_weights_are_refused():
    drafter = SimpleNamespace(method="mtp", draft_model_config=object())
    config = SimpleNamespace(parallel_config=SimpleNamespace(enable_eplb=True), speculative_config=drafter)
    assert sorted(kinds.check_engine_features(config)) == ["parallel_config.enable_eplb", "speculative_config"]
    ngram = SimpleNamespace(parallel_config=SimpleNamespace(enable_eplb=False),
                            speculative_config=SimpleNamespace(method="ngram", draft_model_config=None))
    assert kinds.check_engine_features(ngram) == {}


def test_the_check_verdict_and_exit_codes():
    ok = EngineCheck(refits=[dict(version=1, mode="attach", changed=1, committed=True, resynced=True, seconds=0,
                                  detected="")], tokens_equal=True)
    assert ok.exact and ok.exit_code == EXIT_EXACT and ok.lines()[-1] == "BIT-EXACT"
    bad = EngineCheck(refits=ok.refits, tokens_equal=True, differences=[StateDiff(0, "param:w", 3, 8)])
    assert bad.exit_code == EXIT_DIFFERS and "differs from a fresh engine: rank 0 param:w: 3 of 8 elements differ" in bad.lines()
    assert EngineCheck(refused={"w": "quantized"}).exit_code == EXIT_REFUSED
    recovered = EngineCheck(refits=ok.refits * 2, tokens_equal=True)
    recovered.refits[1] = dict(ok.refits[0], mode="delta")
    assert recovered.exit_code == EXIT_DIFFERS  # a delta refit needed a recovery resync
