"""A **stand-in** for NeMo-RL's checkpoint-engine refit path (NeMo-RL is not installable here).

It makes the calls NVIDIA-NeMo/RL 7ea279ab makes, in the same order and with the same arguments,
with threads where NeMo-RL has Ray actors (see docs/nemo_rl.md for the file:line of each):

* :func:`create_checkpoint_engine`: ``"module:Class"`` resolved, ``Class(bucket_size=..., **kwargs)``
  where ``kwargs`` are ``refit_cfg[selector]`` without ``update_weights_bucket_memory_ratio`` and
  with ``release_after_refit`` (default False), as ``checkpoint_engine_refit_config`` derives them.
* :class:`PolicyWorker`: NeMo-RL's policy-worker mixin: ``prepare()`` metadata gets ``"rank"``,
  ``init_policy_process_group(worker_rank=...)``, ``send_weights`` awaited with the export iterator
  (the full HF tensors on every rank, optionally slow per tensor like Megatron Bridge).
* :class:`VllmWorker`: one vLLM worker (TP rank) holding the loader-contract model stand-in
  (:mod:`tests.standins.vllm_standin`) with dummy weights, ``checkpoint_engine`` as an attribute,
  ``state_dict_info`` from ``prepare_refit_info``; ``update_weights_from_checkpoint_engine`` runs a
  fresh ``asyncio.run`` per refit and feeds every yielded batch to ``model.load_weights``.
* Megatron policy workers over real megatron-core shards, one process each (Ray actors):
  :mod:`tests.standins.megatron_policy_standin`.
* :class:`Synchronizer`: ``CheckpointEngineWeightSynchronizer``: ``init_communicator`` (refit info,
  engines on every worker, ``prepare`` on all, both ``init_*_process_group`` at the same time) and
  ``sync_weights`` (every policy ``send_weights`` and every vLLM worker's receive **started at the
  same time**), ``is_stale``, ``shutdown`` (``finalize`` on all).
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import importlib
import random
import time
from types import SimpleNamespace
from typing import Callable, Sequence

import torch

from .vllm_standin import StandinDims, StandinModel, canonical_shapes


def create_checkpoint_engine(selector: str, bucket_size: int, refit_cfg: dict):
    """NeMo-RL's ``create_checkpoint_engine`` after ``checkpoint_engine_refit_config``."""
    kwargs = {k: v for k, v in refit_cfg.items() if k != "update_weights_bucket_memory_ratio"}
    kwargs.setdefault("release_after_refit", False)
    module, cls = selector.split(":", 1)
    return getattr(importlib.import_module(module), cls)(bucket_size=bucket_size, **kwargs)


SKIPPED = "model.layers.0.self_attn.rotary_emb.inv_freq"
"""An exported tensor vLLM's ``load_weights`` skips (NeMo-RL's dense refit hands it over anyway)."""


