"""The store transport on a disk that fills up for real (a small tmpfs filled to ENOSPC, or a
read-only folder where no mount is allowed): a clear error naming the OS's reason, nothing
half-written delivered, no temp file left, and the refit recovers once the space is back."""

from __future__ import annotations

import warnings

import pytest
import torch

from nemo_dcr.config import DcrConfig
from nemo_dcr.tools.chaos.disk import ScarceFolder, can_exhaust
from nemo_dcr.transport import Envelope, MessageKind, StoreTransport, TransportError
from nemo_dcr.types import int_view
from tests.standins.shard_trainer import store_job

KEY = b"d" * 32
WHY = r"No space left on device|Permission denied"


@pytest.fixture
def scarce(tmp_path):
    if not can_exhaust(tmp_path / "probe"):
        pytest.skip("neither a tmpfs mount nor a non-root writer here")
    with ScarceFolder(tmp_path / "store", size_mb=8) as folder:
        yield folder


def _published(folder) -> list[str]:
    return sorted(p.name for p in folder.path.rglob("*") if p.is_file() and p.name != ".chaos-filler")


def test_a_full_store_is_a_clear_error_and_publishes_nothing(scarce):
    url = f"file://{scarce.path}"
    a, b = StoreTransport(url, 0, KEY, run="r"), StoreTransport(url, 1, KEY, run="r")
    a.send(1, Envelope(MessageKind.DELTA, 1, 0, body=b"x" * 1000))
    scarce.exhaust()
    with pytest.raises(TransportError, match=rf"rank 0: could not write message #1 for rank 1 .*({WHY})"):
        a.send(1, Envelope(MessageKind.DELTA, 2, 0, body=b"y" * 100_000))
    assert _published(scarce) == ["0000000000000000.env"]  # the one written before; no temp file
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert b.recv(0, timeout=5).version == 1  # readable while full (its removal may be refused)
    scarce.restore()
    a.send(1, Envelope(MessageKind.DELTA, 3, 0, body=b"z"))
    assert b.recv(0, timeout=5).version == 3  # the same sequence number again: no gap, no loss


def test_the_refit_fails_clearly_on_a_full_store_and_recovers_when_space_returns(scarce):
    shapes = {"a.weight": (48, 32), "norm.weight": (32,)}
    url = f"file://{scarce.path}"
    cfg = DcrConfig(transport="store", url=url, key_file="unused", reply_timeout_s=10, verify="full")
    with store_job(url, cfg, KEY, "job", shapes) as job:
        trainer, engine, refit = job.trainer, job.engine, job.refit
        assert refit.attach().committed
        held = {n: t.clone() for n, t in engine.tensors.items()}
        scarce.exhaust()
        trainer.step()
        r = refit.step()
        assert not r.committed and refit.sender.uncertain
        assert any("could not send to engine rank 1" in d for d in r.detected), r.detected
        assert any("No space left on device" in d or "Permission denied" in d for d in r.detected), r.detected
        assert engine.version == 1 and all(torch.equal(int_view(held[n]), int_view(t)) for n, t in engine.tensors.items())
        assert not [p for p in _published(scarce) if ".tmp-" in p]
        scarce.restore()
        trainer.step()
        r = refit.step()  # recovers first (what the engine holds is unknown), then it is current
        assert r.committed and r.mode == "resync", r
        assert all(torch.equal(int_view(engine.tensors[n]), int_view(p)) for n, p in trainer.params.items())
        trainer.step()
        r = refit.step()
        assert r.committed and r.mode == "delta" and not r.detected
