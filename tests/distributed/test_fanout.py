"""Fan-out inside the rollout cluster (`nemo_dcr.tools.fanout`): one trainer process and R = 2, 4
engine replicas in processes of their own over gloo, `dcr.fanout: direct` then `relay`.

Every replica is bit-exact after every refit against the trainer's own tensors (sha256 digests);
with relay the trainer-to-engine bytes of a version do not depend on R (the same bytes at R = 2
and 4, 1/R of direct), the relay root's broadcasts carry them to the other R - 1 replicas (as
measured on the root), and a replica that fails a version is resynced alone."""

from __future__ import annotations

import pytest

from nemo_dcr.tools.fanout import FanoutJob, run_fanout, summarize

pytestmark = pytest.mark.distributed
SIZES = (2, 4)


@pytest.fixture(scope="module")
def runs() -> dict[int, dict]:
    return {r: run_fanout(FanoutJob(r), timeout=300) for r in SIZES}


def _rows(run: dict, mode: str, clean: bool = True) -> list[dict]:
    return [r for r in run["rows"] if r["mode"] == mode and r["step"] > 0 and (r["failing"] is None or not clean)]


def test_every_replica_bit_exact_after_every_refit(runs):
    for r, run in runs.items():
        for row in run["rows"]:
            assert row["committed"] and all(row["bit_exact"]) and len(row["bit_exact"]) == r, row
            assert row["versions"] == [row["version"]] * r, row
        assert all(s["bit_exact_steps"] == s["steps"] == 6 for s in summarize(run))


def test_relay_crosses_once_per_view(runs):
    for mode, factor in (("direct", 2), ("relay", 1)):  # the same versions at R = 2 and 4
        two, four = _rows(runs[2], mode), _rows(runs[4], mode)
        assert [x["links"]["trainer_to_engine"] for x in four] == [factor * x["links"]["trainer_to_engine"]
                                                                   for x in two]
    for r, run in runs.items():
        direct, relay = summarize(run)
        assert relay["cross_link_bytes_per_version"] * r == pytest.approx(direct["cross_link_bytes_per_version"],
                                                                          rel=0.05)
        root = run["engines"][0]["relay"]["relay"]["by_version"]
        for row in _rows(run, "relay", clean=False):
            links = row["links"]
            assert links["engine_fanout"] == int(root[str(row["version"])])  # measured on the root
            if row["failing"] is None:
                assert links["engine_fanout"] == (r - 1) * links["trainer_to_engine"]
        for row in _rows(run, "direct", clean=False):
            assert row["links"]["engine_fanout"] == 0


def _events(run: dict, mode: str, replica: int, version: int) -> list[str]:
    return [what + ":" + detail for v, what, detail in run["engines"][replica][mode]["events"] if v == version]


def test_a_failing_replica_is_resynced_alone(runs):
    for r, run in runs.items():
        faults = [row for row in run["rows"] if row["failing"] is not None]
        assert [(x["mode"], x["step"], x["failing"]) for x in faults] == [("direct", 3, r - 1), ("relay", 3, r - 1),
                                                                          ("relay", 5, 0)]
        for row in faults:
            assert row["resynced"] and any("InjectedFault" in d for d in row["detected"]), row
            for k in range(r):
                ev = _events(run, row["mode"], k, row["version"])
                if k == row["failing"]:
                    assert ev[0].startswith("refused:InjectedFault") and ev[-1] == "committed:resync", ev
                else:  # the others committed the delta and applied nothing more
                    assert [e for e in ev if e.startswith("committed")] == ["committed:delta"], ev
        # the root resynced alone: its relay carried the resync, the replicas dropped it as a replay
        root_fault = faults[-1]
        assert all(any(e.startswith("replay") for e in _events(run, "relay", k, root_fault["version"]))
                   for k in range(1, r))


def test_the_planner_fan_out_model_matches_the_measured_bytes(runs):
    """``nemo-dcr plan --fanout``: direct over relay cross-link bytes, and relayed over crossed
    bytes, as the planner predicts them for R replicas and as this run measured them."""
    from dataclasses import replace

    from nemo_dcr.layout import MegatronSpec, ParallelLayout, model_dims
    from nemo_dcr.tools.planner import figures as F
    from nemo_dcr.tools.planner.estimate import make_plan
    from nemo_dcr.tools.planner.inputs import EngineDeployment, PlanSetup
    from nemo_dcr.tools.planner.presets import CPU_HOST, LOOPBACK

    dims, fig = model_dims("smollm2"), F.default_figures(density=0.01)
    base = PlanSetup(ParallelLayout(), EngineDeployment(), links=replace(LOOPBACK, cross_cluster_gbps=0.1),
                     hardware=CPU_HOST, placement="cross-cluster")
    for r, run in runs.items():
        direct, relay = summarize(run)
        plans = {f: make_plan("smollm2", dims, replace(base, engine=EngineDeployment(replicas=r), fanout=f), fig,
                              spec=MegatronSpec()) for f in ("direct", "relay")}
        predicted = plans["direct"].cross_link_bytes / plans["relay"].cross_link_bytes
        measured = direct["cross_link_bytes_per_version"] / relay["cross_link_bytes_per_version"]
        assert predicted == pytest.approx(r) and measured == pytest.approx(predicted, rel=0.05)
        relayed = plans["relay"].engine_fanout_bytes / plans["relay"].cross_link_bytes
        assert relay["engine_fanout_bytes_per_version"] / relay["cross_link_bytes_per_version"] == \
            pytest.approx(relayed, rel=0.02) == r - 1


