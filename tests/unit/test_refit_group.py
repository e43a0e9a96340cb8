"""The trainer group over a transport, the canonical source with a model-wide table, and the
per-engine-rank view check of the refit (a replica the summed checksums count once)."""

from __future__ import annotations

import concurrent.futures as cf
import threading

import pytest
import torch

from nemo_dcr.apply.placement import assign_primary
from nemo_dcr.apply.probe import probe_engine
from nemo_dcr.apply import TensorEngine
from nemo_dcr.config.schema import DcrConfig
from nemo_dcr.integrations.vllm.worker import set_loader
from nemo_dcr.refit import DeltaRefit, EngineServer, engine_wiring
from nemo_dcr.refit.canonical import CanonicalSource
from nemo_dcr.refit.group import LocalGroup, TransportGroup
from nemo_dcr.transport import Envelope, InProcHub, MessageKind
from nemo_dcr.transport.base import TransportTimeout
from nemo_dcr.types import int_view
from nemo_dcr.verify.checksum import MASK64
from tests.standins.vllm_standin import StandinDims, StandinModel, canonical_shapes


def _run(world: int, fn):
    """``fn(group)`` on every member of a group over an in-process hub, at the same time."""
    hub = InProcHub(world)
    groups = [TransportGroup(hub.transport(r), range(world), timeout=5) for r in range(world)]
    with cf.ThreadPoolExecutor(world) as ex:
        return [f.result() for f in [ex.submit(fn, g) for g in groups]]


def test_transport_group_collectives():
    big = MASK64 - 5

    def body(g: TransportGroup):
        r = g.rank
        got = g.exchange([f"{r}->{d}".encode() for d in range(g.size)])
        return (got, g.sum_u64({"a": big, "b": r}, ["a", "b", "c"]), g.all_true(r != 1), g.all_true(True),
                g.sum_ints([r, 10 * r]), g.max_floats([float(r), -float(r)]))

    out = _run(3, body)
    for r, (got, sums, some, every, ints, floats) in enumerate(out):
        assert got == [f"{s}->{r}".encode() for s in range(3)]
        assert sums == {"a": (3 * big) % (1 << 64), "b": 3, "c": 0}
        assert (some, every, ints, floats) == (False, True, [3, 30], [2.0, 0.0])


def test_transport_group_drops_leftovers_of_an_earlier_epoch_and_names_a_missing_member():
    hub = InProcHub(2)
    a, b = (TransportGroup(hub.transport(r), [0, 1], timeout=0.3) for r in range(2))
    with pytest.raises(TransportTimeout, match="rank 1: no contribution to collective 1 from transport rank 0"):
        b.exchange([b"", b"lost"])  # a failed sync: b ran a collective that a never joined
    a.restart(2)
    b.restart(2)
    with cf.ThreadPoolExecutor(2) as ex:
        fa, fb = ex.submit(a.all_true, True), ex.submit(b.all_true, False)
        assert fa.result() is False and fb.result() is False
    assert a.stale_dropped == 1
    with pytest.raises(ValueError, match="one buffer per member"):
        a.exchange([b"x"])


def test_canonical_source_holds_a_part_of_a_model_wide_table():
    table = {"x.weight": ("bf16", (4, 2)), "y.weight": ("bf16", (3,))}
    src = CanonicalSource({"y.weight": torch.ones(3, dtype=torch.bfloat16)}, canonical=table)
    assert src.canonical == table and list(src.params) == ["y.weight"] and src.ranges == {"y.weight": (0, 3)}
    assert [p.name for p in src.pieces()] == ["y.weight"]
    with pytest.raises(ValueError, match=r"y\.weight: held \('bf16', \(4,\)\)"):
        CanonicalSource({"y.weight": torch.ones(4, dtype=torch.bfloat16)}, canonical=table)


# -- a replica the summed checksums do not see --------------------------------------------------

D, KEY = StandinDims(), b"k" * 32


