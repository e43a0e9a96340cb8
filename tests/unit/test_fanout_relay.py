"""Fan-out (refit/relay.py): relay groups from the engine layout, where the owners send, config
errors, replicas of one view only, and a replica that failed a version resynced alone (the relay
itself runs over torch.distributed: tests/distributed/test_fanout.py)."""

from __future__ import annotations

import threading

import pytest
import torch

from nemo_dcr.apply import InjectedFault, TensorEngine
from nemo_dcr.apply.placement import assign_primary
from nemo_dcr.apply.probe import probe_engine
from nemo_dcr.config.schema import ConfigError, DcrConfig
from nemo_dcr.integrations.vllm.worker import set_loader
from nemo_dcr.refit import DeltaRefit, EngineServer, engine_wiring
from nemo_dcr.refit.canonical import CanonicalSource
from nemo_dcr.refit.group import LocalGroup
from nemo_dcr.refit.relay import RelayPlan, relay_groups, relay_plan
from nemo_dcr.transport import Envelope, InProcHub, MessageKind, TransportTimeout
from nemo_dcr.types import int_view
from tests.standins.vllm_standin import StandinDims, StandinModel, canonical_shapes

KEY = b"k" * 32


def test_relay_groups_from_the_engine_layout():
    assert relay_groups([1, 2, 3, 4], 1) == [[1, 2, 3, 4]]
    assert relay_groups([1, 2, 3, 4], 2) == [[1, 3], [4, 2]]  # TP=2 x 2 replicas: a group per TP rank, roots spread
    nodes = ["a", "a", "b", "b", "a", "a", "b", "b"]  # replicas 0, 2 on node a; 1, 3 on node b
    assert relay_groups(range(8), 2, nodes, roots="node") == [[0, 4], [2, 6], [3, 7], [5, 1]]
    with pytest.raises(ConfigError, match="engine.replicas: 5 engine ranks are not whole replicas of 2"):
        relay_groups(range(5), 2)
    with pytest.raises(ConfigError, match="dcr.fanout_roots: node roots need the node of every engine rank"):
        relay_groups(range(4), 1, roots="node")
    with pytest.raises(ConfigError, match="dcr.fanout_roots: must be one of"):
        relay_groups(range(4), 1, roots="rack")


def test_destinations_cross_once_per_group_and_resync_a_replica_alone():
    plan = RelayPlan(((1, 3), (2, 4)))
    assert plan.relaying and plan.destinations([1, 2, 3, 4]) == [(1, 2), (2, 2)]
    assert plan.destinations([3]) == [(3, 1)]  # a replica that failed: its own send, no relay
    assert plan.destinations([1, 4]) == [(1, 2), (4, 1)]  # a root's relay reaches its replicas too
    assert RelayPlan.direct([1, 2]).destinations([1, 2]) == [(1, 1), (2, 1)]


def test_fanout_config_and_plan_errors():
    with pytest.raises(ConfigError, match=r"dcr.fanout: must be one of \['direct', 'relay'\], got 'tree'"):
        DcrConfig.from_mapping({"fanout": "tree"})
    with pytest.raises(ConfigError, match="dcr.fanout_roots: must be one of"):
        DcrConfig(fanout_roots="rack").validate()
    assert relay_plan(DcrConfig(), [1, 2], None) == RelayPlan.direct([1, 2])  # unset: nothing to relay over
    assert relay_plan(DcrConfig(), [1, 2], [[1, 2]]).relaying  # unset: relay where the engines offer it
    assert not relay_plan(DcrConfig(fanout="direct"), [1, 2], [[1, 2]]).relaying
    with pytest.raises(ConfigError, match=r"dcr.fanout: relay needs the engines' relay groups"):
        relay_plan(DcrConfig(fanout="relay"), [1, 2], None)
    with pytest.raises(ConfigError, match=r"must hold every engine rank \[1, 2, 3\] exactly once"):
        relay_plan(DcrConfig(fanout="relay"), [1, 2, 3], [[1, 2], [2, 3]])