# -- a replica killed mid-relay ----------------------------------------------------------------------
# Four replicas in two relay groups (one root per node: [1, 2] and [3, 4]); replica 1 (engine rank
# 2, a non-root) is SIGKILLed at refit 2 once the first part reached it through the relay, replica
# 2 (engine rank 3, the other group's root) at refit 4 once it had relayed the first part.  The
# supervisor restarts each as a fresh, empty process.
KILLS = {"relay:2": 1, "relay:4": 2}


@pytest.fixture(scope="module")
def killed() -> dict:
    job = FanoutJob(4, steps=5, modes=("relay",), faults={}, kills=KILLS, relay_nodes=(0, 0, 1, 1))
    return run_fanout(job, timeout=300)


def _commits(run: dict, replica: int) -> list[tuple[int, str]]:
    return [(v, detail) for v, what, detail in run["engines"][replica]["relay"]["events"] if what == "committed"]


def test_a_replica_killed_mid_relay_is_resynced_alone(killed):
    rows = killed["rows"]
    for row in rows:  # every replica bit-exact after every refit (the restarted ones after their resync)
        assert row["committed"] and all(row["bit_exact"]) and row["versions"] == [row["version"]] * 4, row
    for row in rows[1:]:  # no resync in any refit itself: only the reattach resyncs, and only the restarted one
        assert row["resynced_ranks"] == [] and row["kind"] == "delta", row
    kills = [(r["step"], r["killed"], r["detached"], r["reattach"]["resynced_ranks"]) for r in rows if r["killed"] is not None]
    assert kills == [(2, 1, [2], [2]), (4, 2, [3], [3])]
    for row in rows:
        assert (row["reattach"] is not None) == (row["killed"] is not None)
    # the restarted processes: a resync to the version the others committed, then deltas
    for replica, step in ((1, 2), (2, 4)):
        version = rows[step]["version"]
        assert killed["engines"][replica]["relay"]["generation"] == 1
        assert _commits(killed, replica) == [(version, "resync")] + [(v, "delta") for v in range(version + 1, 7)]
    # the survivors: the attach's resync, then a delta for every version, the killed ones included
    for replica in (0, 3):
        assert killed["engines"][replica]["relay"]["generation"] == 0
        assert _commits(killed, replica) == [(1, "resync")] + [(v, "delta") for v in range(2, 7)]
        assert killed["engines"][replica]["relay"]["relay"]["failed"]  # their group's relay broke with the kill


def test_survivors_of_a_killed_replica_get_deltas_directly(killed):
    """Bytes as sent: while both groups relay, each version crosses once per group; the group
    that lost a member gets it directly (one send per attached member); the survivor whose root
    died mid-version got that version once more, directly."""
    rows = killed["rows"]
    per = [r["links"] for r in rows]
    # refit 1: two roots sent the version, each relayed it to its other replica
    assert per[1]["engine_fanout"] == per[1]["trainer_to_engine"]
    # refit 2 (a non-root dies): the roots were sent the version once each; only group [3, 4] relayed it
    assert per[2]["trainer_to_engine"] == 2 * per[2]["engine_fanout"]
    # refit 3: group [1, 2] direct (two sends), group [3, 4] relays (one send, one relayed)
    assert per[3]["trainer_to_engine"] == 3 * per[3]["engine_fanout"]
    # refit 4 (root 3 dies after relaying part 0): 1, 2 and 3 sent, 4 once more directly, nothing relayed
    # refit 5: every replica direct
    for step in (4, 5):
        assert per[step]["engine_fanout"] == 0 and per[step]["trainer_to_engine"] % 4 == 0
    dup = [e for e in killed["engines"][3]["relay"]["events"] if e[0] == rows[4]["version"] and e[1] == "duplicate"]
    assert dup  # what the relay brought before the root died, the direct send brought again (dropped)
    # the reattach sent whole tensors to the restarted replica alone
    for step in (2, 4):
        assert rows[step]["reattach"]["links"]["trainer_to_engine"] > 10 * rows[step]["links"]["trainer_to_engine"]
        assert rows[step]["reattach"]["links"]["engine_fanout"] == 0
