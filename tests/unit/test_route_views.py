"""Trainer-to-trainer routing coded against each sender's view (refit/route_views.py, wire format
7.5): three trainer ranks in threads over a transport group.  Round trips are bit-exact against
the changes made here (never against the router's own state), the kept views and their class
indexes move only with a committed refit, the bytes counted are the bytes handed to the group, the
owner choice routes the fewest changes, and a whole refit (DeltaRefit on three row-shard ranks
into one engine) puts fewer bytes on the trainer links than on the engine link."""

from __future__ import annotations

import concurrent.futures as cf
import threading

import numpy as np
import pytest
import torch

from nemo_dcr.apply import TensorEngine
from nemo_dcr.codec import DcrIndex
from nemo_dcr.config.schema import DcrConfig
from nemo_dcr.layout import canonical_shapes, model_dims
from nemo_dcr.refit import DeltaRefit, EngineServer, engine_wiring
from nemo_dcr.refit.group import TransportGroup
from nemo_dcr.refit.route_views import Router
from nemo_dcr.refit.routing import assign_owners
from nemo_dcr.transport import Envelope, InProcHub, MessageKind
from nemo_dcr.types import DTYPES, SparseDelta, int_view
from nemo_dcr.verify.checksum import tensor_checksum
from tests.standins.shard_trainer import ShardTrainer, row_range

WORLD = 3
SHAPES = {"a.weight": (48, 32), "b.weight": (64, 16), "norm.weight": (30,), "c.weight": (12, 8)}
KEY = b"route-views-key-0123456789abcdef"


class Recording:
    """A trainer group that records the bytes each exchange hands it for other members."""

    def __init__(self, inner):
        self.inner, self.rank, self.size, self.handed = inner, inner.rank, inner.size, []

    def exchange(self, outgoing):
        self.handed.append([len(b) for b in outgoing])
        return self.inner.exchange(outgoing)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _groups(world: int, extra: int = 0):
    hub = InProcHub(world + extra)
    return hub, [Recording(TransportGroup(hub.transport(r), range(world), timeout=60)) for r in range(world)]


def _on_all(groups, fn):
    with cf.ThreadPoolExecutor(len(groups)) as ex:
        return [f.result() for f in [ex.submit(fn, g) for g in groups]]


def _rows(name: str, rank: int) -> np.ndarray:
    """Canonical flat indices rank ``rank`` captures of ``name`` (its rows; ``c`` on rank 2 only)."""
    shape = SHAPES[name]
    if name == "c.weight":
        return np.arange(int(np.prod(shape))) if rank == 2 else np.zeros(0, np.int64)
    lo, hi = row_range(shape[0], rank, WORLD)
    cols = int(np.prod(shape[1:]))
    return np.arange(lo * cols, hi * cols, dtype=np.int64)


def _pieces(bits: dict, rank: int, changed: dict | None = None, old: dict | None = None) -> list[SparseDelta]:
    """Rank ``rank``'s pieces: every element it captures (attach) or its changes (``changed``)."""
    out = []
    for n, shape in SHAPES.items():
        pos = _rows(n, rank)
        if changed is not None:
            pos = np.intersect1d(pos, changed[n])
        if pos.size:
            out.append(SparseDelta(n, "bf16", shape, pos, bits[n][pos].copy(),
                                   None if old is None else old[n][pos].copy()))
    return out


def _owners():
    shares = {n: {r: int(_rows(n, r).size) for r in range(WORLD) if _rows(n, r).size} for n in SHAPES}
    return assign_owners({n: int(np.prod(s)) for n, s in SHAPES.items()}, WORLD, shares)


def _step(bits: dict, rng, frac: float = 0.02) -> dict:
    """Change a random ``frac`` of every tensor by one or two ULPs (in place); returns positions."""
    out = {}
    for n, b in bits.items():
        pos = np.sort(rng.choice(b.size, max(1, int(frac * b.size)), replace=False))
        b[pos] = b[pos] + rng.integers(1, 3, pos.size).astype(np.uint16)
        out[n] = pos
    return out


def _f32(rng, n: int) -> np.ndarray:
    return (rng.standard_normal(n) * 0.05).astype(np.float32).view(np.uint32)


def _views(router: Router) -> list:
    """``((tensor, sender rank), view)`` of every view ``router`` keeps (their indexes moved)."""
    router.wait()
    return [((n, router.group.rank), v) for n, v in router.outgoing.items()] + list(router.incoming.items())


