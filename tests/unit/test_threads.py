"""``dcr.threads``: worker threads over a part's records give the bytes, the engine state and the
errors of one thread (kernels/workers.py)."""

from __future__ import annotations

import os
import re
import threading

import numpy as np
import pytest
import torch

from nemo_dcr.apply import ApplyVerificationError, InjectedFault, TensorEngine, apply_version, transaction
from nemo_dcr.codec import DcrIndexes, DeltaFormatError, Identity, decode, decode_parts, diff_tensors, encode_deltas
from nemo_dcr.codec import payload as payload_mod
from nemo_dcr.codec.errors import BaseChecksumMismatchError
from nemo_dcr.capture import scan as scan_mod
from nemo_dcr.capture.baseline import BaselineStore, BaselineError
from nemo_dcr.config import ConfigError, DcrConfig
from nemo_dcr.kernels import workers
from nemo_dcr.kernels.workers import resolve_threads
from nemo_dcr.types import bits_view
from nemo_dcr.verify.checksum import tensor_checksum

KEY = b"k" * 32
ID = Identity(base_version=0, target_version=1)


@pytest.fixture(autouse=True)
def every_part_parallel(monkeypatch):
    """Small test parts take the worker threads too."""
    monkeypatch.setattr(workers, "MIN_PARALLEL_CHANGES", 0)


def _model(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layer{i}.weight": (torch.randn(64, 48, generator=g) * 10.0 ** -(i % 3)).to(torch.bfloat16)
            for i in range(6)}


