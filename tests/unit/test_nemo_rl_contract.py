"""Contract test of the NeMo-RL plugin against NeMo-RL 0.6.0's seams (commit 7ea279ab).

NeMo-RL cannot be installed here, so :class:`NemoRlStandInCaller` replays what its code does
with a checkpoint engine, step by step (``create_checkpoint_engine`` resolving "module:Class"
and calling ``cls(bucket_size=..., **engine_kwargs)``; ``prepare`` on every worker;
``init_policy_process_group`` / ``init_rollout_process_group`` with keyword arguments;
``send_weights`` awaited on every policy worker; ``receive_weight_batches`` iterated with
``async for`` by each rollout worker, batches handed to ``load_weights``; ``finalize``).
The ``engine_kwargs`` are what ``checkpoint_engine_refit_config`` derives from
``refit_cfg[<selector>]``: everything except ``update_weights_bucket_memory_ratio``.
"""

from __future__ import annotations

import asyncio
import importlib

import pytest
import torch

from nemo_dcr.adapters.nemo_rl import SELECTOR, DcrCheckpointEngine, DcrWeightSynchronizer
from nemo_dcr.types import int_view


class NemoRlStandInCaller:
    """Stand-in for NeMo-RL's CheckpointEngineWeightSynchronizer + worker mixins (no Ray)."""

    def __init__(self, selector: str, refit_cfg: dict, n_policy: int = 2, n_rollout: int = 2):
        kwargs = {k: v for k, v in refit_cfg.items() if k != "update_weights_bucket_memory_ratio"}
        module, cls = selector.split(":", 1)
        engine_cls = getattr(importlib.import_module(module), cls)
        self.policy = [engine_cls(bucket_size=1 << 20, **kwargs) for _ in range(n_policy)]
        self.rollout = [engine_cls(bucket_size=1 << 20, **kwargs) for _ in range(n_rollout)]
        meta = [e.prepare() for e in self.policy + self.rollout]
        for r, e in enumerate(self.policy):
            e.init_policy_process_group(worker_rank=r, train_world_size=n_policy,
                                        rollout_world_size=n_rollout, metadata=meta)
        for r, e in enumerate(self.rollout):
            e.init_rollout_process_group(rollout_rank=r, train_world_size=n_policy,
                                         rollout_world_size=n_rollout, metadata=meta)

    def refit(self, policy_state: dict, engines_state: list[dict]) -> list[int]:
        async def run():
            for e in self.policy:  # every policy worker iterates the (collective) export
                await e.send_weights(iter(policy_state.items()))
            loaded = []
            for e, state in zip(self.rollout, engines_state):
                n = 0
                async for batch in e.receive_weight_batches():
                    for name, t in batch:  # vLLM's load_weights
                        state[name].copy_(t)
                        n += 1
                loaded.append(n)
            return loaded
        out = asyncio.run(run())
        for e in self.policy + self.rollout:
            e.finalize()
        return out


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model.embed_tokens.weight": torch.randn(64, 16, generator=g).bfloat16(),
            "model.layers.0.mlp.up_proj.weight": torch.randn(32, 16, generator=g).bfloat16(),
            "model.norm.weight": torch.ones(16).bfloat16()}


def _step(state: dict, frac: float, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for name, t in state.items():
        if "norm" in name:
            continue
        mask = torch.rand(t.shape, generator=g) < frac
        t[mask] = (t.float()[mask] * 1.01).bfloat16()


def _same(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(int_view(a[k]), int_view(b[k])) for k in a)


def test_checkpoint_engine_lifecycle_is_bit_exact(tmp_path):
    key = tmp_path / "key"
    key.write_bytes(b"0123456789abcdef0123")
    cfg = {"update_weights_bucket_memory_ratio": 0.05, "release_after_refit": False,
           "url": str(tmp_path / "refit"), "encoding": "dcr", "key_file": str(key)}
    caller = NemoRlStandInCaller(SELECTOR, cfg)
    policy = _state(0)
    engines = [{k: torch.zeros_like(v) for k, v in policy.items()} for _ in range(2)]
    assert caller.refit(policy, engines) == [3, 3]  # first refit: full resync, every tensor
    assert all(_same(policy, e) for e in engines)
    for step in range(1, 4):
        _step(policy, 0.02, step)
        loaded = caller.refit(policy, engines)
        assert all(_same(policy, e) for e in engines), step
        assert loaded == [2, 2]  # the norm did not change: not reloaded
        stats = caller.policy[0].last_stats
        assert not stats["resync"] and stats["payload_bytes"] < stats["dense_bytes"] / 5


def test_refit_cfg_errors_name_the_key(tmp_path):
    with pytest.raises(ValueError, match="unknown refit_cfg keys.*'bogus'"):
        DcrCheckpointEngine(1024, url=str(tmp_path), bogus=1)
    with pytest.raises(ValueError, match="encoding"):
        DcrCheckpointEngine(1024, url=str(tmp_path), encoding="zip")
    with pytest.raises(ValueError, match="url"):
        DcrCheckpointEngine(1024)


def test_tampered_payload_is_refused(tmp_path):
    key = tmp_path / "key"
    key.write_bytes(b"0123456789abcdef0123")
    cfg = {"url": str(tmp_path / "r"), "key_file": str(key)}
    caller = NemoRlStandInCaller(SELECTOR, cfg, 1, 1)
    policy = _state(1)
    engine = {k: torch.zeros_like(v) for k, v in policy.items()}
    caller.refit(policy, [engine])
    _step(policy, 0.05, 9)
    asyncio.run(caller.policy[0].send_weights(iter(policy.items())))
    path = sorted((tmp_path / "r").glob("*.dcr"))[-1]
    data = bytearray(path.read_bytes())
    data[-40] ^= 1
    path.write_bytes(bytes(data))

    async def drain():
        return [b async for b in caller.rollout[0].receive_weight_batches()]
    with pytest.raises(Exception, match="MAC|crc|checksum"):
        asyncio.run(drain())
    assert caller.rollout[0].version == 1  # still the old version


def test_weight_synchronizer_interface(tmp_path):
    policy = _state(2)
    engine = {k: torch.zeros_like(v) for k, v in policy.items()}

    def load(batch):
        for n, t in batch:
            engine[n].copy_(t)
    sync = DcrWeightSynchronizer(lambda: iter(policy.items()), load, {"url": str(tmp_path)})
    assert sync.is_stale
    sync.init_communicator()
    m = sync.sync_weights(timer=None, kv_scales=None)
    assert not sync.is_stale and _same(policy, engine) and m["dcr/version"] == 1.0
    _step(policy, 0.01, 3)
    sync.mark_stale()
    m = sync.sync_weights(timer=None, kv_scales=None)
    assert _same(policy, engine) and 0 < m["dcr/density"] < 0.05
    with pytest.raises(NotImplementedError):
        sync.sync_weights(kv_scales={"k": 1.0})
    sync.shutdown()
