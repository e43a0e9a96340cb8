"""`nemo-dcr chaos`: separate trainer and engine processes over gloo, every fault kind injected,
bit-exact against an independent dense export after every refit, no mixed version served."""

from __future__ import annotations

import pytest

from nemo_dcr.refit.chaos import FAULTS, ChaosConfig, run_chaos

pytestmark = pytest.mark.distributed


def test_chaos_all_faults_recovered():
    report = run_chaos(ChaosConfig(refits=len(FAULTS) + 1, faults=FAULTS, seed=0, fault_rate=1.0), timeout=150)
    assert report["refits"] == len(FAULTS) + 1
    assert report["bit_exact_after_every_refit"]
    assert report["mixed_version_served"] == 0 and report["engine"]["reads"] > 0
    assert all(n == 1 for n in report["faults_injected"].values())
    injected = sum(report["faults_injected"].values())
    assert injected == len(FAULTS) and report["detected"] == injected and report["recovered"] == injected
