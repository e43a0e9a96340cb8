"""`nemo-dcr chaos`: the refit path on megatron-core shards (TP=2, PP=2) into a transformers
engine in a process of its own; every fault kind injected once (the transport's, the
transaction's, and real process faults: SIGKILLs of the engine and of a trainer rank, a stall, a
full disk), each detection counted from what the engine or the supervisor saw, bit-exact against
an independent dense export after every refit, mixed versions measured from the rollouts."""

from __future__ import annotations

import pytest

from nemo_dcr.tools.chaos import FAULTS, ChaosConfig, run_chaos
from nemo_dcr.tools.chaos.faults import FAILS_BY_DESIGN

pytestmark = pytest.mark.distributed


def _each_once(faults: tuple[str, ...]) -> int:
    """Refits for every kind once at fault rate 1 (a recovery refit follows a failing kind)."""
    return 1 + len(faults) + sum(f in FAILS_BY_DESIGN for f in faults)


def _all_caught(report: dict) -> None:
    assert report["bit_exact_after_every_refit"], report
    assert report["mixed_version_served"] == 0 and report["rollouts"] > 0
    assert report["detected"] == report["recovered"] == report["faults_injected"], report["by_fault"]
    assert report["refusals_without_fault"] == 0 and report["failed_without_fault"] == 0


def test_chaos_every_fault_detected_and_recovered():
    faults = tuple(f for f in FAULTS if f != "disk-full")
    report = run_chaos(ChaosConfig(refits=_each_once(faults), faults=faults, seed=0, fault_rate=1.0), timeout=1200)
    assert report["trainer"].startswith("megatron-core")
    _all_caught(report)
    assert all(v["injected"] >= 1 for v in report["by_fault"].values()), report["by_fault"]
    assert report["restarts"]["engine"] >= 1 and report["restarts"]["trainer_jobs"] >= 1
    assert {d["code"] for d in report["deaths"]} >= {-9}


def test_full_disk_refused_then_recovered_on_the_store_transport():
    report = run_chaos(ChaosConfig(refits=4, faults=("disk-full", "kill-engine"), seed=1, fault_rate=1.0,
                                   transport="store"), timeout=900)
    _all_caught(report)
    assert report["by_fault"]["disk-full"]["injected"] == 1, report["by_fault"]


def test_corruption_without_a_key_is_caught_by_the_codec_rules():
    """No MAC: every corrupted payload must be refused by the codec's own structural checks."""
    report = run_chaos(ChaosConfig(refits=4, faults=("corrupt",), seed=5, fault_rate=1.0, keyed=False), timeout=600)
    _all_caught(report)
    assert report["by_fault"]["corrupt"]["injected"] == 3
    assert not any("AuthenticationError" in k for k in report["detected_by"])