def _step(tensors, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return {n: (t.float() + torch.randn(t.shape, generator=g) * t.float().abs() * 0.02).to(torch.bfloat16)
            for n, t in tensors.items()}


def _payload(model, target, threads: int, encoding: str = "dcr") -> bytes:
    bits = {n: bits_view(t.clone()) for n, t in model.items()}
    cks = {n: tensor_checksum(b) for n, b in bits.items()}
    return encode_deltas(diff_tensors(model, target), bits, ID, encoding, KEY, cks, DcrIndexes(), threads)


def _threads_calling(monkeypatch, module, name: str) -> set[str]:
    """The names of the threads that call ``module.name`` from now on (the call goes through)."""
    ran_on: set[str] = set()
    real = getattr(module, name)

    def spy(*a, **k):
        ran_on.add(threading.current_thread().name)
        return real(*a, **k)

    monkeypatch.setattr(module, name, spy)
    return ran_on


@pytest.mark.parametrize("encoding", ["dcr", "reference"])
def test_encode_bytes_are_those_of_one_thread(monkeypatch, encoding):
    model = _model()
    target = _step(model)
    ran_on = _threads_calling(monkeypatch, payload_mod, "encode_record")
    one = _payload(model, target, 1, encoding)
    assert ran_on == {threading.current_thread().name}
    ran_on.clear()
    assert _payload(model, target, 3, encoding) == one
    assert any(n.startswith("nemo-dcr-worker") for n in ran_on)


def test_capture_scans_params_side_by_side_with_the_deltas_of_one_thread(monkeypatch):
    model = _model()
    target = _step(model)
    ranges = {"layer1.weight": (100, 2000), "layer2.weight": (0, 0)}  # a slice, and a param not owned
    ran_on = _threads_calling(monkeypatch, scan_mod, "scan_param")
    got = {}
    for threads in (1, 3):
        store = BaselineStore("pinned")
        for n, t in model.items():
            store.register(n, t)
        got[threads] = scan_mod.capture(target, store, ranges, version=1, chunk=1000, threads=threads)
        assert store.pending_versions() == [1]
    assert [d.name for d in got[3]] == [d.name for d in got[1]] and "layer2.weight" not in [d.name for d in got[1]]
    for a, b in zip(got[1], got[3]):
        assert a.nnz and all(torch.equal(torch.as_tensor(getattr(a, f)), torch.as_tensor(getattr(b, f)))
                             for f in ("positions", "new_bits", "old_bits"))
    assert any(n.startswith("nemo-dcr-worker") for n in ran_on)
    bad = dict(target, **{"layer3.weight": target["layer3.weight"].float()})
    with pytest.raises(BaselineError, match="layer3.weight"):  # checked before any worker starts
        scan_mod.capture(bad, store, threads=3)


def test_engine_state_is_that_of_one_thread():
    model = _model()
    target, again = _step(model, 1), _step(_step(model, 1), 2)
    engines = {n: TensorEngine({k: t.clone() for k, t in model.items()}, key=KEY, threads=n) for n in (1, 3)}
    assert engines[3].threads == 3
    results = {n: apply_version(engine, {0: [_payload(model, target, 1)]}) for n, engine in engines.items()}
    for name in model:
        assert torch.equal(bits_view_t(engines[1].tensors[name]), bits_view_t(engines[3].tensors[name]))
        assert torch.equal(bits_view_t(engines[3].tensors[name]), bits_view_t(target[name]))
    assert results[1].touched == results[3].touched and results[1].checksums == results[3].checksums
    assert engines[1].indexes.moves == engines[3].indexes.moves
    # the next version decodes with the indexes the threaded commit moved
    nxt = encode_deltas(diff_tensors(target, again), {n: bits_view(t.clone()) for n, t in target.items()},
                        Identity(base_version=1, target_version=2), "dcr", KEY)
    for engine in engines.values():
        apply_version(engine, {0: [nxt]})
        assert engine.indexes.builds == len(model)  # built once, then moved by commits, never rebuilt
    for name in model:
        assert torch.equal(bits_view_t(engines[3].tensors[name]), bits_view_t(again[name]))


def bits_view_t(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def _address(view) -> int:
    """Data address of what the transaction writes: a tensor's integer view or a host tensor's numpy bits."""
    return view.__array_interface__["data"][0] if isinstance(view, np.ndarray) else view.data_ptr()


def _failing(engine_threads: int, monkeypatch, how: str):
    model = _model()
    engine = TensorEngine({k: t.clone() for k, t in model.items()}, key=KEY, threads=engine_threads)
    data = _payload(model, _step(model), 1)
    if how == "fault":
        def fault(name):
            if name in ("layer2.weight", "layer4.weight"):
                raise InjectedFault(f"fault after {name}")
        engine.fault = fault
    else:  # the read-back check finds two tensors that do not hold what was written
        bad = {engine.tensors[n].data_ptr() for n in ("layer3.weight", "layer5.weight")}
        real = transaction.unequal_at
        monkeypatch.setattr(transaction, "unequal_at",
                            lambda view, pos, new: 0 if _address(view) in bad else real(view, pos, new))
    with pytest.raises(Exception) as err:
        apply_version(engine, {0: [data]})
    for n, t in model.items():
        assert torch.equal(bits_view_t(engine.tensors[n]), bits_view_t(t)), n  # rolled back, bit for bit
    assert engine.version == 0 and engine.pending is None
    return type(err.value), str(err.value)


@pytest.mark.parametrize("how, kind", [("fault", InjectedFault), ("readback", ApplyVerificationError)])
def test_a_failing_worker_rolls_back_and_reports_like_one_thread(monkeypatch, how, kind):
    one = _failing(1, monkeypatch, how)
    assert one[0] is kind
    assert _failing(3, monkeypatch, how) == one


def _fused_engine(threads: int, model) -> TensorEngine:
    """layer0 and layer5 are views of one fused tensor (as vLLM's q/k/v are of qkv_proj)."""
    fused = torch.cat([model["layer0.weight"], model["layer5.weight"]]).clone()
    tensors = {n: t.clone() for n, t in model.items()}
    tensors["layer0.weight"], tensors["layer5.weight"] = fused[:64], fused[64:]
    return TensorEngine(tensors, key=KEY, threads=threads)


def test_tensors_sharing_memory_are_written_in_order_beside_the_others(monkeypatch):
    model = _model()
    target = _step(model)
    data = _payload(model, target, 1)
    one = _fused_engine(1, model)
    apply_version(one, {0: [data]})
    ran_on = _threads_calling(monkeypatch, transaction, "write_bits")
    many = _fused_engine(3, model)
    apply_version(many, {0: [data]})
    assert any(n.startswith("nemo-dcr-worker") for n in ran_on)  # not all on the calling thread, in order
    for n, t in target.items():
        assert torch.equal(bits_view_t(many.tensors[n]), bits_view_t(t)), n
        assert torch.equal(bits_view_t(many.tensors[n]), bits_view_t(one.tensors[n])), n


def test_a_fault_in_shared_memory_reports_the_first_failing_tensor_like_one_thread():
    model = _model()
    data = _payload(model, _step(model), 1)

    def fault(name):
        if name in ("layer2.weight", "layer5.weight"):  # layer5 shares layer0's memory, written first
            raise InjectedFault(f"fault after {name}")

    seen = []
    for threads in (1, 3):
        engine = _fused_engine(threads, model)
        engine.fault = fault
        with pytest.raises(InjectedFault) as err:
            apply_version(engine, {0: [data]})
        for n, t in model.items():
            assert torch.equal(bits_view_t(engine.tensors[n]), bits_view_t(t)), n  # rolled back
        seen.append(str(err.value))
    assert seen == ["fault after layer2.weight"] * 2


def test_decode_raises_the_first_failing_record_like_one_thread():
    model = _model()
    data = _payload(model, _step(model), 1)
    cks = {n: tensor_checksum(bits_view(t)) for n, t in model.items()}
    cks["layer1.weight"] ^= 1
    cks["layer4.weight"] ^= 1
    msgs = []
    for threads in (1, 3):
        with pytest.raises(BaseChecksumMismatchError) as err:
            decode(data, model, KEY, cks, DcrIndexes(), threads)
        msgs.append(str(err.value))
    assert msgs[0] == msgs[1] and "layer1.weight" in msgs[0]


def _one_record_parts(model, target) -> list[bytes]:
    """One part per tensor (a sender that owns one tensor each, as an embedding's owner does)."""
    return [_payload({n: model[n]}, {n: target[n]}, 1) for n in model]


def test_parts_of_one_record_each_share_the_worker_threads(monkeypatch):
    model = _model()
    target = _step(model)
    parts = _one_record_parts(model, target)
    cks = {n: tensor_checksum(bits_view(t)) for n, t in model.items()}
    one = [decode(p, model, KEY, cks, DcrIndexes(), 1) for p in parts]
    ran_on = _threads_calling(monkeypatch, payload_mod, "decode_record")
    got = decode_parts(parts, model, KEY, cks, DcrIndexes(), 3)
    assert any(n.startswith("nemo-dcr-worker") for n in ran_on)  # a part of one record alone stays on the caller
    assert [d.header for d in got] == [d.header for d in one]
    for a, b in zip(got, one):
        for x, y in zip(a.deltas, b.deltas, strict=True):
            assert x.name == y.name and np.array_equal(x.positions, y.positions)
            assert np.array_equal(x.new_bits, y.new_bits) and np.array_equal(x.old_bits, y.old_bits)


def test_decode_parts_raises_the_first_error_part_after_part_like_one_thread():
    model = _model()
    target = _step(model)
    parts = _one_record_parts(model, target)
    cks = {n: tensor_checksum(bits_view(t)) for n, t in model.items()}
    bad_base = dict(cks, **{"layer1.weight": cks["layer1.weight"] ^ 1})
    truncated = parts[:3] + [parts[3][:-1]] + parts[4:]
    with pytest.raises(DeltaFormatError) as alone:  # what the truncated part 3 alone is refused with
        decode(parts[3][:-1], model, KEY, cks, DcrIndexes())
    for threads in (1, 3):
        with pytest.raises(BaseChecksumMismatchError, match=re.escape("layer1.weight")):  # part 1, before part 3
            decode_parts(truncated, model, KEY, bad_base, DcrIndexes(), threads)
        with pytest.raises(type(alone.value)) as err:
            decode_parts(truncated, model, KEY, cks, DcrIndexes(), threads)
        assert str(err.value) == str(alone.value)


def test_small_parts_stay_on_the_calling_thread(monkeypatch):
    monkeypatch.setattr(workers, "MIN_PARALLEL_CHANGES", 1 << 16)
    names = workers.map_records(lambda _: threading.current_thread().name, range(4), 4, lambda _: 100)
    assert set(names) == {threading.current_thread().name}
    assert workers.map_records(lambda x: x * 2, range(5), 4) == [0, 2, 4, 6, 8]


@pytest.mark.parametrize("value", [0, -2, "many", True, 1.5, None])
def test_bad_threads_are_refused_at_config_load(value):
    with pytest.raises(ConfigError) as err:
        DcrConfig.from_mapping({"threads": value})
    assert str(err.value).startswith("dcr.threads: must be")


def test_threads_values(monkeypatch):
    assert DcrConfig.from_mapping({"threads": 4}).threads == 4
    assert DcrConfig().threads == "auto"
    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert resolve_threads("auto") == cores and resolve_threads(3) == 3
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cores * 4))
    assert resolve_threads("auto") == 1  # more processes than cores: one each
    assert resolve_threads("auto", processes=1) == cores  # an engine counts as one process
    with pytest.raises(ValueError, match="positive int or 'auto'"):
        resolve_threads(0)