def _serve(engines, hub):
    servers = [EngineServer(e, hub.transport(1 + r), [0]) for r, e in enumerate(engines)]
    threads = [threading.Thread(target=s.serve, daemon=True) for s in servers]
    for t in threads:
        t.start()
    return servers, threads


def _stop(hub, threads):
    t = hub.transport(0)
    for e in range(1, len(threads) + 1):
        t.send(e, Envelope(MessageKind.STOP, 0, 0))
    for th in threads:
        th.join(5)


def test_relay_groups_hold_replicas_of_one_view_only():
    d = StandinDims()
    shapes = canonical_shapes(d)
    weights = {n: torch.randn(s, generator=torch.Generator().manual_seed(0)).bfloat16() for n, s in shapes.items()}
    models = [StandinModel(d, 2, r % 2) for r in range(4)]  # replica-major: TP ranks 0, 1, 0, 1
    probed = [probe_engine(m, shapes, set_loader).placement for m in models]
    for m in models:
        m.load_weights(weights.items())  # the engines hold the trainer's weights: attach sends nothing
    engines = [TensorEngine({n: p.data for n, p in m.named_parameters()}, key=KEY, placement=pl)
               for m, pl in zip(models, assign_primary(probed))]
    hub = InProcHub(5)
    _, threads = _serve(engines, hub)
    cfg = DcrConfig(transport="inprocess", fanout="relay", reply_timeout_s=30, telemetry_encodings=[])
    wrong = engine_wiring(hub.transport(0), [0], [1, 2, 3, 4], LocalGroup(), relay=[[1, 2], [3, 4]])
    with pytest.raises(ValueError, match=r"relay group \[1, 2\]: engine rank 2 holds other views than its root 1"):
        DeltaRefit(cfg, CanonicalSource(weights), wrong, key=KEY).attach()
    right = engine_wiring(hub.transport(0), [0], [1, 2, 3, 4], LocalGroup(), relay=relay_groups([1, 2, 3, 4], 2))
    r = DeltaRefit(cfg, CanonicalSource(weights), right, key=KEY).attach()
    assert r.committed and r.payload_bytes == 0 and r.bytes_on_links["engine_fanout"] == 0
    _stop(hub, threads)


def test_a_replica_that_failed_a_version_is_resynced_alone():
    """Three whole-tensor replicas, direct: the one whose apply fails rolls back and is resynced
    alone to the version the others committed (they apply nothing more)."""
    g = torch.Generator().manual_seed(1)
    weights = {f"w{i}": torch.randn(512, generator=g).bfloat16() for i in range(3)}
    engines = [TensorEngine({n: torch.zeros_like(t) for n, t in weights.items()}, key=KEY) for _ in range(3)]
    armed = []

    def fail(name):
        if armed:
            armed.pop()
            raise InjectedFault(f"replica 1 fails after writing {name}")

    engines[1].fault = fail
    hub = InProcHub(4)
    servers, threads = _serve(engines, hub)
    cfg = DcrConfig(transport="inprocess", reply_timeout_s=30, telemetry_encodings=[])
    refit = DeltaRefit(cfg, CanonicalSource(weights), engine_wiring(hub.transport(0), [0], [1, 2, 3], LocalGroup()),
                       key=KEY)
    assert refit.attach().committed
    for step in range(2):
        weights["w0"].view(torch.int16)[step::7] += 1
        armed.append(step == 1)
        if not armed[-1]:
            armed.pop()
        r = refit.step()
        assert r.committed and r.version == 2 + step and [e.version for e in engines] == [r.version] * 3
        for e in engines:
            assert all(torch.equal(int_view(e.tensors[n]), int_view(t)) for n, t in weights.items())
    assert r.resynced and any("InjectedFault" in d for d in r.detected), r
    assert [s.stats.resyncs for s in servers] == [1, 2, 1]  # the attach, and replica 1's alone
    assert [v for v, what, _ in servers[0].stats.events if what == "committed"] == [1, 2, 3]
    _stop(hub, threads)


