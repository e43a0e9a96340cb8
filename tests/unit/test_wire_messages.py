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
from nemo_dcr.refit.routing import RoutingPackError, pack, unpack
from nemo_dcr.transport import Envelope, MessageKind, TransportError
from nemo_dcr.types import SparseDelta

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


@pytest.mark.parametrize("frame_version, mac, why", [
    (1, b"\0" * 32, "envelope MAC does not match"),
    (2, None, "not a version-1 store frame"),
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
    assert [a.value for a in Ask] == ["state", "full", "digests", "placement", "preflight"]
    assert Query.from_bytes(b'{"id": 3, "ask": "placement"}') == Query(Ask.PLACEMENT, 3)


@pytest.mark.parametrize("body, why", [
    (b"\xff", "not UTF-8 JSON"),
    (b"[1]", "a JSON list, not an object"),
    (b'{"ask": "full"}', r"missing keys \['id'\]"),
    (b'{"ask": "full", "id": 1, "x": 0}', r"unknown keys \['x'\]"),
    (b'{"ask": "all", "id": 1}', "asks 'all'; known"),
    (b'{"ask": "full", "id": -1}', "id must be an integer"),
    (b'{"ask": "full", "id": true}', "id must be an integer"),
    (b'{"ask": "full", "id": 1.0}', "id must be an integer"),
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


# -- 7.4 engine reply -------------------------------------------------------------------------------

REPLY = EngineReply(True, 4, checksums={"w": 0x0123456789ABCDEF}, views={1: {"w": 5}}, touched={"w": 3},
                    query=Query(Ask.STATE, 2))


def test_engine_reply_bytes():
    want = json.dumps({"ok": True, "version": 4, "query": {"ask": "state", "id": 2}, "reason": "",
                       "checksums": {"w": "0123456789abcdef"}, "views": {"1": {"w": "0000000000000005"}},
                       "digests": {}, "touched": {"w": 3}, "placement": []}).encode()
    assert REPLY.to_bytes() == want
    assert EngineReply.from_bytes(want) == REPLY
    nack = EngineReply(False, 2, reason="VersionMismatchError: stale")
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

DELTA = SparseDelta("w", "bf16", (2, 3), np.array([1, 4]), np.array([0x3F80, 0xBF80], np.uint16),
                    np.array([0, 1], np.uint16))


def _pack_bytes(head, *arrays) -> bytes:
    raw = json.dumps(head).encode()
    return struct.pack("<Q", len(raw)) + raw + b"".join(arrays)


def test_routing_pack_bytes():
    head = [{"name": "w", "dtype": "bf16", "shape": [2, 3], "nnz": 2, "old": True}]
    want = _pack_bytes(head, struct.pack("<2q", 1, 4), struct.pack("<2H", 0x3F80, 0xBF80), struct.pack("<2H", 0, 1))
    assert pack([DELTA]) == want
    back = unpack(want)[0]
    assert (back.name, back.dtype, back.shape, back.positions.tolist(), back.new_bits.tolist(),
            back.old_bits.tolist()) == ("w", "bf16", (2, 3), [1, 4], [0x3F80, 0xBF80], [0, 1])
    assert pack([]) == struct.pack("<Q", 2) + b"[]" and unpack(pack([])) == []


H = {"name": "w", "dtype": "bf16", "shape": [2, 3], "nnz": 1, "old": False}
ARR = struct.pack("<q", 1) + struct.pack("<H", 7)


@pytest.mark.parametrize("data, why", [
    (b"\1\0", "shorter than its 8-byte head length"),
    (struct.pack("<Q", 99) + b"[]", "head of 99 bytes, but only 2 follow"),
    (struct.pack("<Q", 2) + b"{}", "head is a JSON dict, not a list"),
    (_pack_bytes([{**H, "x": 1}], ARR), "entry 0: keys"),
    (_pack_bytes([{**H, "dtype": "int8"}], ARR), "dtype 'int8'"),
    (_pack_bytes([{**H, "old": 1}], ARR), "old 1"),
    (_pack_bytes([{**H, "nnz": -1}]), "nnz -1 must be non-negative"),
    (_pack_bytes([{**H, "nnz": 2}], ARR), "entry 0 \\(w\\): 20 bytes of arrays at offset"),
    (_pack_bytes([H], ARR, b"\0"), "1 bytes after its last array"),
    (_pack_bytes([H], struct.pack("<q", 6) + struct.pack("<H", 7)), r"positions outside \[0, 6\)"),
])
def test_malformed_routing_packs_are_refused_naming_what(data, why):
    with pytest.raises(RoutingPackError, match=why):
        unpack(data)


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
