"""Exact bytes and refusals of every wire message besides the payload (docs/wire_format.md
section 7): the envelope, the store frame, the query, the engine reply, the routing pack and the
NeMo-RL session metadata.  Expected bytes are composed here from the spec with ``struct``,
``json``, ``hashlib`` and ``hmac`` (no call into the code under test), and checked against a
literal where the spec gives one."""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
import zlib

import numpy as np
import pytest

from nemo_dcr.integrations.nemo_rl.session import Topology, policy_metadata, rollout_metadata
from nemo_dcr.refit.messages import Ask, EngineReply, MessageFormatError, Query
from nemo_dcr.refit.route_views import Router
from nemo_dcr.refit.routing import Coding, PackEntry, RoutingPackError, gather_captured, pack, unpack
from nemo_dcr.transport import Envelope, MessageKind, TransportError
from nemo_dcr.verify.checksum import tensor_checksum
from nemo_dcr.verify.sample import Sample

KEY = b"wire-format-key-0123456789abcdef"


def _head(kind, version, sender, part, last, receiver, shard) -> bytes:
    return b"NDCE" + struct.pack("<BqiiBii", kind, version, sender, part, last, receiver, shard)


# -- 7.1 envelope ---------------------------------------------------------------------------------

def test_envelope_bytes():
    body = b'{"ask": "full", "id": 7}'
    env = Envelope(MessageKind.QUERY, 0, 2, body=body, receiver=3)
    assert env.to_bytes() == _head(6, 0, 2, 0, 1, 3, 0) + body
    assert env.to_bytes().hex() == ("4e44434506" "0000000000000000" "02000000" "00000000" "01" "03000000" "00000000"
                                    + body.hex())
    part = Envelope(MessageKind.DELTA, 9, 1, 4, False, b"x", receiver=5, shard=2)
    assert part.to_bytes() == _head(1, 9, 1, 4, 0, 5, 2) + b"x"
    assert Envelope.from_bytes(part.to_bytes()) == part
    assert [k.value for k in MessageKind] == list(range(1, 11))


@pytest.mark.parametrize("data, why", [
    (b"NDCE" + b"\0" * 10, "shorter than its 30-byte head"),
    (b"NDCX" + _head(1, 0, 0, 0, 1, 0, 0)[4:], "magic b'NDCX'"),
    (_head(11, 0, 0, 0, 1, 0, 0), "kind 11"),
    (_head(1, 0, 0, 0, 2, 0, 0), "last flag 2"),
    (_head(1, 0, -1, 0, 1, 0, 0), "sender -1"),
    (_head(1, 0, 0, -3, 1, 0, 0), "part -3"),
    (_head(1, 0, 0, 0, 1, -2, 0), "receiver -2"),
    (_head(1, 0, 0, 0, 1, 0, -1), "shard -1"),
])
def test_malformed_envelopes_are_refused_naming_the_field(data, why):
    with pytest.raises(TransportError, match=f"{why}" if "shorter" in why else f"malformed envelope head: {why}"):
        Envelope.from_bytes(data)


# -- 7.2 store frame --------------------------------------------------------------------------------

def test_store_frame_bytes(tmp_path):
    from nemo_dcr.transport import StoreTransport

    env = Envelope(MessageKind.ACK, 3, 1, body=b"{}")
    StoreTransport(str(tmp_path), 1, KEY, run="golden-run").send(0, env)
    run = hashlib.sha256(b"golden-run").digest()[:16]
    obj = tmp_path / "to-0" / f"run-{run.hex()}" / "from-1" / "0000000000000000.env"
    frame = b"NDCS" + struct.pack("<B16siiQ", 1, run, 1, 0, 0) + _head(3, 3, 1, 0, 1, 0, 0) + b"{}"
    assert obj.read_bytes() == frame + hmac.new(KEY, frame, hashlib.sha256).digest()
    assert StoreTransport(str(tmp_path), 0, KEY, run="golden-run").recv(1, timeout=5) == Envelope(
        MessageKind.ACK, 3, 1, body=b"{}", receiver=0)


