"""Refit pipeline in one process: trainer sender + engine server thread over the in-process transport."""

from __future__ import annotations

import threading

import pytest
import torch

from nemo_dcr.apply import InjectedFault, TensorEngine
from nemo_dcr.refit.sender import RefitConfig, RefitSender
from nemo_dcr.refit.group import LocalGroup
from tests.standins.shard_trainer import ShardTrainer
from nemo_dcr.refit.mirror import SenderMirror
from nemo_dcr.refit.routing import assign_owners, merge, pack, unpack
from nemo_dcr.refit.server import EngineServer
from nemo_dcr.transport import Envelope, InProcHub, MessageKind
from nemo_dcr.verify.report import VerifyPolicy

KEY = b"r" * 32
SHAPES = {"a.weight": (48, 32), "b.weight": (64, 16), "norm.weight": (32,)}


class Rig:
    def __init__(self, full_every: int = 3):
        self.hub = InProcHub(2)
        self.trainer = ShardTrainer(SHAPES, 0, 1)
        self.engine = TensorEngine({n: torch.zeros(s, dtype=torch.bfloat16) for n, s in SHAPES.items()}, key=KEY)
        self.server = EngineServer(self.engine, self.hub.transport(1), [0])
        self.thread = threading.Thread(target=self.server.serve, daemon=True)
        self.thread.start()
        self.config = RefitConfig(key=KEY, reply_timeout=5, verify=VerifyPolicy(True, full_every))
        self.sender = self.new_sender()

    def new_sender(self) -> RefitSender:
        owners = assign_owners({n: int(torch.tensor(s).prod()) for n, s in SHAPES.items()}, 1)
        mirror = SenderMirror({n: ("bf16", s) for n, s in SHAPES.items()})
        return RefitSender(self.config, LocalGroup(), self.hub.transport(0), [1], owners, mirror)

    def attach(self):
        out = self.sender.attach(self.trainer.pieces(0), self.trainer.checksums())
        if out.committed:
            self.trainer.commit(0)
        return out

    def refit(self, **kw):
        self.trainer.step()
        v = self.sender.mirror.version + 1
        out = self.sender.refit(self.trainer.pieces(v), self.trainer.checksums(), **kw)
        if out.committed:
            self.trainer.commit(v)
        return out

    def bit_exact(self) -> bool:
        return all(torch.equal(self.engine.tensors[n].view(torch.int16), p.view(torch.int16))
                   for n, p in self.trainer.params.items())

    def stop(self):
        self.hub.transport(0).send(1, Envelope(MessageKind.STOP, 0, 0))
        self.thread.join(5)


@pytest.fixture
def rig():
    r = Rig()
    yield r
    r.stop()


def test_attach_resyncs_then_sparse_refits_bit_exact(rig):
    first = rig.attach()
    assert first.committed and first.resynced and rig.bit_exact()
    for _ in range(4):
        out = rig.refit()
        assert out.committed and not out.resynced and out.verify.ok and rig.bit_exact()
        assert 0 < out.changed < sum(p.numel() for p in rig.trainer.params.values())
    assert rig.engine.version == 5 and rig.engine.guard.mixed_version_served == 0


@pytest.mark.parametrize("fault", ["drop", "corrupt", "skew", "crash"])
def test_faults_detected_and_recovered(rig, fault):
    rig.attach()
    rig.refit()
    kw = {}
    if fault == "drop":
        kw["tamper"] = lambda envs: envs[1:]
    elif fault == "corrupt":
        kw["tamper"] = lambda envs: [Envelope(e.kind, e.version, e.sender, e.part, e.last,
                                              e.body[:-40] + bytes(40)) for e in envs]
    elif fault == "skew":
        kw["base_skew"] = 1
    else:
        hits = []  # one crash in the middle of the apply (transient, like a killed worker thread)

        def crash(name):
            hits.append(name)
            if len(hits) == 2:
                raise InjectedFault(name)

        rig.engine.fault = crash
    out = rig.refit(**kw)
    rig.engine.fault = None
    assert out.detected and out.resynced and out.committed and rig.bit_exact(), out
    nxt = rig.refit()
    assert nxt.committed and not nxt.resynced and rig.bit_exact()


def test_trainer_resume_detected_by_checksums(rig):
    rig.attach()
    rig.refit()
    saved = rig.trainer.state()
    rig.refit()
    rig.refit()
    # trainer process restarts from the earlier checkpoint: new sender, zero baseline
    rig.trainer.load(saved)
    rig.sender = rig.new_sender()
    out = rig.attach()
    assert out.detected and out.resynced and out.committed and rig.bit_exact()
    assert rig.refit().committed and rig.bit_exact()
    # a clean restart at the engine's weights costs no payload at all
    rig.trainer.reset_baseline()
    rig.sender = rig.new_sender()
    again = rig.attach()
    assert again.committed and not again.resynced and again.bytes_sent == 0


def test_routing_pack_merge_and_owners():
    owners = assign_owners({"x": 100, "y": 60, "z": 50}, 2)
    assert owners == {"x": 0, "y": 1, "z": 1}
    t = ShardTrainer({"x": (8, 4)}, 1, 2)
    t.step()
    pieces = t.pieces(1)
    assert unpack(pack(pieces))[0].positions.tolist() == pieces[0].positions.tolist()
    t0 = ShardTrainer({"x": (8, 4)}, 0, 2)
    merged = merge(t0.pieces(1) + pieces)
    assert merged[0].positions.tolist() == sorted(merged[0].positions.tolist())