def test_view_coded_route_round_trips_bit_exact_and_keeps_and_moves_views():
    rng = np.random.default_rng(0)
    bits = {n: (_f32(rng, int(np.prod(s))) >> 16).astype(np.uint16) for n, s in SHAPES.items()}  # bf16 bits
    owners = _owners()
    assert owners["c.weight"] == 2  # captured by rank 2 alone: it owns it, nothing of it is routed
    canonical = {n: ("bf16", s) for n, s in SHAPES.items()}
    _, groups = _groups(WORLD)
    routers = [Router(g, owners, canonical, KEY) for g in groups]

    def route(pieces_of, attach=False):
        return _on_all(groups, lambda g: routers[g.rank].route(pieces_of(g.rank), attach))

    got = route(lambda r: _pieces(bits, r), attach=True)
    for r, deltas in enumerate(got):  # every owner holds every element of what it owns
        assert sorted(d.name for d in deltas) == sorted(n for n, o in owners.items() if o == r)
        for d in deltas:
            assert d.positions.tolist() == list(range(bits[d.name].size)) and np.array_equal(d.new_bits, bits[d.name])
    assert "c.weight" not in routers[2].outgoing and all(k[0] != "c.weight" for r in routers for k in r.incoming)
    for r in routers:
        r.end(True)
    indexes = {id(v.index) for r in routers for _, v in _views(r)}
    prev, before = {}, {}  # step 2's changes and baseline, for step 3
    for step, committed in ((1, True), (2, False), (3, True)):
        old = {n: b.copy() for n, b in bits.items()}
        changed = _step(bits, rng)
        if step == 3:  # step 2 was not committed: its changes are sent again, against the same views
            changed = {n: np.union1d(changed[n], prev[n]) for n in bits}
            old = before
        got = route(lambda r: _pieces(bits, r, changed, old))
        for r, deltas in enumerate(got):
            for d in deltas:
                assert owners[d.name] == r
                assert np.array_equal(d.positions, changed[d.name]) and np.array_equal(d.new_bits, bits[d.name][d.positions])
                assert np.array_equal(d.old_bits, old[d.name][d.positions])
        for r in routers:
            r.end(committed)
        base = bits if committed else old
        for r in routers:  # both copies of every view hold the capture baseline, and its index describes it
            for (name, sender), view in _views(r):
                want = base[name][_rows(name, sender)]
                assert np.array_equal(view.bits, want) and view.checksum == tensor_checksum(want)
                fresh = DcrIndex.build(want, DTYPES["bf16"])
                assert all(np.array_equal(a, b) for a, b in zip(view.index.tables(), fresh.tables()))
        prev, before = changed, old
    assert {id(v.index) for r in routers for _, v in _views(r)} == indexes  # kept and moved, never rebuilt


def test_bytes_counted_are_the_bytes_handed_to_the_group():
    bits = {n: np.arange(int(np.prod(s)), dtype=np.uint16) * 7 for n, s in SHAPES.items()}
    owners, canonical = _owners(), {n: ("bf16", s) for n, s in SHAPES.items()}
    _, groups = _groups(WORLD)
    hosts = ("n1", "n1", "n2")
    routers = [Router(g, owners, canonical, None, hosts) for g in groups]
    _on_all(groups, lambda g: routers[g.rank].route(_pieces(bits, g.rank), attach=True))
    for g, r in zip(groups, routers):
        handed = groups[g.rank].handed[-1]
        assert r.sent.to_others == sum(n for d, n in enumerate(handed) if d != g.rank) > 0
        assert r.sent.to_other_hosts == sum(n for d, n in enumerate(handed) if hosts[d] != hosts[g.rank])
        assert handed[g.rank] == 0  # nothing to itself
    assert routers[2].sent.to_other_hosts == routers[2].sent.to_others  # rank 2 is alone on n2


