"""A **stand-in** for NeMo-RL's Megatron policy worker, over real megatron-core shards (gloo, CPU).

NeMo-RL (NVIDIA-NeMo/RL 7ea279ab, ``nemo_rl/models/policy/workers/megatron_policy_worker.py``)
runs one Ray actor per megatron rank.  ``MegatronPolicyWorkerImpl`` keeps the DDP-wrapped
megatron-core model as ``self.model`` and the optimizer as ``self.optimizer``; its
checkpoint-engine mixin (``nemo_rl/models/policy/workers/checkpoint_engine.py``) awaits
``checkpoint_engine.send_weights(self._checkpoint_engine_weight_iterator())``, which (with no
target layout) is ``_iter_params_with_optional_kv_scales()``: a generator around
Megatron-Bridge's ``export_hf_weights`` (per tensor a TP all-gather, then the HF conversion), so
nothing of the export runs until it is iterated.  Here:

* :class:`Actor`: one worker object in its own spawned process (a Ray actor): calls are
  forwarded over a pipe and answered in order; a failure comes back as :class:`ActorError`
  naming the remote exception, with its traceback.
* :class:`MegatronPolicyWorker`: ``torch.distributed`` on gloo and megatron's groups, the
  GPTModel of a megatron-core preset built by the project's builder
  (:func:`nemo_dcr.tools.megatron.build.build_gpt_model`), wrapped in megatron's DDP with the
  distributed optimizer; fp32 masters stepped by Adam-like updates
  (:class:`~nemo_dcr.tools.megatron.train.MasterAdamW`: the CPU driver cannot train a
  DDP-wrapped model); ``prepare_refit_info`` from shapes only (NeMo-RL runs its export on meta
  tensors for it); :meth:`MegatronPolicyWorker.export`, a generator like Bridge's (TP all-gather
  per tensor, then the independent dense conversion :mod:`nemo_dcr.tools.megatron.convert`),
  counting the tensors and bytes it yields and the seconds spent producing them.
* ``shards_visible=False`` keeps the model off ``.model`` (a policy worker whose model the
  plugin cannot read, like a DTensor policy), so the plugin takes the export path.

Only pipeline-parallel size 1 is built (the stand-in export has no PP broadcast).
"""

from __future__ import annotations

import asyncio
import importlib
import multiprocessing as mp
import os
import sys
import threading
import time
import traceback
from typing import Any

import torch

from .nemo_rl_standin import _CheckpointEngineHost


class ActorError(RuntimeError):
    """A call on an :class:`Actor` raised in its process (the message names the remote exception)."""


