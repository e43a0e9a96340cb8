"""Who talks to whom: a trainer rank's transport endpoint, the engines' ranks, the trainer group.

The refit group numbers trainer ranks ``0..T-1`` and engine ranks after them.  Two layouts:

* **colocated** (:func:`colocated_wiring`): the engine lives in trainer rank ``h``'s process (the
  demo's transformers engine).  Each trainer process opens one endpoint of the configured
  transport (``dcr.transport``); a :class:`~nemo_dcr.transport.mux.Mux` gives process ``h`` a
  second endpoint for the engine rank ``T``.
* **separate engine processes** (:func:`engine_wiring`): the caller built a transport whose ranks
  include the engine processes (chaos, multi-node jobs, a NeMo-RL-style split); each engine
  process runs an :class:`~nemo_dcr.refit.server.EngineServer`.

Trainer-to-trainer routing of sparse changes and checksum sums run on a separate gloo group
(:class:`~nemo_dcr.refit.group.DistGroup`), never on the transport.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch.distributed as dist

from nemo_dcr.codec.auth import read_key_file
from nemo_dcr.config.schema import ConfigError, DcrConfig
from nemo_dcr.transport import DistTransport, InProcHub, StoreTransport, Transport
from nemo_dcr.transport.mux import Mux
from nemo_dcr.transport.store import new_run_id

from .group import DistGroup, LocalGroup, TrainerGroup


@dataclass
class Wiring:
    """One trainer rank's view of the refit group.

    Attributes:
        transport: this trainer rank's endpoint.
        engine_ranks: refit-group ranks of the engines.
        group: the trainer ranks (routing, checksum sums, agreement).
        trainer_ranks: refit-group ranks of the trainers (the senders every engine waits for).
        engine_transport: the endpoint of an engine this process hosts (None: none here).
        closers: called by :meth:`close` (transports this rank opened).
        relay: the engines' relay groups, root first (refit/relay.py; None: the engines relay nothing).
    """

    transport: Transport
    engine_ranks: list[int]
    group: TrainerGroup
    trainer_ranks: list[int]
    engine_transport: Transport | None = None
    closers: list[Callable[[float], None]] = field(default_factory=list)
    relay: list[list[int]] | None = None

    @property
    def hosts_engine(self) -> bool:
        """This process hosts an engine rank."""
        return self.engine_transport is not None

    def close(self, timeout: float = 60.0) -> None:
        """Close what this rank opened (collective for torch.distributed transports)."""
        for c in self.closers:
            c(timeout)
        self.closers = []


def trainer_group() -> TrainerGroup:
    """The trainer ranks: every rank of the default process group, over a gloo group of its own
    (CPU tensors; separate from the transport's connections); one rank without torch.distributed."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return LocalGroup()
    return DistGroup(dist.new_group(backend="gloo"))


def shared_run_id(group: TrainerGroup) -> str:
    """A random run identity drawn by trainer rank 0 and handed to every trainer rank (collective)."""
    mine = new_run_id().encode() if group.rank == 0 else b""
    return group.exchange([mine] * group.size)[0].decode()


def _process_transport(cfg: DcrConfig, rank: int, world: int, key: bytes | None,
                       group: TrainerGroup) -> tuple[Transport, list]:
    """This process's endpoint of ``cfg.transport`` over the trainer processes (collective).

    The store transport authenticates with ``key`` or else the key file of ``cfg`` (read by the
    one key-file rule), under a run identity shared by the trainer ranks."""
    kind = cfg.transport
    if kind == "inprocess":
        if world != 1:
            raise ConfigError("dcr.transport", f"inprocess needs the trainer and the engine in one process; "
                                               f"this job has {world} trainer processes (use gloo or store)")
        return InProcHub(1).transport(0), []
    if kind == "store":
        key = key if key is not None else read_key_file(cfg.key_file)
        return StoreTransport(cfg.url, rank, key, run=shared_run_id(group)), []
    if world == 1:
        return InProcHub(1).transport(0), []
    t = DistTransport(dist.new_group(backend="gloo"), rank)
    return t, [t.close]


def colocated_wiring(cfg: DcrConfig, engine_host: int = 0, key: bytes | None = None) -> Wiring:
    """Trainer ranks of the default process group plus one engine in trainer ``engine_host``'s
    process (collective over the trainer ranks).

    Raises:
        ConfigError: ``engine_host`` is not a trainer rank, or the transport cannot serve the job.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    if not 0 <= engine_host < world:
        raise ConfigError("engine.rank", f"must be a trainer rank in [0, {world}), got {engine_host}")
    group = trainer_group()
    base, closers = _process_transport(cfg, rank, world, key, group)
    host = {r: r for r in range(world)}
    host[world] = engine_host
    mux = Mux(base, host)
    engine_end = mux.endpoint(world) if rank == engine_host else None
    return Wiring(mux.endpoint(rank), [world], group, list(range(world)), engine_end, closers)


def engine_wiring(transport: Transport, trainer_ranks: Sequence[int], engine_ranks: Sequence[int],
                  group: TrainerGroup | None = None, relay: Sequence[Sequence[int]] | None = None) -> Wiring:
    """Engines in processes of their own: ``transport`` spans trainers and engines; ``relay``: the
    relay groups the engine processes built their endpoints from (:func:`~.relay.relay_groups`)."""
    return Wiring(transport, list(engine_ranks), group or trainer_group(), list(trainer_ranks),
                  relay=None if relay is None else [list(g) for g in relay],
                  closers=[transport.close] if hasattr(transport, "close") else [])
