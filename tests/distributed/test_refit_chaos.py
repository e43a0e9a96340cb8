"""`nemo-dcr chaos`: the refit path on megatron-core shards (TP=2, PP=2) and a separate engine
process over gloo; every fault kind injected, each detection counted from what the engine refused
or repaired, bit-exact against an independent dense export after every refit, no mixed version."""

from __future__ import annotations

import pytest

from nemo_dcr.tools.chaos import FAULTS, ChaosConfig, run_chaos

pytestmark = pytest.mark.distributed


def test_chaos_every_fault_detected_and_recovered():
    report = run_chaos(ChaosConfig(refits=len(FAULTS) + 1, faults=FAULTS, seed=0, fault_rate=1.0), timeout=600)
    assert report["refits"] == len(FAULTS) + 1 and report["trainer"].startswith("megatron-core")
    assert report["bit_exact_after_every_refit"], report
    assert report["mixed_version_served"] == 0 and report["engine"]["reads"] > 0
    assert all(n == 1 for n in report["faults_injected"].values())
    injected = sum(report["faults_injected"].values())
    assert report["detected"] == injected and report["recovered"] == injected, report["by_fault"]
    assert report["refusals_without_fault"] == 0
    assert report["engine"]["crashes"] == 1 and report["engine"]["duplicates_dropped"] > 0


def test_corruption_without_a_key_is_caught_by_the_codec_rules():
    """No MAC: every corrupted payload must be refused by the codec's own structural checks."""
    report = run_chaos(ChaosConfig(refits=4, faults=("corrupt",), seed=5, fault_rate=1.0, keyed=False), timeout=600)
    assert report["bit_exact_after_every_refit"] and report["faults_injected"]["corrupt"] == 3
    assert report["detected"] == 3 and report["recovered"] == 3, report["detected_by"]
    assert not any("AuthenticationError" in k for k in report["detected_by"])
