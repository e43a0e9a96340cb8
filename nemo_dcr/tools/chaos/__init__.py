"""``nemo-dcr chaos``: the refit path (``DeltaRefit`` on real megatron-core shards, an engine
process of its own) with faults injected on the transport and in the engine; every refit is
checked against an independent dense export, and every detection is counted from what the
receiver actually refused or repaired."""

from .faults import FAULTS, schedule
from .run import ChaosConfig, run_chaos

__all__ = ["FAULTS", "ChaosConfig", "run_chaos", "schedule"]