def test_store_frame_with_a_shared_body_bytes(tmp_path):
    from nemo_dcr.transport import StoreTransport

    body = bytes(range(256)) * 4
    StoreTransport(str(tmp_path), 1, KEY, run="golden-run", share_bodies=True, share_min_bytes=1024).send(
        0, Envelope(MessageKind.DELTA, 3, 1, body=body))
    run = hashlib.sha256(b"golden-run").digest()[:16]
    folder = tmp_path / "to-0" / f"run-{run.hex()}" / "from-1"
    frame = (b"NDCS" + struct.pack("<B16siiQ", 2, run, 1, 0, 0) + _head(1, 3, 1, 0, 1, 0, 0)
             + struct.pack("<Q", len(body)) + hashlib.sha256(body).digest())
    assert (folder / "0000000000000000.env").read_bytes() == frame + hmac.new(KEY, frame, hashlib.sha256).digest()
    assert (folder / "0000000000000000.body").read_bytes() == body


@pytest.mark.parametrize("frame_version, mac, why", [
    (1, b"\0" * 32, "envelope MAC does not match"),
    (3, None, "not a version-1 or 2 store frame"),
])
def test_store_frames_failing_their_mac_or_version_raise(tmp_path, frame_version, mac, why):
    from nemo_dcr.transport import StoreTransport

    run = hashlib.sha256(b"r").digest()[:16]
    folder = tmp_path / "to-0" / f"run-{run.hex()}" / "from-1"
    folder.mkdir(parents=True)
    frame = b"NDCS" + struct.pack("<B16siiQ", frame_version, run, 1, 0, 0) + _head(8, 0, 1, 0, 1, 0, 0)
    (folder / "0000000000000000.env").write_bytes(frame + (mac or hmac.new(KEY, frame, hashlib.sha256).digest()))
    with pytest.raises(TransportError, match=why):
        StoreTransport(str(tmp_path), 0, KEY, run="r").recv(1, timeout=2)


# -- 7.3 query --------------------------------------------------------------------------------------

def test_query_bytes():
    assert Query(Ask.FULL, 7).to_bytes() == b'{"ask": "full", "id": 7}'
    assert [a.value for a in Ask] == ["state", "full", "digests", "placement", "sampled", "preflight"]
    assert Query.from_bytes(b'{"id": 3, "ask": "placement"}') == Query(Ask.PLACEMENT, 3)
    sampled = Query(Ask.SAMPLED, 8, Sample(12, 16, 256, 3))
    assert sampled.to_bytes() == (b'{"ask": "sampled", "id": 8, "sample": {"step": 12, "steps": 16, "block": 256, '
                                  b'"seed": 3}}')
    assert Query.from_bytes(sampled.to_bytes()) == sampled


@pytest.mark.parametrize("body, why", [
    (b"\xff", "not UTF-8 JSON"),
    (b"[1]", "a JSON list, not an object"),
    (b'{"ask": "full"}', r"missing keys \['id'\]"),
    (b'{"ask": "full", "id": 1, "x": 0}', r"unknown keys \['x'\]"),
    (b'{"ask": "all", "id": 1}', "asks 'all'; known"),
    (b'{"ask": "full", "id": -1}', "id must be an integer"),
    (b'{"ask": "full", "id": true}', "id must be an integer"),
    (b'{"ask": "full", "id": 1.0}', "id must be an integer"),
    (b'{"ask": "full", "id": 1, "sample": {}}', r"unknown keys \['sample'\]"),
    (b'{"ask": "sampled", "id": 1}', r"missing keys \['sample'\]"),
    (b'{"ask": "sampled", "id": 1, "sample": {"step": 1, "steps": 0, "block": 8, "seed": 0}}',
     r"sample: Sample.steps must be an integer in \[1, 2\*\*63\)"),
    (b'{"ask": "sampled", "id": 1, "sample": {"step": 1, "steps": 2}}', r"sample: a sample is an object with keys"),
])
def test_malformed_queries_are_refused_naming_what(body, why):
    with pytest.raises(MessageFormatError, match=why):
        Query.from_bytes(body)


