"""The one engine contract (nemo_dcr/apply/contract.py): every engine implements all of it, the
server uses nothing else, and an engine over params plus a placement keeps both checksum spaces
in one owner (canonical sums of its primary elements, view checksums per shard)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import numpy as np
import pytest
import torch

from nemo_dcr.apply import Engine, EngineChecksums, IncompletePartsError, TensorEngine, apply_version
from nemo_dcr.apply.contract import tensor_digests
from nemo_dcr.apply.placement import Runs, TensorPlacement, assign_primary, fills_outside_views, placement_from_json
from nemo_dcr.codec import Identity, encode
from nemo_dcr.refit.payloads import resync_payload
from nemo_dcr.types import bits_view, int_view
from nemo_dcr.verify.checksum import checksum_after, checksums_after, tensor_checksum

ROOT = Path(__file__).resolve().parents[2]
KEY = b"c" * 32
MEMBERS = sorted(m for m in vars(Engine) if not m.startswith("_"))


def _engines():
    from nemo_dcr.integrations.hf.engine import HFEngine
    from nemo_dcr.integrations.vllm.engine import VllmEngine

    return [TensorEngine, HFEngine, VllmEngine]


def test_the_protocol_has_the_members_the_docs_list():
    assert MEMBERS == ["checksums", "commit", "digests", "placement", "preflight", "prepare", "rollback", "serving",
                       "settle", "version"]


@pytest.mark.parametrize("cls", _engines(), ids=lambda c: c.__name__)
def test_every_engine_implements_every_member(cls):
    missing = [m for m in MEMBERS if not hasattr(cls, m)]
    assert not missing, f"{cls.__name__} lacks {missing}"
    assert list(inspect.signature(cls.prepare).parameters) == ["self", "parts", "resync"]
    assert list(inspect.signature(cls.checksums).parameters) == ["self", "full", "sample"]
    assert not hasattr(cls, "apply") and not hasattr(cls, "resync")  # apply = apply_version, in one place


def test_the_server_uses_only_contract_members_and_never_probes():
    tree = ast.parse((ROOT / "nemo_dcr/refit/server.py").read_text())
    calls = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert not calls & {"getattr", "hasattr", "isinstance"}
    used = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute)
            and n.value.attr == "engine"}
    assert used and used <= set(MEMBERS), used - set(MEMBERS)


def _model(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(8, 4, generator=g).bfloat16() for i in range(2)}


def test_parts_for_a_shard_the_engine_lacks_are_refused_and_nothing_is_written():
    base = _model()
    target = {n: (t.float() + 1).bfloat16() for n, t in base.items()}
    engine = TensorEngine({n: t.clone() for n, t in base.items()}, key=KEY)
    payload = encode(base, target, Identity(base_version=0, target_version=1), key=KEY)
    with pytest.raises(IncompletePartsError, match=r"parts for shards \[1\], but this engine has shards 0..0"):
        apply_version(engine, {0: [payload], 1: [payload]})
    assert engine.version == 0 and engine.pending is None
    assert all(torch.equal(int_view(engine.tensors[n]), int_view(t)) for n, t in base.items())
    assert apply_version(engine, {0: [payload]}).target_version == 1
    assert engine.placement() == [] and engine.checksums().views == {}
    assert engine.digests() == tensor_digests(target)


def _placed(base, rank, ranks=2):
    """Rank ``rank`` of a row split of every [8, 4] tensor, each inside a param with two padding
    rows in front (a fused param whose other elements belong to nothing)."""
    rows = 8 // ranks
    placements = []
    for r in range(ranks):
        runs = Runs.from_pairs(np.arange(r * rows * 4, (r + 1) * rows * 4), np.arange(8, 8 + rows * 4))
        placements.append({n: TensorPlacement(n, (8, 4), f"p.{n}", (rows + 2, 4), runs) for n in base})
    placements = assign_primary(placements)
    params = {f"p.{n}": torch.cat([torch.zeros(2, 4), t[rank * rows:(rank + 1) * rows].float()]).bfloat16()
              for n, t in base.items()}
    fills = {f"p.{n}": [(np.array([0, 1, 9]), np.full(3, 7.0, np.float32))] for n in base}  # 9 is a view element
    return TensorEngine(params, key=KEY, placement=placements[rank], fills=fills), placements[rank]


def test_an_engine_over_params_reports_canonical_sums_and_its_views():
    base = _model()
    engines = [_placed(base, r)[0] for r in range(2)]
    sums: dict[str, int] = {}
    for e in engines:
        ck = e.checksums()
        assert isinstance(ck, EngineChecksums) and set(ck.views) == {0}
        assert ck.views[0] == {n: tensor_checksum(bits_view(v.gather())) for n, v in e.tensors.items()}
        for n, c in ck.canonical.items():
            sums[n] = (sums.get(n, 0) + c) % (1 << 64)
        assert placement_from_json(e.placement()[0]).keys() == e.placed.keys()
        assert set(e.digests()) == set(e.params)
    assert sums == {n: tensor_checksum(bits_view(t)) for n, t in base.items()}


def test_settle_waits_for_the_index_move_a_commit_left_running(monkeypatch):
    """``settle()`` returns once the kept indexes' move behind the last commit is done, with the
    seconds it waited; with nothing running (or no indexes kept) it returns at once."""
    import threading
    import time

    from nemo_dcr.codec.dcr.class_index import DcrIndexes

    moved = threading.Event()
    update = DcrIndexes.update

    def slow(self, deltas, threads=1):
        time.sleep(0.3)
        update(self, deltas, threads)
        moved.set()

    monkeypatch.setattr(DcrIndexes, "update", slow)
    base = _model()
    target = {n: (t.float() * 1.5 + 0.25).bfloat16() for n, t in base.items()}
    engine = TensorEngine({n: t.clone() for n, t in base.items()}, key=KEY)
    engine.build_indexes()
    apply_version(engine, {0: [encode(base, target, Identity(base_version=0, target_version=1), key=KEY)]})
    assert not moved.is_set()
    assert engine.settle() >= 0.2 and moved.is_set()
    assert engine.settle() < 0.1
    assert TensorEngine(dict(base), key=KEY, keep_index=False).settle() < 0.1


@pytest.mark.parametrize("ranks", [1, 2])
def test_canonical_sums_follow_committed_deltas_whole_views_and_split_ones(ranks):
    """One rank holding every element (a whole view: its canonical sum is its view checksum, taken
    per tensor) and two ranks splitting the rows (moved by the changes at canonical indices) report
    canonical sums that add up to each target tensor's own checksum after every commit."""
    states = [_model(), _model(seed=5), _model(seed=6)]
    placed = [_placed(states[0], r, ranks) for r in range(ranks)]
    assert all(e.sums._whole == (set(p) if ranks == 1 else set()) for e, p in placed)
    for v, (old, new) in enumerate(zip(states, states[1:]), start=1):
        for engine, placement in placed:
            views = [{n: s[n].reshape(-1)[torch.from_numpy(tp.runs.expand()[0])] for n, tp in placement.items()}
                     for s in (old, new)]
            apply_version(engine, {0: [encode(*views, Identity(base_version=v - 1, target_version=v), key=KEY)]})
        sums: dict[str, int] = {}
        for engine, _ in placed:
            for n, c in engine.checksums().canonical.items():
                sums[n] = (sums.get(n, 0) + c) % (1 << 64)
        assert sums == {n: tensor_checksum(bits_view(t)) for n, t in new.items()}