class _Lossy:
    """A transport endpoint that loses the first payload part for ``dst`` once armed."""

    def __init__(self, inner, dst: int):
        self.inner, self.rank, self.dst, self.armed, self.lost = inner, inner.rank, dst, False, 0

    def send(self, dst, env):
        if self.armed and dst == self.dst and env.kind == MessageKind.DELTA and env.body:
            self.armed, self.lost = False, self.lost + 1
            return
        self.inner.send(dst, env)

    def flush(self):
        self.inner.flush()

    def recv(self, src=None, timeout=None):
        return self.inner.recv(src, timeout)


def _placed(transport_of):
    """SmolLM-shaped weights, two stand-in vLLM TP ranks (routed views) served over an in-process
    hub, the refit over trainer transport ``transport_of(hub endpoint 0)``, a function stopping
    the servers, and that transport."""
    shapes = canonical_shapes(D)
    g = torch.Generator().manual_seed(0)
    weights = {n: torch.randn(s, generator=g).bfloat16() for n, s in shapes.items()}
    models = [StandinModel(D, 2, r) for r in range(2)]
    probed = [probe_engine(m, shapes, set_loader).placement for m in models]
    placements = assign_primary(probed)
    hub = InProcHub(3)
    servers = [EngineServer(TensorEngine({n: p.data for n, p in m.named_parameters()}, key=KEY, placement=pl),
                            hub.transport(1 + r), [0]) for r, (m, pl) in enumerate(zip(models, placements))]
    threads = [threading.Thread(target=s.serve, daemon=True) for s in servers]
    for t in threads:
        t.start()
    trainer = transport_of(hub.transport(0))
    cfg = DcrConfig(transport="inprocess", reply_timeout_s=60, telemetry_encodings=[])
    refit = DeltaRefit(cfg, CanonicalSource(weights), engine_wiring(trainer, [0], [1, 2], LocalGroup()), key=KEY)

    def stop():
        for e in (1, 2):
            trainer.send(e, Envelope(MessageKind.STOP, 0, 0))
        for t in threads:
            t.join(5)

    return weights, models, refit, stop, trainer


def test_a_replica_that_missed_a_version_is_found_by_its_own_view_checksums():
    weights, models, refit, stop, lossy = _placed(lambda t: _Lossy(t, dst=2))
    assert refit.attach().committed
    weights["model.norm.weight"].view(torch.int16)[0] += 1  # only the norm: replicated, primary on rank 1
    lossy.armed = True
    r = refit.step()
    assert lossy.lost == 1 and r.committed and r.resynced, r
    assert any("MissingPartError" in d for d in r.detected)
    for m in models:  # rank 2's norm included: only its own view checksum shows it missed the version
        ref = StandinModel(D, 2, m.layers[0].self_attn.qkv_proj.rank)
        ref.load_weights(weights.items())
        live = dict(m.named_parameters())
        assert all(torch.equal(int_view(p.data), int_view(live[n].data)) for n, p in ref.named_parameters())
    stop()


def test_the_live_check_is_asked_before_the_mirror_commits_and_agreeing_views_exchange_nothing():
    events = []

    class Recording(_Lossy):
        def send(self, dst, env):
            if env.kind == MessageKind.QUERY:
                events.append(("query", dst))
            self.inner.send(dst, env)

    weights, models, refit, stop, _ = _placed(lambda t: Recording(t, dst=None))
    assert refit.attach().committed
    mirror, group = refit.sender.mirror, refit.group
    commit, exchange = mirror.commit, group.exchange
    mirror.commit = lambda *a, **k: (events.append(("commit",)), commit(*a, **k))[1]
    group.exchange = lambda out: (events.append(("exchange",)), exchange(out))[1]
    for step in range(2):
        events.clear()
        weights["model.layers.0.mlp.down_proj.weight"].view(torch.int16)[step, :3] += 1
        r = refit.step()
        assert r.committed and not r.resynced and r.verify.live and r.verify.ok, r
        # the one exchange is the route's; the sampled check's query to both engine ranks goes
        # out before this rank commits its mirror (the engines compute it meanwhile), and views
        # that agree need no exchange of rows
        assert events == [("exchange",), ("query", 1), ("query", 2), ("commit",)], events
    stop()