def test_the_server_answers_a_malformed_query_with_a_refusal_and_keeps_serving():
    import torch

    from nemo_dcr.apply import TensorEngine
    from nemo_dcr.refit import EngineServer
    from nemo_dcr.transport import InProcHub

    hub = InProcHub(2)
    server = EngineServer(TensorEngine({"w": torch.zeros(3, dtype=torch.bfloat16)}), hub.transport(1), [0])
    trainer = hub.transport(0)
    for env in (Envelope(MessageKind.QUERY, 1, 0), Envelope(MessageKind.QUERY, 0, 0, body=b'{"ask": "x", "id": 1}'),
                Envelope(MessageKind.QUERY, 0, 0, body=Query(Ask.STATE, 5).to_bytes())):
        assert server.handle(env)
    replies = [EngineReply.from_bytes(trainer.recv(1, timeout=1).body) for _ in range(3)]
    assert not replies[0].ok and "a QUERY envelope carries version 0, got 1" in replies[0].reason
    assert not replies[1].ok and "asks 'x'" in replies[1].reason and replies[1].query is None
    assert replies[2].ok and replies[2].query == Query(Ask.STATE, 5) and set(replies[2].checksums) == {"w"}
    assert [w for _, w, _ in server.stats.events] == ["bad-query", "bad-query"]


def test_the_trainer_ranks_same_query_is_computed_once_per_round(monkeypatch):
    import torch

    from nemo_dcr.apply import TensorEngine
    from nemo_dcr.refit import EngineServer
    from nemo_dcr.refit import server as server_mod
    from nemo_dcr.transport import InProcHub

    hub = InProcHub(4)
    engine = TensorEngine({"w": torch.arange(64, dtype=torch.bfloat16)})
    server = EngineServer(engine, hub.transport(3), [0, 1, 2])
    trainers = [hub.transport(i) for i in range(3)]
    computed = []
    real = engine.checksums
    monkeypatch.setattr(engine, "checksums", lambda *a, **k: computed.append(k.get("sample")) or real(*a, **k))

    def ask(sender: int, qid: int, sample: Sample = Sample(1, 4, block=8)) -> EngineReply:
        assert server.handle(Envelope(MessageKind.QUERY, 0, sender, body=Query(Ask.SAMPLED, qid, sample).to_bytes()))
        return EngineReply.from_bytes(trainers[sender].recv(3, timeout=1).body)

    first = [ask(s, 7 + s) for s in range(3)]  # one round: computed once, each answer names its own query
    assert len(computed) == 1 and server.stats.answers_shared == 2
    assert [r.query.id for r in first] == [7, 8, 9] and len({json.dumps(r.checksums) for r in first}) == 1
    ask(0, 10)  # sender 0 asks again: a new round
    ask(1, 11)  # shared with sender 0's
    ask(2, 12, Sample(2, 4, block=8))  # another slice
    assert len(computed) == 3
    engine.tensors["w"].view(torch.int16)[0] ^= 1  # behind the refit's back, then a DELTA part arrives
    assert server.handle(Envelope(MessageKind.DELTA, 1, 0, part=0, last=False))
    after = ask(1, 13, Sample(2, 4, block=8))
    assert len(computed) == 4 and after.checksums == real(sample=Sample(2, 4, block=8)).canonical
    monkeypatch.setattr(server_mod, "SHARED_ANSWER_S", 0.0)  # too late to share
    ask(0, 14, Sample(2, 4, block=8))
    assert len(computed) == 5 and server.stats.answers_shared == 3


# -- 7.4 engine reply -------------------------------------------------------------------------------

REPLY = EngineReply(True, 4, checksums={"w": 0x0123456789ABCDEF}, views={1: {"w": 5}}, touched={"w": 3},
                    query=Query(Ask.STATE, 2))