def _serve(conn, factory: str, args: tuple, kwargs: dict, log: str | None) -> None:
    """The actor process: build the object, then answer ``(method, args, kwargs)`` calls until None
    (what it prints goes to ``log`` when given, like a Ray actor's log file)."""
    if log:
        sys.stdout = open(log, "a", buffering=1)
    try:
        module, name = factory.split(":")
        obj = getattr(importlib.import_module(module), name)(*args, **kwargs)
        conn.send(("ok", None))
    except BaseException as exc:  # noqa: BLE001 - reported to the caller
        conn.send(("err", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        return
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            conn.send(("ok", None))
            return
        method, a, k = msg
        try:
            conn.send(("ok", getattr(obj, method)(*a, **k)))
        except BaseException as exc:  # noqa: BLE001 - reported to the caller
            conn.send(("err", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


class Actor:
    """``factory(*args, **kwargs)`` (``"module:Class"``) in its own spawned process.

    ``actor.method(...)`` runs ``obj.method(...)`` there and returns its (pickled) result; calls
    from several threads are answered one at a time, as by a Ray actor.

    Args:
        timeout: seconds a call (the construction included) may take before :class:`TimeoutError`.
        log: file the actor's prints are appended to (None: this process's stdout).
    """

    def __init__(self, factory: str, *args, timeout: float = 300.0, log: str | None = None, **kwargs):
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, factory, args, kwargs, log), daemon=True)
        self._proc.start()
        child.close()
        self._lock = threading.Lock()
        self._timeout, self._started = timeout, False
        self.pid = self._proc.pid

    def _answer(self) -> Any:
        if not self._conn.poll(self._timeout):
            raise TimeoutError(f"actor {self.pid}: no answer within {self._timeout}s")
        try:
            status, value = self._conn.recv()
        except EOFError:
            raise ActorError(f"actor {self.pid} died (exit code {self._proc.exitcode})") from None
        if status == "err":
            raise ActorError(value)
        return value

    def call(self, method: str, *args, **kwargs) -> Any:
        """Run ``method`` in the actor (waits for its construction first)."""
        with self._lock:
            if not self._started:
                self._answer()
                self._started = True
            self._conn.send((method, args, kwargs))
            return self._answer()

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda *a, **k: self.call(name, *a, **k)

    def close(self) -> None:
        """Stop the process (politely, then by force)."""
        try:
            with self._lock:
                if self._proc.is_alive():
                    self._conn.send(None)
                    self._conn.poll(10)
        except (OSError, EOFError):
            pass
        self._proc.join(2)
        if self._proc.is_alive():  # answered: only the interpreter's shutdown is left
            self._proc.kill()
            self._proc.join(5)


def policy_actors(world: int, log_dir: str | None = None, factory: str | None = None, **kwargs) -> list[Actor]:
    """``world`` :class:`MegatronPolicyWorker` actors (or of ``factory``, ``"module:Class"``, a
    subclass) forming one gloo job (rank order); with ``log_dir`` each prints into
    ``<log_dir>/policy-<rank>.log``."""
    from tests.distributed.launch import free_port

    port = free_port()
    return [Actor(factory or f"{__name__}:MegatronPolicyWorker", rank, world, port,
                  log=None if log_dir is None else os.path.join(log_dir, f"policy-{rank}.log"), **kwargs)
            for rank in range(world)]


def rss_mib() -> dict[str, float]:
    """This process's resident memory now and at its peak (``/proc/self/status``), MiB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out["rss" if key == "VmRSS" else "peak"] = int(value.split()[0]) / 1024
    return out


def reference_mismatches(policy: list[Actor], engines, dims, tp: int) -> list[str]:
    """Params of each vLLM stand-in worker whose bits differ from a fresh model of ``dims`` loaded,
    through its own ``load_weights``, with the policy's weights as the dense conversion gathers
    them (:meth:`MegatronPolicyWorker.hf_state`, collective over ``policy``): vLLM's own full
    load, never the refit's mapping."""
    from concurrent.futures import ThreadPoolExecutor

    from .vllm_standin import reference_mismatches_of

    with ThreadPoolExecutor(len(policy)) as ex:
        state = list(ex.map(lambda p: p.hf_state(), policy))[0]
    return reference_mismatches_of(state, engines, dims, tp)


def cpu_seconds() -> float:
    """CPU seconds this process used so far, every thread, user and system."""
    t = os.times()
    return t.user + t.system


class MegatronPolicyWorker(_CheckpointEngineHost):
    """One Megatron policy worker (a megatron rank), NeMo-RL's checkpoint-engine mixin included.

    Args:
        rank: global rank (NeMo-RL's policy worker rank).
        world: policy workers.
        port: the gloo rendezvous port on localhost.
        model: a megatron-core preset (:data:`nemo_dcr.layout.MODELS`); dense Llama-family.
        tp: tensor-parallel size (``world / tp`` data-parallel replicas; pipeline size 1).
        layers: another number of layers (None: the preset's).
        lr: size of the Adam-like updates of :meth:`train`.
        shards_visible: expose the model as ``.model`` (False: the plugin cannot read it).
    """

    def __init__(self, rank: int, world: int, port: int, model: str = "dense-tiny", tp: int = 2,
                 layers: int | None = None, lr: float = 2e-5, shards_visible: bool = True):
        import torch.distributed as dist

        from nemo_dcr.integrations.megatron.params import local_params
        from nemo_dcr.layout import model_dims
        from nemo_dcr.tools.megatron import build as am
        from nemo_dcr.tools.megatron.train import MasterAdamW

        torch.set_num_threads(1)
        self.rank, self.world = rank, world
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        am.init_distributed(tp, 1)
        self.dims = model_dims(model, layers)
        self._chunks = am.wrap_ddp(am.build_gpt_model(self.dims, torch.bfloat16))
        if shards_visible:
            self.model = self._chunks[0]  # NeMo-RL: one DDP-wrapped model per worker
        self.optimizer = MasterAdamW(local_params(self._chunks, self.dims), self.dims.tie_word_embeddings)
        self.lr = lr
        self.checkpoint_engine = None
        self.exported, self.exported_bytes, self.export_s = 0, 0, 0.0

    # -- NeMo-RL's side of the refit -------------------------------------------------------------

    def prepare_refit_info(self) -> dict:
        """``{hf_name: (shape, dtype)}`` of the export, from shapes only (no collective)."""
        from nemo_dcr.integrations.megatron.params import local_params
        from nemo_dcr.integrations.megatron.topology import rank_coords, tp_placement
        from nemo_dcr.tools.megatron.convert import megatron_to_hf

        coords, info = rank_coords(), {}
        for lp in self._exported_params(local_params(self._chunks, self.dims)):
            size, _, dim = tp_placement(lp.param, coords)
            shape = list(lp.param.shape)
            if dim is not None:
                shape[dim] *= size
            full = torch.empty(shape, dtype=lp.param.dtype, device="meta")
            info.update({n: (t.shape, t.dtype) for n, t in megatron_to_hf(lp.global_name, full, self.dims).items()})
        return info

    def _exported_params(self, params):
        tied = self.dims.tie_word_embeddings
        return [lp for lp in params if not (tied and lp.global_name == "output_layer.weight")]

    def export(self, count: bool = True):
        """Bridge's export as NeMo-RL hands it over: full HF tensors on every rank, one at a time
        (a TP all-gather per sharded tensor: collective, every rank must iterate to the end)."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        from nemo_dcr.integrations.megatron.params import local_params
        from nemo_dcr.integrations.megatron.topology import rank_coords, tp_placement
        from nemo_dcr.tools.megatron.convert import megatron_to_hf, merge_shards

        coords, group = rank_coords(), ps.get_tensor_model_parallel_group()
        for lp in self._exported_params(local_params(self._chunks, self.dims)):
            t0 = time.perf_counter()
            size, _, dim = tp_placement(lp.param, coords)
            shard = lp.param.detach().contiguous()
            if dim is not None and size > 1:
                parts = [torch.empty_like(shard) for _ in range(size)]
                dist.all_gather(parts, shard, group=group)
                full = merge_shards(lp.global_name, parts, dim)
            else:
                full = shard.clone()
            tensors = {n: t.contiguous() for n, t in megatron_to_hf(lp.global_name, full, self.dims).items()}
            if count:
                self.export_s += time.perf_counter() - t0
            for name, t in tensors.items():
                if count:
                    self.exported += 1
                    self.exported_bytes += t.numel() * t.element_size()
                yield name, t

    def init_checkpoint_engine_process_group(self, **topology) -> None:
        self.checkpoint_engine.init_policy_process_group(worker_rank=self.rank, **topology)

    def send_weights_via_checkpoint_engine(self) -> None:
        with torch.no_grad():
            asyncio.run(self.checkpoint_engine.send_weights(self.export()))

    # -- the test's handles ----------------------------------------------------------------------

    def train(self, step: int) -> None:
        """One optimizer step (Adam-like updates of the fp32 masters, rounded into the bf16 params)."""
        self.optimizer.adam_like_update(step, lr=self.lr)

    def hf_state(self) -> dict[str, torch.Tensor] | None:
        """The model as HF tensors on rank 0 (collective; not counted as export): the reference
        a fresh vLLM model loads through its own ``load_weights``."""
        if self.rank != 0:
            for _ in self.export(count=False):  # the gathers are collective: every rank iterates
                pass
            return None
        return {n: t.clone() for n, t in self.export(count=False)}

    def report(self) -> dict:
        """What the plugin's policy side did at the last sync, and what the export yielded so far."""
        side = self.checkpoint_engine.policy if self.checkpoint_engine is not None else None
        return dict(capture=side.capture if side else None, detail=side.capture_detail if side else "",
                    last=side.last if side else None, recovered=list(side.recovered) if side else [],
                    held_bytes=sum(t.numel() * t.element_size() for t in side.held.values()) if side else 0,
                    exported=self.exported, exported_bytes=self.exported_bytes, export_s=self.export_s, memory=rss_mib(), cpu_s=cpu_seconds(),
                    written=side.transport.bytes_written if side else 0,
                    pid=os.getpid())

    def fail_next_refit(self) -> None:
        """Make this worker's next refit attempt raise (after the capture choice), once."""
        side = self.checkpoint_engine.policy

        def once():
            del side._refit_once  # back to the class's method
            raise OSError("injected failure inside the sync")

        side._refit_once = once

    def restart_engine(self, shards_visible: bool = True) -> None:
        """A new checkpoint engine (a restarted policy worker), with or without ``.model``."""
        self.checkpoint_engine = None
        if shards_visible:
            self.model = self._chunks[0]
        else:
            self.__dict__.pop("model", None)