def test_a_resync_writes_the_loaders_constants_outside_the_views_and_rolls_them_back():
    base, other = _model(), _model(seed=3)
    engine, placement = _placed(base, 1)
    before = {n: int_view(p).clone() for n, p in engine.params.items()}
    views = {n: other[n].reshape(-1)[torch.from_numpy(tp.runs.expand()[0])] for n, tp in placement.items()}
    engine.prepare({0: [resync_payload(views, target_version=2, key=KEY)]}, resync=True)
    for n, p in engine.params.items():
        assert p.reshape(-1)[:2].float().tolist() == [7.0, 7.0]  # constants outside every view
    engine.rollback()
    assert all(torch.equal(int_view(p), before[n]) for n, p in engine.params.items())
    apply_version(engine, {0: [resync_payload(views, target_version=2, key=KEY)]}, resync=True)
    for n, tp in placement.items():
        assert torch.equal(int_view(engine.tensors[n].gather()), int_view(views[n]))  # position 9 kept its view value
    assert engine.checksums() == engine.checksums(full=True)


def test_fills_outside_views_match_a_dense_membership_test():
    g = np.random.default_rng(0)
    runs = Runs.from_pairs(np.arange(40), g.permutation(100)[:40])
    placement = {"t": TensorPlacement("t", (40,), "p", (100,), runs)}
    pos = np.arange(100)
    kept = fills_outside_views({"p": [(pos, pos.astype(np.float32))], "q": [(pos, pos)]}, placement)
    assert kept["p"][0][0].tolist() == pos[~np.isin(pos, runs.expand()[1])].tolist()
    assert kept["q"][0][0].tolist() == pos.tolist()  # a param no view lives in keeps every constant


def test_checksums_after_is_the_full_scan_of_the_changed_tensor():
    g = np.random.default_rng(1)
    old = g.integers(0, 1 << 16, 1000, dtype=np.uint64).astype(np.uint16)
    new = old.copy()
    pos = np.sort(g.choice(1000, 30, replace=False))
    new[pos] ^= 1
    from nemo_dcr.types import SparseDelta

    d = SparseDelta("x", "bf16", (1000,), pos, new[pos], old[pos])
    assert checksum_after(tensor_checksum(old), d) == tensor_checksum(new)
    assert checksums_after({"y": 5}, [d]) == {"y": 5, "x": (tensor_checksum(new) - tensor_checksum(old)) % (1 << 64)}
    with pytest.raises(ValueError, match="x: a checksum follows a delta only with its old bits"):
        checksum_after(0, SparseDelta("x", "bf16", (1000,), pos, new[pos]))


def test_the_forwarding_engine_forwards_every_member_of_the_contract():
    import inspect

    from nemo_dcr.apply import Engine, ForwardingEngine

    members = {n for n, _ in inspect.getmembers(Engine) if not n.startswith("_")}
    assert members and members <= set(vars(ForwardingEngine)), members - set(vars(ForwardingEngine))