def test_engine_reply_bytes():
    want = json.dumps({"ok": True, "version": 4, "query": {"ask": "state", "id": 2}, "reason": "",
                       "checksums": {"w": "0123456789abcdef"}, "views": {"1": {"w": "0000000000000005"}},
                       "digests": {}, "touched": {"w": 3}, "placement": [], "seconds": {}}).encode()
    assert REPLY.to_bytes() == want
    assert EngineReply.from_bytes(want) == REPLY
    nack = EngineReply(False, 2, reason="VersionMismatchError: stale", seconds={"parts": 0.5, "apply": 1})
    assert EngineReply.from_bytes(nack.to_bytes()) == nack and b'"query": null' in nack.to_bytes()


def _reply(**change) -> bytes:
    o = json.loads(REPLY.to_bytes())
    for k, v in change.items():
        if v is KeyError:
            del o[k]
        else:
            o[k] = v
    return json.dumps(o).encode()


@pytest.mark.parametrize("data, why", [
    (b"{", "not UTF-8 JSON"),
    (_reply(views=KeyError), r"missing keys \['views'\]"),
    (_reply(extra=1), r"unknown keys \['extra'\]"),
    (_reply(ok="yes"), "ok must be a boolean"),
    (_reply(version=-1), "version must be an integer"),
    (_reply(checksums={"w": "0123456789ABCDEF"}), r"checksums\['w'\] must be 16 lowercase hex digits"),
    (_reply(checksums={"w": "123"}), "must be 16 lowercase hex digits"),
    (_reply(views={"01": {}}), "key '01' is not a shard number"),
    (_reply(views={"0": {"w": 5}}), r"views\['0'\]\['w'\] must be 16 lowercase hex digits"),
    (_reply(digests={"w": "ab"}), "must be 64 lowercase hex digits"),
    (_reply(touched={"w": -2}), r"touched\['w'\] must be an integer"),
    (_reply(placement={}), "placement must be a list of objects"),
    (_reply(query={"ask": "state"}), r"engine reply query: missing keys \['id'\]"),
    (_reply(seconds={"apply": -1}), r"seconds\['apply'\] must be a number of seconds"),
    (_reply(seconds={"apply": True}), r"seconds\['apply'\] must be a number of seconds"),
    (_reply(seconds={"decode": 1.0}), r"engine reply seconds: unknown keys \['decode'\]"),
])
def test_malformed_replies_are_refused_naming_what(data, why):
    with pytest.raises(MessageFormatError, match=why):
        EngineReply.from_bytes(data)


def test_placement_entries_are_refused_naming_the_tensor():
    from nemo_dcr.apply.placement import PlacementError, placement_from_json

    with pytest.raises(PlacementError, match="placement of q: keys"):
        placement_from_json({"q": {"shape": [2]}})
    entry = dict(shape=[4], param="p", param_shape=[4], canon=[0, 2], local=[0], length=[2], step=[1], primary=[])
    with pytest.raises(PlacementError, match="placement of q: canon, local, length and step differ"):
        placement_from_json({"q": entry})


# -- 7.5 routing pack -------------------------------------------------------------------------------

def _pack_bytes(rows, bodies, *, sender=1, receiver=0, key=None, magic=b"NDCP", version=2, flags=None,
                entries=None) -> bytes:
    flags = (1 if key else 0) if flags is None else flags
    data = magic + struct.pack("<BBiiI", version, flags, sender, receiver, len(rows) if entries is None else entries)
    data += b"".join(struct.pack("<IBQQQQ", *row) for row in rows) + b"".join(bodies)
    return data + (hmac.new(key, data, hashlib.sha256).digest() if key else b"")


VIEW_BODY = struct.pack("<Q2q2q", 2, 1, 4, 2, 1) + struct.pack("<3H", 0x3F80, 0xBF80, 7)
ROWS = [(1, 1, 3, len(VIEW_BODY), 0, 0xABC), (0, 2, 2, 2, 5, 6)]