def test_a_lost_replica_is_detached_and_its_group_goes_direct():
    from nemo_dcr.refit.messages import EngineReply
    from nemo_dcr.refit.replicas import Replicas

    reps = Replicas.of(RelayPlan(((1, 2, 3), (4, 5), (6,))))
    assert reps.plan().groups == ((1, 2, 3), (4, 5), (6,))
    assert reps.lose(6) is None and not reps.detached  # alone in its views: not detached
    assert reps.lose(1) == [2, 3]  # the root: its replicas need the version directly
    assert reps.plan().groups == ((2,), (3,), (4, 5), (6,)) and reps.live([1, 2, 3, 4, 5, 6]) == [2, 3, 4, 5, 6]
    assert reps.lose(1) == [] and reps.lose(2) == [3] and reps.lose(3) is None  # the last replica stays
    ok = EngineReply(True, 7)
    # group (4, 5) whole: its relay carried the bytes to 5; the broken group counts who answered
    via = [(2, 10, ()), (3, 10, ()), (4, 10, (5,))]
    assert reps.relayed(via, {(4, 5)}, {5: ok}, set()) == 10
    assert reps.relayed([(1, 10, (2, 3))], {(1, 2, 3)}, {3: ok}, {2}) == 10
    reps.reattach([1, 2])
    assert reps.plan().groups == ((1,), (2,), (3,), (4, 5), (6,))  # back, its group stays direct
    with pytest.raises(ValueError, match=r"engine ranks \[4\] are not detached"):
        reps.reattach([4])


def test_agreeing_on_detached_ranks_sums_the_reply_flags_in_the_same_collective():
    import concurrent.futures as cf

    from nemo_dcr.refit.group import TransportGroup
    from nemo_dcr.refit.replicas import Replicas

    def members(lost: list[int | None], flags: list[list[int]]):
        hub = InProcHub(2)
        groups = [TransportGroup(hub.transport(r), range(2), timeout=5) for r in range(2)]
        reps = [Replicas.of(RelayPlan(((1, 2), (3,)))) for _ in range(2)]
        for rep, e in zip(reps, lost):
            if e is not None:
                rep.lose(e)
        with cf.ThreadPoolExecutor(2) as ex:
            outs = [ex.submit(rep.agree, g, [1, 2, 3], f) for rep, g, f in zip(reps, groups, flags)]
            return [o.result() for o in outs], reps

    # no trainer rank detached anything new: the flags' sums hold for every rank
    (a, b), _ = members([None, None], [[1, 0], [0, 1]])
    assert a == b == ([], [1, 1])
    # only trainer rank 0 had lost engine rank 1: rank 1 detaches it now, and the flags (counted
    # over different sets of engine ranks) are not used by either rank
    (a, b), reps = members([1, None], [[0, 0], [1, 1]])
    assert a == ([], None) and b == ([1], None) and reps[1].detached == {1}
    (a, b), _ = members([1, 1], [[0, 1], [0, 0]])  # both had: the same sets, the sums hold
    assert a == b == ([], [0, 1])


def test_peers_number_envelopes_by_refit_rank_and_replace_a_connection():
    from nemo_dcr.transport.peers import Peers

    hubs = [InProcHub(2), InProcHub(2)]
    trainer = Peers(0, {5: (hubs[0].transport(0), 1), 6: (hubs[1].transport(0), 1)})
    engines = [Peers(5, {0: (hubs[0].transport(1), 0)}), Peers(6, {0: (hubs[1].transport(1), 0)})]
    trainer.send(6, Envelope(MessageKind.DELTA, 3, 0, body=b"x"))
    got = engines[1].recv(timeout=1)
    assert (got.sender, got.receiver, got.body) == (0, 6, b"x")
    engines[0].send(0, Envelope(MessageKind.ACK, 3, 5))
    assert trainer.recv(src=5, timeout=1).sender == 5
    with pytest.raises(TransportTimeout):
        trainer.recv(timeout=0.05)
    fresh = InProcHub(2)  # replica 5 restarted: a new connection, the other untouched
    trainer.replace(5, fresh.transport(0), 1)
    Peers(5, {0: (fresh.transport(1), 0)}).send(0, Envelope(MessageKind.ACK, 4, 5))
    assert trainer.recv(timeout=1).version == 4
    with pytest.raises(KeyError, match="7 is not a peer"):
        trainer.replace(7, fresh.transport(0), 1)