def test_a_job_behind_runs_one_at_a_time_and_its_error_is_raised_once_at_the_next_wait():
    behind, order, gate = workers.Behind("test-behind"), [], threading.Event()

    def slow():
        gate.wait(5)
        order.append("first")

    behind.start(slow)
    assert order == []  # start returned while the job waits
    gate.set()
    behind.start(lambda: order.append("second"))  # waits for the first job before it starts
    behind.wait()
    assert order == ["first", "second"]
    behind.start(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        behind.wait()
    behind.wait()  # raised once; nothing in flight now


def test_the_routers_views_move_their_indexes_behind_the_end_of_a_refit():
    from nemo_dcr.apply.placement import Runs
    from nemo_dcr.codec import DcrIndex
    from nemo_dcr.refit.route_views import Router, View
    from nemo_dcr.types import DTYPES

    bf16 = DTYPES["bf16"]
    bits = np.arange(64, dtype=np.uint16) + 0x3F00
    view = View.build(Runs(np.array([0]), np.array([0]), np.array([64])), bits.copy(), bf16)
    router = Router(None, {}, {"w": ("bf16", (64,))})  # its views alone: end and wait need no group
    router.outgoing["w"] = view
    j = np.array([3, 40])
    new = np.array([0xBF80, 0x4100], np.uint16)
    view.staged = (j, bits[j], new)
    started, release, done = threading.Event(), threading.Event(), []
    update = view.index.update

    def held(*a):
        started.set()
        release.wait(5)
        done.append(update(*a))

    view.index.update = held
    router.end(True)  # returns with the bits moved and the index move in flight
    assert started.wait(5) and not done  # the move runs on its own thread, not yet finished
    bits[j] = new
    assert np.array_equal(view.bits, bits) and view.staged is None
    release.set()
    router.wait()
    assert len(done) == 1
    assert view.checksum == DcrIndex.build(bits, bf16).checksum
    assert all(np.array_equal(a, b) for a, b in zip(view.index.tables(), DcrIndex.build(bits, bf16).tables()))


def test_the_sender_mirror_moves_its_indexes_behind_a_commit():
    from nemo_dcr.codec import DcrIndex, Identity
    from nemo_dcr.refit.mirror import SenderMirror
    from nemo_dcr.types import DTYPES, SparseDelta

    bf16 = DTYPES["bf16"]
    mirror = SenderMirror({"w": ("bf16", (64,))})
    mirror.build_indexes()
    index = mirror.indexes.get("w", mirror.bits["w"], bf16, mirror.checksums["w"])
    pos = np.array([3, 40])
    new = np.array([0xBF80, 0x4100], np.uint16)
    (delta,) = mirror.changes([SparseDelta("w", "bf16", (64,), pos, new)])
    mirror.encode([delta], Identity("m", "", 0, 1), "dcr", None, 1 << 20)
    started, release, done = threading.Event(), threading.Event(), []
    update = index.update

    def held(*a):
        started.set()
        release.wait(5)
        done.append(update(*a))
        return done[-1]

    index.update = held
    mirror.commit(1)  # returns with the bits and checksums moved and the index move in flight
    assert started.wait(5) and not done
    bits = np.zeros(64, np.uint16)
    bits[pos] = new
    assert mirror.version == 1 and np.array_equal(mirror.bits["w"], bits)
    release.set()
    indexes = mirror.indexes  # waits for the move
    assert len(done) == 1 and indexes.builds == 1 and indexes.moves == done[0]
    assert indexes.kept("w", 64, bf16, mirror.checksums["w"]) is index
    assert all(np.array_equal(a, b) for a, b in zip(index.tables(), DcrIndex.build(bits, bf16).tables()))


def test_an_error_of_the_mirrors_index_move_is_raised_at_the_next_use():
    from nemo_dcr.codec import Identity
    from nemo_dcr.refit.mirror import SenderMirror
    from nemo_dcr.types import SparseDelta

    mirror = SenderMirror({"w": ("bf16", (8,))})
    mirror.build_indexes()
    (delta,) = mirror.changes([SparseDelta("w", "bf16", (8,), np.array([1]), np.array([0x3F80], np.uint16))])
    mirror.encode([delta], Identity("m", "", 0, 1), "dcr", None, 1 << 20)

    def broken(deltas, threads=1):
        raise MemoryError("index move")

    held = mirror.indexes
    held.update = broken
    mirror.commit(1)
    with pytest.raises(MemoryError, match="index move"):
        mirror.indexes
    assert mirror.indexes is held  # raised once
