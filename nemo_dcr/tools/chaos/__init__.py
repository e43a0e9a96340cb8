"""``nemo-dcr chaos``: the refit path (``DeltaRefit`` on real megatron-core shards, a real engine
in a process of its own) with faults injected on the transport, in the engine's transaction, and
on the processes, links and disk themselves (SIGKILLs, a stall, a full disk) under a supervisor
that restarts what died; every refit is checked against an independent dense export, rollouts
read the engine while it serves, and every detection is counted from what the receiver or the
supervisor actually saw."""

from .faults import FAULTS, schedule
from .run import ChaosConfig, run_chaos

__all__ = ["FAULTS", "ChaosConfig", "run_chaos", "schedule"]
