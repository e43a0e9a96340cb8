"""The planner's fan-out model (``PlanSetup.fanout``, the library's ``dcr.fanout``): with a relay
the trainer-to-engine link carries each view once whatever the replicas, the relay roots pass the
rest on inside the rollout cluster; direct carries it once per replica.  The same identities hold
for the bytes the fan-out check measures (tests/distributed/test_fanout.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from nemo_dcr.layout import LayoutError, MegatronSpec, ParallelLayout, model_dims
from nemo_dcr.tools.planner import figures as F
from nemo_dcr.tools.planner.estimate import make_plan
from nemo_dcr.tools.planner.inputs import FANOUTS, EngineDeployment, PlanSetup
from nemo_dcr.tools.planner.presets import CPU_HOST, LOOPBACK

REPLICAS = (1, 2, 4)


def _phase(plan, name):
    return next(p.seconds for p in plan.path if p.name == name)


def test_relay_crosses_once_per_view_and_relays_the_rest():
    dims, fig = model_dims("smollm2"), F.default_figures(density=0.01)
    base = PlanSetup(ParallelLayout(tp=3), EngineDeployment(tp=3), links=replace(LOOPBACK, cross_cluster_gbps=0.1),
                     hardware=replace(CPU_HOST, gpus_per_node=3), placement="cross-cluster")
    plans = {(f, r): make_plan("smollm2", dims, replace(base, engine=EngineDeployment(tp=3, replicas=r), fanout=f),
                               fig, spec=MegatronSpec()) for f in FANOUTS for r in REPLICAS}
    one = plans["direct", 1].cross_link_bytes
    assert one > 0 and plans["relay", 1].cross_link_bytes == pytest.approx(one)
    for r in REPLICAS:
        direct, relay = plans["direct", r], plans["relay", r]
        assert direct.cross_link_bytes == pytest.approx(r * one) and direct.engine_fanout_bytes == 0
        assert relay.cross_link_bytes == pytest.approx(one)
        assert relay.engine_fanout_bytes == pytest.approx(relay.payload_bytes * (r - 1) / r)  # all but the roots
        assert relay.payload_bytes == pytest.approx(direct.payload_bytes)  # every replica gets its view
        assert [p.name for p in relay.path].count("relay") == (r > 1)
    assert _phase(plans["direct", 4], "send") > 3 * _phase(plans["direct", 1], "send")
    assert plans["relay", 4].refit_seconds <= 1.3 * plans["relay", 1].refit_seconds
    with pytest.raises(LayoutError, match="fanout 'tree'; known: direct, relay"):
        replace(base, fanout="tree").validate(dims)
