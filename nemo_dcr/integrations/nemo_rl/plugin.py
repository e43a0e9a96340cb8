"""NeMo-RL checkpoint-engine plugin: a thin adapter on the one refit path (docs/nemo_rl.md).

Selected with ``policy.generation.refit_transport: "nemo_dcr.integrations.nemo_rl:DcrCheckpointEngine"``
(NVIDIA-NeMo/RL 7ea279ab, ``nemo_rl`` 0.6.0).  NeMo-RL's ``CheckpointEngineWeightSynchronizer``
builds one engine in every policy worker and in every vLLM worker (all DP x TP ranks) with
``DcrCheckpointEngine(bucket_size=..., **refit_cfg[selector])``, calls ``prepare()`` on all,
``init_policy_process_group`` / ``init_rollout_process_group`` with every engine's metadata, and per
``sync_weights`` runs ``send_weights`` on every policy worker and ``receive_weight_batches`` on every
vLLM worker **at the same time** (one ``ray.get``).  NeMo-RL is never imported: duck typing.

* Refit group: policy workers are trainer ranks ``0..T-1``, vLLM worker ``j`` is engine rank
  ``T + j``; messages over the HMAC-keyed store transport in a shared folder
  (:mod:`.session`); the trainer group's collectives over the same transport
  (:class:`~nemo_dcr.refit.group.TransportGroup`).
* Policy (:class:`~.policy.PolicySide`): in a Megatron policy worker (found, as on the rollout
  side, as the object holding this engine; :mod:`.shards`) capture from its own megatron-core
  shards and leave NeMo-RL's export iterator unstarted; elsewhere drain the export keeping only
  owned tensors (said once in the log); one :class:`~nemo_dcr.refit.DeltaRefit` ``attach()`` /
  ``step()`` per sync, then END to every engine rank.  The sender commits only after every engine
  rank acknowledged (the refit protocol).
  A failure anywhere inside a sync is resynced within the same ``send_weights`` (NeMo-RL does
  not catch ``sync_weights`` errors); only a failed resync raises, naming the rank and cause.
* Startup refusals (``prepare()``): a NeMo-RL without the checkpoint-engine seam
  (:mod:`.guard`) and weights NeMo-RL refits through other paths (:mod:`.names`); the driver
  (:mod:`.driver`) checks the seam and the settings when the config is loaded.
* Rollout (:class:`~.rollout.RolloutSide`): serve the protocol with an in-place engine over the
  vLLM worker's live params until END; ``receive_weight_batches`` yields **nothing**, so NeMo-RL's
  ``load_weights`` loads nothing and no vLLM worker keeps a copy of the model.
* Versions are the engines' (the refit protocol's attach); a restarted worker is a new session,
  whose first sync compares checksums and resyncs what differs.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Iterable
from typing import Any

import torch

from nemo_dcr.apply import TensorEngine
from nemo_dcr.apply.placement import placement_to_json
from nemo_dcr.codec.auth import read_key_file

from .guard import check_seam
from .names import refuse_unsupported
from .options import PluginOptions
from .policy import PolicySide
from .rollout import RolloutSide, build_engine, find_owner, probe_worker
from .session import Topology, new_nonce, policy_metadata, rollout_metadata


class DcrCheckpointEngine:
    """NeMo-RL checkpoint engine (``refit_transport: "module:Class"`` seam); see the module docstring.

    Args:
        bucket_size: bytes (NeMo-RL sizes it from GPU memory): the default of ``bucket_size_mb``.
        **refit_cfg: :class:`~nemo_dcr.config.DcrConfig` fields (``url`` and ``key_file`` required) and
            NeMo-RL's ``release_after_refit`` (:meth:`~.options.PluginOptions.parse`).
    """

    shard_expert_weights = False

    def __init__(self, bucket_size: int, **refit_cfg: Any):
        self.options = PluginOptions.parse(bucket_size, refit_cfg)
        self.key = read_key_file(self.options.dcr.key_file)
        self.nonce = new_nonce()
        self.policy: PolicySide | None = None
        self.rollout: RolloutSide | None = None
        self._worker: Any = None
        self._policy_worker: Any = None
        self._probe: tuple | None = None
        self._engine: TensorEngine | None = None

    @property
    def version(self) -> int | None:
        """The refit version this engine's side holds: a vLLM worker's engine version, or the version
        the policy's last sync left the engines at (None before either exists)."""
        if self._engine is not None:
            return self._engine.version
        last = self.policy.last if self.policy is not None else None
        return None if last is None else last.version

    def get_target_weight_layout(self) -> None:
        """None: NeMo-RL hands over its full HF export unfiltered (drained on the export path, left
        unstarted on the shard path); every vLLM rank takes its part from the refit."""
        return None

    def prepare(self) -> dict:
        """Metadata for every engine: a nonce; in a vLLM worker also the canonical table and this
        worker's placement, probed once per engine with vLLM's own loaders.

        Raises:
            SeamError: the importable NeMo-RL has no checkpoint-engine seam (:mod:`.guard`).
            UnsupportedWeights: weights NeMo-RL refits through another path (drafter, MTP, FP8
                KV-cache scales, Gemma-3 vision tower; :mod:`.names`), named.
        """
        check_seam(required=False)  # a worker environment may hold another NeMo-RL than the driver's
        owner = self._worker or find_owner(self)
        if owner is None or not hasattr(owner, "model_runner"):
            self._policy_worker = owner  # a policy worker (or none found): its model is read at the first sync
            return policy_metadata(self.nonce)
        if self._probe is None:
            refuse_unsupported(getattr(owner, "state_dict_info", None) or {}, owner)
            self._worker, self._probe = owner, probe_worker(owner)
        placement, table, _ = self._probe
        return rollout_metadata(self.nonce, table, placement_to_json(placement))

    def _topology(self, metadata: list, train_world: int, rollout_world: int, index: int) -> Topology:
        topo = Topology.from_metadata(self.options.dcr.url, metadata, train_world, rollout_world)
        if topo.nonces[index] != self.nonce:
            raise ValueError(f"metadata entry {index} is another engine's: NeMo-RL's metadata order does not match "
                             "the ranks it passed")
        return topo

    def init_policy_process_group(self, *, worker_rank: int, train_world_size: int, rollout_world_size: int,
                                  metadata: list) -> None:
        """Join the session as trainer rank ``worker_rank`` (a new session re-attaches at the next sync)."""
        topo = self._topology(metadata, train_world_size, rollout_world_size, worker_rank)
        if self.policy is None or self.policy.topo.session != topo.session:
            held = self.policy.held if self.policy is not None else None
            self.policy = PolicySide(self.options, self.key, worker_rank, topo, held, self._policy_worker)

    def init_rollout_process_group(self, *, rollout_rank: int, train_world_size: int, rollout_world_size: int,
                                   metadata: list) -> None:
        """Join the session as engine rank ``T + rollout_rank`` over this vLLM worker's live params."""
        if self._probe is None:
            raise RuntimeError("init_rollout_process_group on an engine that found no vLLM worker in prepare()")
        topo = self._topology(metadata, train_world_size, rollout_world_size, train_world_size + rollout_rank)
        if self.rollout is not None and self.rollout.topo.session == topo.session:
            return
        if self._engine is None:
            self._engine = build_engine(self._worker, self._probe, topo, rollout_rank, self.key,
                                        self.options.dcr.engine_index, self.options.dcr.threads)
        self.rollout = RolloutSide(self._engine, topo, rollout_rank, self.key, self.options.dcr.reply_timeout_s)

    async def send_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """One sync from this policy worker (blocking: the refit is collective over the policy
        workers and waits for the engines; NeMo-RL awaits it in the worker's event loop).
        ``weights`` (NeMo-RL's export generator) is not started when capturing from the shards."""
        if self.policy is None:
            raise RuntimeError("send_weights before init_policy_process_group")
        self.policy.send(weights)

    async def receive_weight_batches(self) -> AsyncGenerator[list[tuple[str, torch.Tensor]], None]:
        """Serve this sync in place into the vLLM worker's params; yields no batch (nothing to load)."""
        if self.rollout is None:
            raise RuntimeError("receive_weight_batches before init_rollout_process_group")
        self.rollout.receive()
        return
        yield  # an async generator that yields nothing

    def finalize(self) -> None:
        """Nothing to release: the sessions' state (the policy's owned copies and mirror, the
        rollout's engine over live params) is the base of the next delta."""
