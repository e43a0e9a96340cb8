"""The fsspec store transport against a hostile or messy store.

What a store shared across clusters can do to the objects in it: alter them, move them to
another name or box, copy consumed ones back, leave objects of an earlier run with the same URL
and key, hold stray files and abandoned temp files, or grow a backlog. The authenticated
envelope carries sender, receiver, run identity and sequence number; the receiver checks them.
Tests only use the transport's public face and the objects they find in the store (whatever
the folder layout), never the layout itself.
"""

from __future__ import annotations

import itertools
import uuid
import warnings

import pytest

from nemo_dcr.transport import Envelope, MessageKind, StoreTransport, TransportError
from nemo_dcr.transport.base import TransportTimeout

pytest.importorskip("fsspec")
from nemo_dcr.transport.store import StoreWarning  # noqa: E402

KEY = b"s" * 32


def _env(i: int, sender: int = 0, size: int = 10) -> Envelope:
    return Envelope(MessageKind.DELTA, i, sender, part=i, last=True, body=bytes([i % 251]) * size)


@pytest.fixture(params=["memory", "file"])
def url(request, tmp_path):
    if request.param == "memory":
        return f"memory://store-test-{uuid.uuid4().hex}"
    return f"file://{tmp_path}/box"


def _pair(url, run="run-1", n=2):
    return [StoreTransport(url, r, KEY, run=run) for r in range(n)]


def _objects(t: StoreTransport) -> set[str]:
    """Message objects now in the store (any folder), temp files excluded."""
    return {p for p in t.fs.find(t.root) if not p.rsplit("/", 1)[-1].startswith(".tmp-")}