def test_routing_pack_bytes():
    entries = [PackEntry(1, Coding.VIEW, 3, 0, 0xABC, VIEW_BODY), PackEntry(0, Coding.DCR, 2, 5, 6, b"\1\2")]
    for key in (None, KEY):
        want = _pack_bytes(ROWS, [VIEW_BODY, b"\1\2"], key=key)
        assert pack(entries, 1, 0, key) == want and len(want) == 18 + 2 * 37 + len(VIEW_BODY) + 2 + (32 if key else 0)
        back = unpack(want, 1, 0, key, tensors=2)
        assert [(e.tensor, e.coding, e.count, e.base, e.target, bytes(e.body)) for e in back] == \
            [(1, Coding.VIEW, 3, 0, 0xABC, VIEW_BODY), (0, Coding.DCR, 2, 5, 6, b"\1\2")]
    assert pack([], 1, 0, None) == b"NDCP" + struct.pack("<BBiiI", 2, 0, 1, 0, 0)


GOOD = _pack_bytes(ROWS, [VIEW_BODY, b"\1\2"], key=KEY)
_V1_HEAD = json.dumps([{"name": "w", "dtype": "bf16", "shape": [2, 3], "nnz": 1, "old": False}]).encode()
V1 = struct.pack("<Q", len(_V1_HEAD)) + _V1_HEAD + struct.pack("<qH", 1, 7)


@pytest.mark.parametrize("data, key, why", [
    (b"NDCP\2\0", None, "6 bytes, shorter than its 18-byte head"),
    (_pack_bytes([], [], magic=b"NDCR"), None, "magic b'NDCR', expected b'NDCP'"),
    (V1, None, r"magic b'I\\x00\\x00\\x00', expected b'NDCP'"),  # a version 1 pack: JSON head length first
    (_pack_bytes([], [], version=1), None, "format version 1, this reader reads 2"),
    (_pack_bytes([], [], flags=2), None, "flags 0x2, expected 0x0"),
    (_pack_bytes([], []), KEY, "flags 0x0, expected 0x1 \\(a MAC: the refit has a key\\)"),
    (GOOD, None, "flags 0x1, expected 0x0"),
    (GOOD[:-1] + bytes([GOOD[-1] ^ 1]), KEY, "MAC does not match"),
    (GOOD[:30] + bytes([GOOD[30] ^ 1]) + GOOD[31:], KEY, "MAC does not match"),
    (_pack_bytes([], [], sender=2), None, "from trainer rank 1 to 0: the head names sender 2 and receiver 0"),
    (_pack_bytes([], [], receiver=3), None, "names sender 1 and receiver 3"),
    (_pack_bytes(ROWS[:1], [], entries=3), None, "a table of 3 entries needs 129 bytes"),
    (_pack_bytes([(0, 2, 1, 99, 0, 0)], [b"x"]), None, "entry 0: body of 99 bytes at offset 55"),
    (_pack_bytes([(0, 2, 1, 1, 0, 0)], [b"xy"]), None, "1 bytes after the last body"),
    (_pack_bytes([(0, 7, 1, 0, 0, 0)], []), None, "entry 0: coding 7, known \\[1, 2\\]"),
    (_pack_bytes([(5, 2, 1, 0, 0, 0)], []), None, "entry 0: tensor 5 outside the 2 canonical tensors"),
    (_pack_bytes([(0, 2, 1, 0, 0, 0)] * 2, []), None, "entry 1: tensor 0 twice"),
])
def test_malformed_routing_packs_are_refused_naming_what(data, key, why):
    with pytest.raises(RoutingPackError, match=why):
        unpack(data, 1, 0, key, tensors=2)


class _Scripted:
    """Trainer rank 0 of two, whose exchanges return the scripted packs from rank 1."""

    rank, size = 0, 2

    def __init__(self):
        self.script = []

    def exchange(self, outgoing):
        self.sent = list(outgoing)
        return [outgoing[0], self.script.pop(0)]


