"""NeMo-RL plugin: a delta-refit checkpoint engine and a weight synchronizer.

Targets the seams of NVIDIA-NeMo/RL at commit 7ea279abfbeb698b092856d0dab61e7cf39bc909
(``nemo_rl`` 0.6.0; see docs/nemo_rl.md).  NeMo-RL is not imported here: both classes follow
its interfaces by duck typing, and ``tests/unit/test_nemo_rl_contract.py`` drives them the way
NeMo-RL's callers do.

1. :class:`DcrCheckpointEngine`, selected with
   ``policy.generation.refit_transport: "nemo_dcr.adapters.nemo_rl:DcrCheckpointEngine"``.
   NeMo-RL builds it with ``create_checkpoint_engine(backend, bucket_size_bytes=...,
   engine_kwargs=...)``, i.e. ``DcrCheckpointEngine(bucket_size=..., **refit_cfg[<selector>])``
   on every policy worker and every rollout worker.  The policy side receives dense
   ``(hf_name, tensor)`` pairs (``send_weights``), diffs them bitwise against its mirror of what
   the rollout side holds, and publishes one authenticated delta payload per version under
   ``url``; the rollout side applies it to its own mirror (validated, checksummed) and yields
   only the tensors that changed (``receive_weight_batches``) to vLLM's ``load_weights``.
   The first refit, and any refit after a version gap, is a full resync through the same
   format (a delta at 100% density against zeros).
2. :class:`DcrWeightSynchronizer`, a ``WeightSynchronizer`` (``sync_weights(*, timer,
   kv_scales)``, ``is_stale``, ``mark_stale``, ``init_communicator``, ``shutdown``) around a
   pair of those engines, for loops that drive policy and generation in one process.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncGenerator, Callable, Iterable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nemo_dcr.codec import Identity, decode, diff_tensors, encode_deltas, inspect
from nemo_dcr.config.schema import ENCODINGS
from nemo_dcr.types import DTYPES, int_view, spec_of

SELECTOR = "nemo_dcr.adapters.nemo_rl:DcrCheckpointEngine"


def _bits(t: torch.Tensor) -> np.ndarray:
    return int_view(t.detach().cpu().contiguous()).numpy().view(spec_of(t.dtype).uint).copy()


class DcrCheckpointEngine:
    """Delta checkpoint engine for NeMo-RL's ``refit_transport: "module:Class"`` seam.

    Args:
        bucket_size: bytes per transfer bucket (NeMo-RL sizes it from GPU memory); payload
            files are written in parts of at most this size.
        url: shared folder both sides can read (a path; fsspec URLs through a mount).
        encoding: ``dcr``, ``reference`` or ``raw``.
        key_file: HMAC key file (>= 16 bytes) shared by both sides; None: no MAC.
        release_after_refit: NeMo-RL's plugin flag (finalize after every refit).
        sender_rank: the policy worker rank that publishes payloads (all ranks must iterate
            the weights: the export is collective).
    """

    shard_expert_weights = False
    cleanup_after_load = True

    def __init__(self, bucket_size: int, url: str | None = None, encoding: str = "dcr",
                 key_file: str | None = None, release_after_refit: bool = False,
                 sender_rank: int = 0, **unknown):
        if unknown:
            raise ValueError(f"unknown refit_cfg keys for {SELECTOR}: {sorted(unknown)}; known: "
                             "url, encoding, key_file, release_after_refit, sender_rank")
        if encoding not in ENCODINGS:
            raise ValueError(f"refit_cfg.encoding must be one of {list(ENCODINGS)}, got {encoding!r}")
        if not url:
            raise ValueError("refit_cfg.url is required (a folder both sides can read)")
        self.bucket_size = int(bucket_size)
        self.url = Path(url)
        self.encoding = encoding
        self.key = Path(key_file).read_bytes().strip() if key_file else None
        self.release_after_refit = release_after_refit
        self.sender_rank = sender_rank
        self.role: str | None = None
        self.rank = -1
        self.version = 0
        self._mirror: dict[str, torch.Tensor] = {}
        self.last_stats: dict[str, Any] = {}

    def get_target_weight_layout(self) -> None:
        """No destination-local layout: the sender ships canonical HF tensors."""
        return None

    def prepare(self) -> dict[str, Any]:
        """Create the shared folder; metadata every peer receives."""
        self.url.mkdir(parents=True, exist_ok=True)
        return {"backend": SELECTOR, "url": str(self.url), "encoding": self.encoding}

    def init_policy_process_group(self, *, worker_rank: int, train_world_size: int,
                                  rollout_world_size: int, metadata: list[Any]) -> None:
        """Policy side: remember the rank (only ``sender_rank`` publishes)."""
        self.role, self.rank = "policy", worker_rank

    def init_rollout_process_group(self, *, rollout_rank: int, train_world_size: int,
                                   rollout_world_size: int, metadata: list[Any]) -> None:
        """Rollout side: remember the rank (every rollout worker reads every version)."""
        self.role, self.rank = "rollout", rollout_rank

    def finalize(self) -> None:
        """Nothing to release between refits (mirrors are kept: they are the delta base)."""

    def _payload_path(self, version: int) -> Path:
        return self.url / f"v{version:08d}.dcr"

    async def send_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Diff the weights against the mirror and publish the next version (sender rank)."""
        current = {n: t.detach().cpu().contiguous().clone() for n, t in weights}
        if self.rank != self.sender_rank:
            return
        resync = set(current) != set(self._mirror)
        base = {n: torch.zeros_like(t) for n, t in current.items()} if resync else self._mirror
        deltas = diff_tensors(base, current)
        target = self.version + 1
        ident = Identity("", "", 0 if resync else self.version, target)
        payload = encode_deltas(deltas, {n: _bits(t) for n, t in base.items()}, ident,
                                self.encoding, self.key)
        tmp = self._payload_path(target).with_suffix(".tmp")
        tmp.write_bytes(payload)
        os.replace(tmp, self._payload_path(target))  # readers never see a partial file
        self._mirror, self.version = current, target
        changed = sum(d.nnz for d in deltas)
        self.last_stats = {"version": target, "resync": resync, "payload_bytes": len(payload),
                           "changed": changed, "numel": sum(t.numel() for t in current.values()),
                           "dense_bytes": sum(t.numel() * t.element_size() for t in current.values())}

    async def receive_weight_batches(self) -> AsyncGenerator[list[tuple[str, torch.Tensor]], None]:
        """Apply the newest published version to the mirror; yield the changed tensors."""
        target = self._latest()
        if target is None or target <= self.version:
            return
        payload = self._payload_path(target).read_bytes()
        header = inspect(payload, self.key)
        resync = header.base_version != self.version or not self._mirror
        if resync and header.base_version != 0:
            raise RuntimeError(f"version gap: holding v{self.version}, newest payload is "
                               f"v{header.base_version} -> v{header.target_version}; the sender "
                               "must publish a full resync")
        base = self._zero_base(header) if resync else self._mirror
        decoded = decode(payload, base, self.key)
        batch = []
        for d in decoded.deltas:
            if d.nnz:
                int_view(base[d.name])[torch.from_numpy(d.positions)] = torch.from_numpy(
                    d.new_bits.view({1: np.uint8, 2: np.int16, 4: np.int32}[d.new_bits.itemsize]))
                batch.append((d.name, base[d.name].clone()))
        self._mirror, self.version = base, target
        for i in range(0, len(batch), 64):
            yield batch[i : i + 64]

    def _zero_base(self, header) -> dict[str, torch.Tensor]:
        out = {}
        for r in header.records:
            out[r.name] = torch.zeros(r.shape, dtype=DTYPES[r.dtype].torch_dtype)
        return out

    def _latest(self) -> int | None:
        names = sorted(p.name for p in self.url.glob("v*.dcr"))
        return int(names[-1][1:9]) if names else None