def _quiet_recv(t, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", StoreWarning)
        return t.recv(**kw)


def test_round_trip_in_order_and_nothing_left(url):
    a, b = _pair(url)
    for i in range(5):
        a.send(1, _env(i, size=3000))
    got = [b.recv(timeout=2) for _ in range(5)]
    assert [g.version for g in got] == list(range(5)) and all(g.receiver == 1 for g in got)
    assert not _objects(a) and not [p for p in a.fs.find(a.root)]


def test_altered_object_or_wrong_key_raises(url):
    a, b = _pair(url)
    a.send(1, _env(1))
    (path,) = _objects(a)
    data = bytearray(a.fs.cat_file(path))
    data[40] ^= 1
    a.fs.pipe_file(path, bytes(data))
    with pytest.raises(TransportError, match="MAC"):
        b.recv(timeout=1)
    StoreTransport(url, 0, b"x" * 32, run="run-1").send(1, _env(2))
    with pytest.raises(TransportError, match="MAC"):
        b.recv(timeout=1)


def test_object_moved_to_look_like_another_sender_is_not_delivered_as_theirs(url):
    a, b, c = _pair(url, n=3)
    c.sweep_s = 0.0
    a.send(2, _env(1, sender=0))
    (from_a,) = _objects(a)
    b.send(2, _env(7, sender=1))
    (from_b,) = _objects(a) - {from_a}
    a_bytes, b_bytes = a.fs.cat_file(from_a), a.fs.cat_file(from_b)
    a.fs.pipe_file(from_b, a_bytes)  # rank 0's message where rank 1's should be, and back
    a.fs.pipe_file(from_a, b_bytes)
    with pytest.warns(StoreWarning):
        with pytest.raises(TransportTimeout):
            c.recv(src=1, timeout=0.3)
    b.send(2, _env(8, sender=1))
    with pytest.warns(StoreWarning, match="missing"):  # rank 1's real message #0 was overwritten
        assert c.recv(src=1, timeout=2).version == 8  # its next message still arrives
    assert c.stats == dict(c.stats, misaddressed=1, lost=1)


def test_message_moved_to_another_receivers_box_is_refused(url):
    a, b, c = _pair(url, n=3)
    a.send(2, _env(1))
    (path,) = _objects(a)
    b.send(1, _env(5))
    (other,) = _objects(a) - {path}
    a.fs.pipe_file(other, a.fs.cat_file(path))  # rank 2's message copied over rank 1's
    with pytest.warns(StoreWarning):
        with pytest.raises(TransportTimeout):
            b.recv(timeout=0.3)
    assert c.recv(timeout=2).version == 1


def test_consumed_object_copied_back_is_not_delivered_again(url):
    a, b = _pair(url)
    b.sweep_s = 0.0
    a.send(1, _env(3))
    (path,) = _objects(a)
    raw = a.fs.cat_file(path)
    assert b.recv(timeout=2).version == 3
    a.fs.pipe_file(path, raw)  # replay
    with pytest.warns(StoreWarning, match="replay"):
        with pytest.raises(TransportTimeout):
            b.recv(timeout=0.3)
    a.send(1, _env(4))
    assert b.recv(timeout=2).version == 4 and b.stats["replays"] == 1


def test_leftovers_of_an_earlier_run_with_same_url_and_key_are_dropped(url):
    old_a, _ = _pair(url, run="yesterday")
    for i in range(3):
        old_a.send(1, _env(i))  # never consumed: that run crashed
    a, b = _pair(url, run="today")
    b.sweep_s = 0.0
    with pytest.warns(StoreWarning, match="another run"):
        with pytest.raises(TransportTimeout):
            b.recv(timeout=0.3)
    a.send(1, _env(42))
    assert _quiet_recv(b, timeout=2).version == 42
    with pytest.raises(TransportTimeout):
        _quiet_recv(b, timeout=0.3)


def test_object_of_an_earlier_run_copied_into_the_new_runs_place_is_dropped(url):
    old_a, _ = _pair(url, run="yesterday")
    old_a.send(1, _env(1))
    (old,) = _objects(old_a)
    a, b = _pair(url, run="today")
    a.send(1, _env(2))
    (new,) = _objects(a) - {old}
    a.fs.pipe_file(new, a.fs.cat_file(old))
    with pytest.warns(StoreWarning, match="run"):
        with pytest.raises(TransportTimeout):
            b.recv(timeout=0.3)
    assert b.stats["other_run"] == 1


def test_random_run_ids_differ_and_are_shared_explicitly(url):
    assert StoreTransport(url, 0, KEY).run != StoreTransport(url, 1, KEY).run
    a = StoreTransport(url, 0, KEY)
    b = StoreTransport(url, 1, KEY, run=a.run)
    a.send(1, _env(1))
    assert b.recv(timeout=2).version == 1


def test_order_is_by_sequence_not_clock(url, monkeypatch):
    import time as time_mod

    ticks = itertools.count(10**18, -10**9)  # the wall clock steps backwards at every call
    monkeypatch.setattr(time_mod, "time_ns", lambda: next(ticks))
    monkeypatch.setattr(time_mod, "time", lambda: next(ticks) / 1e9)
    a, b = _pair(url)
    for i in range(6):
        a.send(1, _env(i))
    assert [b.recv(timeout=2).version for _ in range(6)] == list(range(6))


def test_stray_files_are_ignored_with_a_warning(url):
    a, b = _pair(url)
    b.sweep_s = 0.0
    a.send(1, _env(1))
    (path,) = _objects(a)
    folders = {p.rsplit("/", 1)[0] for p in a.fs.find(a.root)} | {a.root}
    for folder in folders:
        for name in ("notes.txt", "x.env", "1-2-x.env", "00000000000000000000-00000000-abcde.env", "-1.env"):
            a.fs.pipe_file(f"{folder}/{name}", b"junk")
    with pytest.warns(StoreWarning):
        got = b.recv(timeout=2)
        a.send(1, _env(2))
        got2 = b.recv(timeout=2)
        with pytest.raises(TransportTimeout):
            b.recv(timeout=0.3)
    assert (got.version, got2.version) == (1, 2)


def test_abandoned_temp_files_are_cleaned(url):
    a, b = _pair(url)
    b.tmp_stale_s, b.sweep_s = 0.0, 0.0
    a.send(1, _env(1))
    (path,) = _objects(a)
    tmp = f"{path.rsplit('/', 1)[0]}/.tmp-{uuid.uuid4().hex}"
    a.fs.pipe_file(tmp, b"half a message")
    assert b.recv(timeout=2).version == 1
    with pytest.raises(TransportTimeout):
        _quiet_recv(b, timeout=0.5)
    assert not a.fs.exists(tmp)


def test_failed_write_leaves_no_temp_file(url, monkeypatch):
    a, b = _pair(url)

    def broken_mv(*args, **kwargs):
        raise OSError("store refused the rename")

    monkeypatch.setattr(a.fs, "mv", broken_mv)
    with pytest.raises(TransportError, match=r"rank 0: could not write message #0 for rank 1 .*refused the rename"):
        a.send(1, _env(1))
    monkeypatch.undo()
    assert not a.fs.find(a.root) or not [p for p in a.fs.find(a.root) if ".tmp-" in p]


def test_listing_cost_does_not_grow_with_the_backlog(url):
    a, b, c = _pair(url, n=3)
    n = 200
    for i in range(n):
        (a if i % 2 else c).send(1, _env(i, sender=0 if i % 2 else 2))
    listed = []
    real_ls = b.fs.ls

    def counting_ls(path, *args, **kwargs):
        out = real_ls(path, *args, **kwargs)
        listed.append(len(out))
        return out

    b.fs.ls = counting_ls
    try:
        got = [b.recv(timeout=2) for _ in range(n)]
    finally:
        del b.fs.ls
    assert sorted(g.version for g in got) == list(range(n))
    assert sum(listed) <= 4 * n, f"{sum(listed)} entries listed to receive {n} messages"


def test_short_key_is_refused(url):
    with pytest.raises(ValueError, match="16"):
        StoreTransport(url, 0, b"x" * 15)


def test_wiring_reads_the_key_file_by_the_one_rule(tmp_path):
    from nemo_dcr.codec.auth import KeyFileError
    from nemo_dcr.config import DcrConfig
    from nemo_dcr.refit.wiring import colocated_wiring

    (tmp_path / "key").write_bytes(KEY + b"\n")
    cfg = DcrConfig(transport="store", url=f"file://{tmp_path}/box", key_file=str(tmp_path / "key"))
    w = colocated_wiring(cfg)
    assert w.transport.mux.base.key == KEY + b"\n"  # raw bytes: the newline is part of the key
    (tmp_path / "short").write_bytes(b"k" * 15)
    with pytest.raises(KeyFileError):
        colocated_wiring(DcrConfig(transport="store", url=f"file://{tmp_path}/b2", key_file=str(tmp_path / "short")))


def test_store_key_rule_is_the_key_file_rule():
    from nemo_dcr.codec import auth
    from nemo_dcr.transport import store

    assert store.MIN_KEY_BYTES == auth.MIN_KEY_BYTES


def test_refit_path_over_the_store_transport(tmp_path):
    """DeltaRefit -> store -> an EngineServer on its own endpoint (rank 1), as across clusters."""
    import torch

    from nemo_dcr.config import DcrConfig
    from nemo_dcr.types import int_view
    from tests.standins.shard_trainer import store_job

    shapes = {"a.weight": (48, 32), "norm.weight": (32,)}
    url = f"file://{tmp_path}/box"
    cfg = DcrConfig(transport="store", url=url, key_file="unused", reply_timeout_s=20)
    with store_job(url, cfg, KEY, "job-7", shapes) as job:
        assert job.refit.attach().committed
        for _ in range(2):
            job.trainer.step()
            r = job.refit.step()
            assert r.committed and r.verified
        assert all(torch.equal(int_view(job.engine.tensors[n]), int_view(p)) for n, p in job.trainer.params.items())
    assert job.server.stats.committed == 3


# -- shared bodies (share_bodies: one copy on disk for receivers that get the same bytes) ----------

def _sharing(tmp_path, n=3):
    url = f"file://{tmp_path}/box"
    return [StoreTransport(url, r, KEY, run="r", share_bodies=True, share_min_bytes=1000) for r in range(n)]


def _files(t: StoreTransport):
    return [p for p in (t.fs.find(t.root))]


def test_a_body_sent_to_several_receivers_is_written_once(tmp_path):
    import os

    a, b, c = _sharing(tmp_path)
    body = os.urandom(50_000)
    for dst in (1, 2):
        a.send(dst, Envelope(MessageKind.DELTA, 1, 0, body=body))
    a.send(1, _env(2, size=10))  # small: inline, as before
    bodies = [p for p in _files(a) if p.endswith(".body")]
    assert len(bodies) == 3 and {os.stat(p).st_ino for p in bodies} == {os.stat(bodies[0]).st_ino}  # one inode
    assert a.bytes_sent == 2 * len(body) + 10 and len(body) <= a.bytes_written < len(body) + 1000
    assert a.stats["shared"] == 1
    a.release()  # the staged name goes; the receivers' links keep the data
    assert [b.recv(0, timeout=2).body, c.recv(0, timeout=2).body, b.recv(0, timeout=2).body] == [body, body, b"\2" * 10]
    assert _files(a) == [] or all(os.path.isdir(p) for p in _files(a))


def test_a_shared_body_altered_or_missing_raises(tmp_path):
    a, b, c = _sharing(tmp_path)
    body = b"x" * 5000
    for dst in (1, 2):
        a.send(dst, Envelope(MessageKind.DELTA, 1, 0, body=body))
    a.release()
    first, second = sorted(p for p in _files(a) if p.endswith(".body"))
    with open(first, "r+b") as f:  # a hard link: altering one alters the other (a new file breaks the link)
        f.write(b"y")
    with pytest.raises(TransportError, match="does not match its frame's length 5000 and SHA-256"):
        b.recv(0, timeout=2)
    import os
    os.remove(second)
    with pytest.raises(TransportError, match="body of an authenticated frame is missing"):
        c.recv(0, timeout=2)
    assert [p for p in _files(a) if not os.path.isdir(p)] == []  # refused frames are removed with their bodies


def test_a_failed_send_with_a_shared_body_leaves_no_file(tmp_path, monkeypatch):
    import os

    a, b, _ = _sharing(tmp_path)
    body = b"z" * 5000
    real = a.fs.mv

    def full(src, dst, **kw):
        if dst.endswith(".env"):
            raise OSError(28, "No space left on device")
        return real(src, dst, **kw)

    monkeypatch.setattr(a.fs, "mv", full)
    with pytest.raises(TransportError, match="No space left"):
        a.send(1, Envelope(MessageKind.DELTA, 1, 0, body=body))
    left = [p for p in _files(a) if not os.path.isdir(p)]
    assert len(left) == 1 and "/staged-0/" in left[0]  # only the staged copy, until release()
    a.release()
    assert [p for p in _files(a) if not os.path.isdir(p)] == []
    monkeypatch.setattr(a.fs, "mv", real)
    a.send(1, Envelope(MessageKind.DELTA, 1, 0, body=body))  # the same sequence number, staged again
    assert b.recv(0, timeout=2).body == body


def test_without_hard_links_each_receiver_gets_a_copy(tmp_path, monkeypatch):
    a, b, c = _sharing(tmp_path)

    def no_links(src, dst, **kw):
        raise OSError(1, "Operation not permitted")

    monkeypatch.setattr(a.fs, "link", no_links)
    body = b"w" * 5000
    with pytest.warns(StoreWarning, match="cannot hard-link"):
        a.send(1, Envelope(MessageKind.DELTA, 1, 0, body=body))
    a.send(2, Envelope(MessageKind.DELTA, 1, 0, body=body))
    a.release()
    assert b.recv(0, timeout=2).body == body and c.recv(0, timeout=2).body == body
    assert a.bytes_written >= 3 * len(body)  # staged + a copy + the second receiver's inline frame