def _stage_shares(tp: int, pp: int) -> tuple[dict[str, int], dict[str, dict[int, int]]]:
    """SmolLM2's canonical tensors captured as a TP x PP megatron job does: the ranks of the stage
    holding a layer split each of its tensors evenly (embedding on the first stage, the final norm
    on the last)."""
    dims = model_dims("smollm2")
    shapes = canonical_shapes(dims.family, dims)
    sizes = {n: int(np.prod(s)) for n, s in shapes.items()}
    shares = {}
    for n, size in sizes.items():
        layer = int(n.split(".")[2]) if n.startswith("model.layers.") else (0 if "embed" in n else dims.num_layers - 1)
        stage = layer * pp // dims.num_layers
        shares[n] = {stage * tp + t: size // tp + (t < size % tp) for t in range(tp)}
    return sizes, shares


def _routed(sizes, shares, owners) -> float:
    return sum(c for n, s in shares.items() for r, c in s.items() if r != owners[n]) / sum(sizes.values())


def test_owners_are_chosen_to_route_the_fewest_changes_and_stay_balanced():
    sizes, shares = _stage_shares(tp=3, pp=2)
    chosen = assign_owners(sizes, 6, shares)
    by_size = assign_owners(sizes, 6)  # the choice without shares: any rank, by load alone
    routed, before = _routed(sizes, shares, chosen), _routed(sizes, shares, by_size)
    print(f"routed fraction: {routed:.3f} with captured shares, {before:.3f} by size alone")
    assert routed == pytest.approx(2 / 3, abs=1e-3) and before > routed + 0.1
    load = np.zeros(6)
    for n, r in chosen.items():
        load[r] += sizes[n]
    captured = np.zeros(6)
    for s in shares.values():
        for r, c in s.items():
            captured[r] += c
    for stage in (load[:3], load[3:]):  # each stage encodes what it captures, its TP ranks share it evenly
        assert stage.max() / stage.min() < 1.1
    assert np.allclose(load[:3].sum(), captured[:3].sum()) and np.allclose(load[3:].sum(), captured[3:].sum())
    assert assign_owners({"x": 100, "y": 60, "z": 50}, 2) == {"x": 0, "y": 1, "z": 1}  # no shares: by size
    assert assign_owners({"x": 10, "y": 10}, 3, {"x": {2: 10}, "y": {1: 6, 2: 4}}) == {"x": 2, "y": 1}


def test_three_trainer_ranks_refit_bit_exact_with_fewer_bytes_between_trainers_than_to_the_engine():
    shapes = {"a.weight": (96, 64), "b.weight": (128, 32), "norm.weight": (64,)}
    hub, groups = _groups(WORLD, extra=1)
    engine = TensorEngine({n: torch.zeros(s, dtype=torch.bfloat16) for n, s in shapes.items()}, key=KEY)
    server = EngineServer(engine, hub.transport(WORLD), list(range(WORLD)))
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    trainers = [ShardTrainer(shapes, r, WORLD, lr=5e-6, seed=4) for r in range(WORLD)]
    cfg = DcrConfig(transport="inprocess", reply_timeout_s=120, telemetry_encodings=[])
    refits = _on_all(groups, lambda g: DeltaRefit(cfg, trainers[g.rank], engine_wiring(
        hub.transport(g.rank), range(WORLD), [WORLD], g), key=KEY))

    def exact() -> bool:
        return all(torch.equal(int_view(engine.tensors[n]), torch.cat([int_view(t.params[n]) for t in trainers]))
                   for n in shapes)

    try:
        attach = _on_all(groups, lambda g: refits[g.rank].attach())
        assert all(r.committed for r in attach) and exact()
        assert attach[0].route_bytes < sum(int(np.prod(s)) for s in shapes.values()) * 2  # views: 2 B per element
        for _ in range(3):
            for t in trainers:
                t.step()
            reports = _on_all(groups, lambda g: refits[g.rank].step())
            r = reports[0]
            assert all(x.committed and x.mode == "delta" for x in reports) and exact()
            assert len({(x.version, x.changed, x.route_bytes, x.payload_bytes) for x in reports}) == 1
            handed = sum(n for g in groups for d, n in enumerate(g.handed[-1]) if d != g.rank)
            links = r.bytes_on_links
            print(f"density {r.density:.2%}: trainer_to_trainer {links['trainer_to_trainer']} B, "
                  f"trainer_to_engine {links['trainer_to_engine']} B")
            assert 0 < links["trainer_to_trainer"] == r.route_bytes == handed
            assert links["trainer_to_trainer"] <= links["trainer_to_engine"] == r.payload_bytes
            assert list(r.bytes_by_host.values()) == [{"trainer_to_trainer": r.route_bytes,
                                                       "trainer_to_engine": r.payload_bytes,
                                                       "trainer_to_other_hosts": 0}]
    finally:
        _on_all(groups, lambda g: refits[g.rank].close(5))
        hub.transport(0).send(WORLD, Envelope(MessageKind.STOP, 0, 0))
        thread.join(10)


def test_first_sync_pieces_share_one_position_array_and_are_not_copied_on_the_way():
    from nemo_dcr.refit.canonical import CanonicalSource
    from nemo_dcr.refit.mirror import SenderMirror
    from nemo_dcr.refit.routing import merge

    tensors = {"a": torch.arange(1, 7, dtype=torch.bfloat16), "b": torch.arange(1, 13, dtype=torch.bfloat16).reshape(3, 4)}
    pieces = CanonicalSource(tensors).pieces()
    assert [p.positions.tolist() for p in pieces] == [list(range(6)), list(range(12))]
    assert np.shares_memory(pieces[0].positions, pieces[1].positions) and not pieces[0].positions.flags.writeable
    merged = merge(pieces)
    assert all(m is p for m, p in zip(merged, pieces))  # one ordered piece per tensor: no copy
    mirror = SenderMirror({n: ("bf16", tuple(t.shape)) for n, t in tensors.items()})
    owned = mirror.changes(merged)
    assert all(o.positions is p.positions and o.new_bits is p.new_bits for o, p in zip(owned, pieces))
    assert all(not o.old_bits.any() for o in owned)
    with pytest.raises(ValueError, match="captured twice"):
        merge([SparseDelta("a", "bf16", (6,), np.array([0, 2, 2], np.int64), np.ones(3, np.uint16))])