class DcrWeightSynchronizer:
    """NeMo-RL ``WeightSynchronizer`` over two :class:`DcrCheckpointEngine` (one process).

    Args:
        weights: callable returning the policy's ``(hf_name, tensor)`` iterator.
        load_weights: callable taking one batch of ``(hf_name, tensor)`` (the generation
            backend's loader, e.g. vLLM's ``model.load_weights``).
        refit_cfg: the engine settings (``url``, ``encoding``, ``key_file``...).
        bucket_size: bytes per bucket.
    """

    def __init__(self, weights: Callable[[], Iterable[tuple[str, torch.Tensor]]],
                 load_weights: Callable[[list[tuple[str, torch.Tensor]]], Any],
                 refit_cfg: dict[str, Any], bucket_size: int = 1 << 28):
        self._weights = weights
        self._load = load_weights
        self._sender = DcrCheckpointEngine(bucket_size, **refit_cfg)
        self._receiver = DcrCheckpointEngine(bucket_size, **refit_cfg)
        self._stale = True
        self._ready = False

    @property
    def is_stale(self) -> bool:
        """True until the first successful sync, and after :meth:`mark_stale`."""
        return self._stale

    def mark_stale(self) -> None:
        """A training step happened (older NeMo-RL versions call this)."""
        self._stale = True

    def init_communicator(self) -> None:
        """Prepare both engines and connect them (idempotent)."""
        if self._ready:
            return
        meta = [self._sender.prepare(), self._receiver.prepare()]
        self._sender.init_policy_process_group(worker_rank=0, train_world_size=1,
                                               rollout_world_size=1, metadata=meta)
        self._receiver.init_rollout_process_group(rollout_rank=0, train_world_size=1,
                                                  rollout_world_size=1, metadata=meta)
        self._ready = True

    def sync_weights(self, *, timer=None, kv_scales: dict[str, float] | None = None
                     ) -> dict[str, float]:
        """Send the policy's weights as a delta and load the changed tensors; returns metrics."""
        if kv_scales:
            raise NotImplementedError("FP8 KV-cache scales are not carried by the delta refit")
        self.init_communicator()
        ctx = timer.time("prepare_for_generation/transfer_and_update_weights") if timer else nullcontext()
        with ctx:
            asyncio.run(self._sync())
        self._stale = False
        s = self._sender.last_stats
        return {"dcr/payload_bytes": float(s["payload_bytes"]), "dcr/dense_bytes": float(s["dense_bytes"]),
                "dcr/density": s["changed"] / max(s["numel"], 1), "dcr/version": float(s["version"])}

    async def _sync(self) -> None:
        await self._sender.send_weights(self._weights())
        async for batch in self._receiver.receive_weight_batches():
            self._load(batch)

    def shutdown(self) -> None:
        """Release both engines."""
        self._sender.finalize()
        self._receiver.finalize()
        self._ready = False