def _owner_of(tensors: dict):
    """A router on rank 0 owning ``tensors`` (name -> numel, bf16) and one tensor of rank 1's."""
    group = _Scripted()
    canonical = {n: ("bf16", (k,)) for n, k in {**tensors, "z.other": 4}.items()}
    owners = {**{n: 0 for n in tensors}, "z.other": 1}
    return group, Router(group, owners, canonical, None)


def _view(runs, bits, tensor=0, target=None) -> bytes:
    bits = np.asarray(bits, np.uint16)
    body = struct.pack(f"<Q{len(runs)}q{len(runs)}q", len(runs), *[c for c, _ in runs], *[n for _, n in runs])
    body += bits.astype("<u2").tobytes()
    target = tensor_checksum(bits) if target is None else target
    return _pack_bytes([(tensor, 1, bits.size, len(body), 0, target)], [body])


@pytest.mark.parametrize("pack_, why", [
    (_pack_bytes([(1, 1, 0, 8, 0, 0)], [struct.pack("<Q", 0)]), "entry 0 \\(z.other\\): owned by trainer rank 1, "
                                                                 "not by rank 0"),
    (_view([(2, 3)], [1, 2, 3])[:-1], "1 bytes after|body of"),
    (_pack_bytes([(0, 1, 3, 8, 0, 0)], [struct.pack("<Q", 1)]), "a view of 1 runs and 3 elements takes 30 bytes, "
                                                                "the body has 8"),
    (_view([(2, 3), (4, 1)], [1, 2, 3, 4]), "runs must be non-empty, increasing, disjoint and inside \\[0, 8\\)"),
    (_view([(6, 3)], [1, 2, 3]), "inside \\[0, 8\\)"),
    (_view([(2, 0)], []), "non-empty"),
    (_view([(2, 3)], [1, 2, 3], target=5), "view bits have checksum [0-9a-f]{16}, the entry says 0000000000000005"),
])
def test_malformed_view_entries_are_refused_and_change_nothing(pack_, why):
    group, router = _owner_of({"a.w": 8})
    group.script.append(pack_)
    with pytest.raises(RoutingPackError, match=why):
        router.route([])
    assert router.incoming == {}


def test_malformed_change_entries_are_refused_and_stage_nothing():
    from nemo_dcr.codec.dcr import encode_dcr
    from nemo_dcr.types import DTYPES

    group, router = _owner_of({"a.w": 8, "b.w": 8})
    bits = np.array([0x3F80, 0x3F81, 0x4000, 0xBF80], np.uint16)  # rank 1's view: canonical 2..5 of a.w
    group.script.append(_view([(2, 4)], bits))
    (a,) = router.route([], attach=True)
    assert a.positions.tolist() == [2, 3, 4, 5] and a.new_bits.tolist() == bits.tolist()
    base = tensor_checksum(bits)
    new = np.array([0x3F82, 0xBF81], np.uint16)
    body = encode_dcr(bits, np.array([1, 3]), new, DTYPES["bf16"])
    after = bits.copy()
    after[[1, 3]] = new
    good = (0, 2, 2, len(body), base, tensor_checksum(after))
    cases = [
        (_pack_bytes([(1, *good[1:])], [body]), "entry 0 \\(b.w\\): changes of a view this rank was never sent"),
        (_pack_bytes([(*good[:4], base ^ 1, good[5])], [body]), "coded against view bits with checksum"),
        (_pack_bytes([good], [b"\xff" * len(body)]), "entry 0 \\(a.w\\): record 'a.w': dcr body \\(wire format 4.4\\)"),
        (_pack_bytes([(*good[:5], 7)], [body]), "not the entry's target 0000000000000007"),
        (_pack_bytes([(0, 2, 3, *good[3:])], [body]), "decoded 2 changes for a count of 3"),
    ]
    for data, why in cases:
        group.script.append(data)
        with pytest.raises(RoutingPackError, match=why):
            router.route([])
        assert router.incoming[("a.w", 1)].staged is None
    group.script.append(_pack_bytes([good], [body]))
    (d,) = router.route([])
    assert d.positions.tolist() == [3, 5] and d.new_bits.tolist() == new.tolist() and d.old_bits.tolist() == [
        0x3F81, 0xBF80]


