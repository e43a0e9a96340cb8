"""Transports: envelopes round-trip, order per pair, chunking, timeouts (the store: test_transport_store.py)."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest
import torch.distributed as dist

from nemo_dcr.transport import (
    DistTransport,
    Envelope,
    InProcHub,
    MessageKind,
    TransportError,
)

KEY = b"s" * 32


def _env(i: int, size: int = 10, sender: int = 0) -> Envelope:
    return Envelope(MessageKind.DELTA, i, sender, part=i, last=i % 2 == 0, body=bytes([i % 251]) * size)


def test_envelope_bytes_round_trip_and_bad_head():
    e = _env(3, 100)
    assert Envelope.from_bytes(e.to_bytes()) == e
    with pytest.raises(TransportError):
        Envelope.from_bytes(b"XXXX" + e.to_bytes()[4:])


def test_inproc_order_and_source_filter():
    hub = InProcHub(3)
    a, b, c = hub.transport(0), hub.transport(1), hub.transport(2)
    a.send(2, _env(1))
    b.send(2, _env(2, sender=1))
    a.send(2, _env(3))
    assert c.recv(src=1).version == 2
    assert [c.recv().version for _ in range(2)] == [1, 3]
    with pytest.raises(TransportError):
        c.recv(timeout=0.01)


def _gloo_pair(tmp_path):
    """Two gloo process groups of one 2-rank world in this process (ranks 0 and 1)."""
    store = dist.FileStore(str(tmp_path / "store"), 2)
    pgs = [None, None]

    def make(r):
        pgs[r] = dist.ProcessGroupGloo(store, r, 2)

    ts = [threading.Thread(target=make, args=(r,)) for r in range(2)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    return pgs


def test_dist_transport_chunks_and_timeout(tmp_path):
    pgs = _gloo_pair(tmp_path)
    tx, rx = DistTransport(pgs[0], 0, chunk_bytes=1000, max_inflight=2), DistTransport(pgs[1], 1)
    with pytest.raises(TransportError):
        rx.recv(timeout=0.05)
    big = [_env(i, size=5000 + i) for i in range(4)]
    sender = threading.Thread(target=lambda: ([tx.send(1, e) for e in big], tx.flush()))
    sender.start()
    got = [rx.recv(timeout=10) for _ in big]  # the timed-out receive is resumed, not lost
    sender.join()
    assert [replace(g, receiver=-1) for g in got] == big and all(g.receiver == 1 for g in got)
    assert tx.bytes_sent == sum(len(e.body) for e in big)
    closers = [threading.Thread(target=t.close, args=(10,)) for t in (tx, rx)]
    [c.start() for c in closers]
    [c.join() for c in closers]
    assert tx._receivers and not any(th.is_alive() for th in tx._receivers + rx._receivers)


def test_dist_transport_close_names_the_rank_that_never_closed(tmp_path):
    pgs = _gloo_pair(tmp_path)
    a, b = DistTransport(pgs[0], 0), DistTransport(pgs[1], 1)
    with pytest.raises(TransportError, match=r"ranks \[1\] did not close"):
        a.close(timeout=0.2)
    b.close(timeout=10)  # the late peer closes; both receivers end
    for th in a._receivers:
        th.join(10)
    assert not any(th.is_alive() for th in a._receivers + b._receivers)


def _dies_after_one_message(store_path: str) -> None:
    import os
    import signal

    pg = dist.ProcessGroupGloo(dist.FileStore(store_path, 2), 1, 2)
    t = DistTransport(pg, 1)
    t.send(0, _env(1, sender=1))
    t.flush()
    t.recv(src=0, timeout=120)  # the go-ahead: then this process dies without closing anything
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_peer_that_dies_is_a_clear_error_at_once_not_a_timeout(tmp_path):
    """SIGKILL of the other process: its message before dying is still delivered, then every
    receive from it and every send to it raises a TransportError naming it, within seconds."""
    import multiprocessing as mp
    import time

    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=_dies_after_one_message, args=(str(tmp_path / "store"),))
    proc.start()
    pg = dist.ProcessGroupGloo(dist.FileStore(str(tmp_path / "store"), 2), 0, 2)
    t = DistTransport(pg, 0)
    assert t.recv(src=1, timeout=60).version == 1
    t.send(1, _env(2))
    t.flush()
    proc.join(60)
    assert proc.exitcode == -9
    t0 = time.monotonic()
    with pytest.raises(TransportError, match=r"rank 0: the connection to rank 1 was lost while receiving"):
        t.recv(src=1, timeout=120)
    with pytest.raises(TransportError, match=r"connection to rank 1 was lost"):
        t.recv(timeout=120)
    with pytest.raises(TransportError, match=r"connection to rank 1 was lost"):
        t.send(1, _env(3))
    assert time.monotonic() - t0 < 30 and 1 in t.lost
    t.close(timeout=5)  # nothing left to wait for


def test_a_send_gloo_refuses_to_post_names_the_lost_peer():
    """gloo raises from ``send`` itself when the peer's connection closed before the receiver
    thread saw it: that is the peer lost too, not a raw RuntimeError out of the refit."""

    class ClosedPair:
        def size(self):
            return 2

        def send(self, tensors, dst, tag):
            raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:18328")

    t = DistTransport(ClosedPair(), 0)
    with pytest.raises(TransportError, match=r"connection to rank 1 was lost while sending to it"):
        t.send(1, _env(1))
    assert 1 in t.lost
    with pytest.raises(TransportError, match=r"connection to rank 1 was lost"):
        t.send(1, _env(2))
