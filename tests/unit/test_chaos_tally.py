"""The chaos report's own arithmetic: the fault schedule, and mixed versions measured from the
rollouts (a rollout whose weights moved, or differ from its version's checked weights, counts)."""

from __future__ import annotations

from nemo_dcr.tools.chaos.faults import FAILS_BY_DESIGN, FAULTS, schedule
from nemo_dcr.tools.chaos.tally import _mixed


def test_schedule_every_kind_and_a_recovery_refit_after_each_failing_kind():
    plan = schedule(40, FAULTS, seed=3, fault_rate=1.0)
    assert set(plan.values()) == set(FAULTS) and 1 not in plan
    for i, kind in plan.items():
        if kind in FAILS_BY_DESIGN:
            assert i + 1 not in plan
    assert plan == schedule(40, FAULTS, seed=3, fault_rate=1.0)
    assert schedule(40, FAULTS, seed=3, fault_rate=0.0) == {}
    for n in range(2, 30):  # a fault that fails by design always has its recovery refit
        assert all(k not in FAILS_BY_DESIGN for i, k in schedule(n, FAULTS, seed=n, fault_rate=1.0).items() if i == n)


def _rollout(version: int, before: str, after: str, gen: int = 0) -> dict:
    return dict(rollout=[version, before, after], gen=gen)


def test_mixed_versions_are_counted_from_what_the_rollouts_read():
    clean = [_rollout(1, "a", "a"), _rollout(1, "a", "a"), _rollout(2, "b", "b"),
             dict(check=["t", 2, "b", True], gen=0)]
    assert _mixed(clean) == (0, 3)
    moved = clean + [_rollout(2, "b", "c")]  # the weights changed during the generation
    assert _mixed(moved) == (1, 4)
    stray = clean + [_rollout(2, "x", "x")]  # same version, other weights than its check
    assert _mixed(stray) == (1, 4)
    other_engine = clean + [_rollout(2, "x", "x", gen=1)]  # a restarted engine's own version 2
    assert _mixed(other_engine) == (0, 4)


def test_a_refusal_reported_by_an_engine_rank_names_the_rank_s_error():
    from nemo_dcr.tools.chaos.tally import _error_names

    detail = "RankRefusedError: v7 refused; ranks that had written it rolled back []: rank 0: AuthenticationError: bad"
    assert _error_names(detail) == {"RankRefusedError", "AuthenticationError"}
    assert _error_names("InjectedFault: chaos: crash") == {"InjectedFault"}


def test_a_soak_s_memory_trace_takes_one_sample_per_interval_across_restarts():
    from nemo_dcr.tools.chaos.tally import _trace

    samples = [dict(t=1000.0 + 10 * i, engine=dict(pid=1 if i < 70 else 2, mb=100.0 + i),
                    trainers=dict(pid=9, mb=400.0)) for i in range(130)]
    trace = _trace(samples, every_s=600.0)
    assert [r["minute"] for r in trace] == [0.0, 10.0, 20.0]
    assert [r["engine"] for r in trace] == [100.0, 160.0, 220.0] and all(r["trainers"] == 400.0 for r in trace)


def test_chaos_refuses_a_duration_it_cannot_keep(capsys):
    from nemo_dcr.tools.cli import main

    for argv, what in ((["--duration", "-1"], "--duration >= 0"),
                       (["--duration", "600", "--timeout", "300"], "must be longer than --duration")):
        assert main(["chaos", *argv]) == 2
        assert what in capsys.readouterr().err