def test_captured_counts_message():
    import socket

    group = _Scripted()
    group.script.append(b'{"host": "n2", "captured": [[1, 5]]}')
    m = gather_captured(group, {"a": 3, "b": 0}, ["a", "b"])
    assert group.sent == [json.dumps({"host": socket.gethostname(), "captured": [[0, 3]]}).encode()] * 2
    assert m.hosts == (socket.gethostname(), "n2") and m.shares == {"a": {0: 3}, "b": {1: 5}}


@pytest.mark.parametrize("blob", [b"{", b"[]", b'{"host": 1, "captured": []}', b'{"host": "h"}',
                                  b'{"host": "h", "captured": [[2, 1]]}', b'{"host": "h", "captured": [[0, 0]]}',
                                  b'{"host": "h", "captured": [[0, true]]}', b'{"host": "h", "captured": [[0]]}'])
def test_captured_counts_of_another_form_are_refused_naming_the_member(blob):
    group = _Scripted()
    group.script.append(blob)
    with pytest.raises(RoutingPackError, match="captured counts of trainer rank 1: not "):
        gather_captured(group, {"a": 3}, ["a", "b"])


# -- 7.6 NeMo-RL session metadata -------------------------------------------------------------------

TABLE = {"b.weight": ("bf16", (3,)), "a.weight": ("bf16", (2, 2))}
PLACEMENT = {"a.weight": {"shape": [2, 2]}, "b.weight": {"shape": [3]}}


def test_session_metadata_layout():
    assert policy_metadata("ab12") == {"nemo_dcr": "policy", "nonce": "ab12"}
    m = rollout_metadata("cd34", TABLE, PLACEMENT)
    assert sorted(m) == ["nemo_dcr", "nonce", "placed", "placement", "table", "table_sha"]
    assert zlib.decompress(m["table"]) == b'{"a.weight": ["bf16", [2, 2]], "b.weight": ["bf16", [3]]}'
    assert m["table_sha"] == hashlib.sha256(m["table"]).hexdigest() and m["placed"] == ["a.weight", "b.weight"]
    assert json.loads(zlib.decompress(m["placement"])) == PLACEMENT
    topo = Topology.from_metadata("memory://x/", [policy_metadata("ab12"), m], 1, 1)
    assert topo.session == hashlib.sha256(b"ab12|cd34").hexdigest()[:16]
    assert topo.folder == f"memory://x/session-{topo.session}" and topo.table == {
        "a.weight": ("bf16", (2, 2)), "b.weight": ("bf16", (3,))}


def _metadata(**rollout_change):
    m = {**rollout_metadata("cd34", TABLE, PLACEMENT), **rollout_change}
    return [policy_metadata("ab12"), {k: v for k, v in m.items() if v is not KeyError}]


@pytest.mark.parametrize("metadata, why", [
    (_metadata()[:1], "metadata has 1 entries for 1 policy"),
    ([{"nonce": "ab"}, _metadata()[1]], r"entries \[0\] are not from nemo_dcr"),
    (_metadata()[::-1], "roles"),
    (_metadata(table_sha=KeyError), r"entry 1 \(rollout\) lacks \['table_sha'\]"),
    (_metadata(nonce="XY"), r"entry 1 \(rollout\): nonce 'XY' is not lowercase hex"),
    (_metadata(table=zlib.compress(b"{}")), "table_sha is not the sha256 of its table"),
])
def test_malformed_session_metadata_is_refused_naming_the_entry(metadata, why):
    with pytest.raises(ValueError, match=why):
        Topology.from_metadata("memory://x", metadata, 1, 1)