def initial_state(dims: StandinDims, seed: int = 0) -> dict[str, torch.Tensor]:
    """The policy's export: bf16 canonical tensors (norms at one) and one fp32 buffer vLLM skips."""
    g = torch.Generator().manual_seed(seed)
    out = {n: torch.ones(s, dtype=torch.bfloat16) if len(s) == 1 else (torch.randn(s, generator=g) * 0.02).bfloat16()
           for n, s in canonical_shapes(dims).items()}
    out[SKIPPED] = torch.rand(dims.head_dim // 2, generator=g)
    return out


def train_step(state: dict[str, torch.Tensor], seed: int, frac: float = 0.05) -> None:
    """A deterministic stand-in optimizer step: nudges ~``frac`` of every tensor, at least its first
    element (so replicated tensors change too)."""
    g = torch.Generator().manual_seed(1000 + seed)
    for t in state.values():
        mask = torch.rand(t.shape, generator=g) < frac
        mask.view(-1)[0] = True
        t[mask] = (t.float()[mask] + torch.randn(t.shape, generator=g)[mask] * 1e-2).to(t.dtype)


class _CheckpointEngineHost:
    """What NeMo-RL's policy and vLLM checkpoint-engine mixins share: create the engine once per
    worker, and tag its metadata with the worker's rank."""

    rank: int
    checkpoint_engine: object | None

    def init_checkpoint_engine(self, selector: str, bucket_size: int, refit_cfg: dict) -> None:
        if self.checkpoint_engine is None:
            self.checkpoint_engine = create_checkpoint_engine(selector, bucket_size, refit_cfg)

    def prepare_checkpoint_engine(self):
        md = self.checkpoint_engine.prepare()
        return {**md, "rank": self.rank} if isinstance(md, dict) else md

    def finalize_checkpoint_engine(self) -> None:
        if self.checkpoint_engine is not None:
            self.checkpoint_engine.finalize()


class PolicyWorker(_CheckpointEngineHost):
    """One policy worker (NeMo-RL's checkpoint-engine mixin on a Megatron worker)."""

    def __init__(self, rank: int, state: dict[str, torch.Tensor], export_delay_s: float = 0.0):
        self.rank, self.export_delay_s = rank, export_delay_s
        self.state = {n: t.clone() for n, t in state.items()}
        self.checkpoint_engine = None

    def export(self):
        for name, t in self.state.items():
            if self.export_delay_s:
                time.sleep(self.export_delay_s)
            yield name, t.clone()

    def prepare_refit_info(self) -> dict:
        return {n: (t.shape, t.dtype) for n, t in self.state.items()}

    def init_checkpoint_engine_process_group(self, **topology) -> None:
        self.checkpoint_engine.init_policy_process_group(worker_rank=self.rank, **topology)

    def send_weights_via_checkpoint_engine(self) -> None:
        with torch.no_grad():
            asyncio.run(self.checkpoint_engine.send_weights(self.export()))


class VllmWorker(_CheckpointEngineHost):
    """One vLLM worker (a TP rank) with NeMo-RL's extension; the model starts from dummy weights."""

    def __init__(self, dims: StandinDims, tp: int, rank: int, seed: int):
        self.rank = rank
        model = StandinModel(dims, tp, rank)
        g = torch.Generator().manual_seed(seed)
        for p in model.parameters():  # vLLM's load_format=dummy: uniform in [-1e-3, 1e-3]
            p.data.copy_((torch.rand(p.shape, generator=g) * 2e-3 - 1e-3).to(p.dtype))
        self.model_runner = SimpleNamespace(model=model)
        self.checkpoint_engine = None
        self.loaded_tensors = 0
        self.busy_s: Callable[[], float] = lambda: 0.0

    def prepare_refit_info(self, info: dict) -> None:
        self.state_dict_info = info

    def init_checkpoint_engine_process_group(self, rank_prefix: int, train_world: int, rollout_world: int,
                                             metadata: list) -> None:
        self.checkpoint_engine.init_rollout_process_group(rollout_rank=rank_prefix + self.rank,
                                                          train_world_size=train_world,
                                                          rollout_world_size=rollout_world, metadata=metadata)

    async def _update(self) -> bool:
        async for batch in self.checkpoint_engine.receive_weight_batches():
            self.model_runner.model.load_weights(batch)
            self.loaded_tensors += len(batch)
        return True

    def update_weights_from_checkpoint_engine(self) -> bool:
        time.sleep(self.busy_s())  # the vLLM engine finishing a step before the RPC runs
        return asyncio.run(self._update())


def vllm_engines(dims: StandinDims, dp: int, tp: int, seed: int = 0) -> list[list[VllmWorker]]:
    """``dp`` vLLM engines of ``tp`` workers each, dummy-initialised with distinct seeds."""
    return [[VllmWorker(dims, tp, r, seed + 100 * d + r) for r in range(tp)] for d in range(dp)]


class Synchronizer:
    """NeMo-RL's ``CheckpointEngineWeightSynchronizer`` over stand-in workers (threads for actors)."""

    def __init__(self, policy: Sequence[PolicyWorker], engines: Sequence[Sequence[VllmWorker]], selector: str,
                 refit_cfg: dict, bucket_size: int = 1 << 20):
        self.policy, self.engines = list(policy), [list(e) for e in engines]
        self.selector, self.refit_cfg, self.bucket_size = selector, dict(refit_cfg), bucket_size
        self.is_stale, self._ready = True, False

    @property
    def rollout(self) -> list[VllmWorker]:
        return [w for e in self.engines for w in e]

    @staticmethod
    def _all(calls: Sequence[Callable[[], object]]) -> list:
        """Run every call at the same time (one thread each); raise the first failure after all end."""
        with cf.ThreadPoolExecutor(len(calls)) as ex:
            futures = [ex.submit(c) for c in calls]
            cf.wait(futures)
        errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:
            raise errors[0]
        return [f.result() for f in futures]

    def init_communicator(self) -> None:
        info = self.policy[0].prepare_refit_info()
        for w in self.rollout:
            w.prepare_refit_info(info)
        args = (self.selector, self.bucket_size, self.refit_cfg)
        for w in self.policy + self.rollout:
            w.init_checkpoint_engine(*args)
        meta = self._all([w.prepare_checkpoint_engine for w in self.policy + self.rollout])
        policy_meta = sorted(meta[:len(self.policy)], key=lambda m: m["rank"])
        rollout_meta = [m for e in self._grouped(meta[len(self.policy):]) for m in sorted(e, key=lambda m: m["rank"])]
        topo = dict(metadata=policy_meta + rollout_meta, train_world_size=len(policy_meta),
                    rollout_world_size=len(rollout_meta))
        tp = len(self.engines[0])
        calls = [lambda w=w: w.init_checkpoint_engine_process_group(**topo) for w in self.policy]
        calls += [lambda w=w, d=d: w.init_checkpoint_engine_process_group(d * tp, len(policy_meta),
                                                                           len(rollout_meta), topo["metadata"])
                  for d, e in enumerate(self.engines) for w in e]
        self._all(calls)
        self._ready = True

    def _grouped(self, flat: list) -> list[list]:
        out, i = [], 0
        for e in self.engines:
            out.append(flat[i:i + len(e)])
            i += len(e)
        return out

    def sync_weights(self) -> None:
        self.is_stale = True
        if not self._ready:
            self.init_communicator()
        calls = [w.send_weights_via_checkpoint_engine for w in self.policy]
        calls += [w.update_weights_from_checkpoint_engine for w in self.rollout]
        try:
            results = self._all(calls)
            if not all(r for r in results[len(self.policy):] if r is not None):
                raise RuntimeError("Weight transfer failed during checkpoint-engine sync.")
            self.is_stale = False
        finally:
            if self.refit_cfg.get("release_after_refit"):
                self.shutdown()

    def shutdown(self) -> None:
        for w in self.policy + self.rollout:
            w.finalize_checkpoint_engine()
        self._ready = False


def busy(seed: int, max_s: float) -> Callable[[], float]:
    """Random delays in ``[0, max_s)`` (a vLLM engine busy before the refit RPC runs)."""
    rng = random.Random(seed)
    return lambda: rng.random() * max_s
