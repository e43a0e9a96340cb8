"""What a plan is asked about: the two layouts, the machines and the links (typed values).

The trainer is a :class:`~nemo_dcr.layout.ParallelLayout` (its sizes; cp = 1), the engine an
:class:`EngineDeployment` (replicas of a vLLM-style engine); links are per GPU
(NVLink) or per node (InfiniBand, cross-cluster), in Gbit/s, with a latency per tier.  Named
presets (:mod:`nemo_dcr.tools.planner.presets`) fill these for the models the planner knows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nemo_dcr.layout import LayoutError, ModelDims, ParallelLayout

PLACEMENTS = ("colocated", "cluster", "cross-cluster")
FANOUTS = ("direct", "relay")
"""How a version reaches the engine replicas (``dcr.fanout``, refit/relay.py): every replica from
the owners, or each view once to a relay root that broadcasts it to the other replicas."""
"""Where the engine runs: on the trainer's GPUs (the links within a node), on other nodes
of the same cluster (InfiniBand), or in another cluster (the cross-cluster link of each node)."""


@dataclass(frozen=True)
class EngineDeployment:
    """How the inference engine is deployed: ``replicas`` copies of one engine of ``tp * dp`` ranks,
    experts over ``ep`` of them (what :class:`~nemo_dcr.layout.ParallelLayout` does not describe).

    Follows vLLM: attention and dense layers are TP-sharded and replicated over the replica's
    data-parallel ranks; with expert parallelism (``ep > 1``) whole experts are split over ``ep``
    ranks, without it every expert is TP-sharded (expert TP = ``tp``).
    """

    tp: int = 1
    ep: int = 1
    dp: int = 1
    replicas: int = 1

    @property
    def per_replica(self) -> int:
        """Ranks of one replica."""
        return self.tp * self.dp

    @property
    def world_size(self) -> int:
        """All engine ranks."""
        return self.per_replica * self.replicas

    @property
    def etp(self) -> int:
        """Expert tensor-parallel size: ``tp`` without expert parallelism, else 1."""
        return self.tp if self.ep == 1 else 1

    def layout(self, experts: bool = True, **coords) -> ParallelLayout:
        """The layout tables' view of one replica (pp = 1); ``experts``: the model has routed experts."""
        return ParallelLayout(tp=self.tp, dp=self.dp, ep=self.ep, etp=self.etp if experts else 1, **coords)

    def describe(self) -> str:
        """``TP8 DP8 EP64 x4 replicas`` style summary."""
        return f"TP{self.tp} DP{self.dp} EP{self.ep} x{self.replicas} replicas"


@dataclass(frozen=True)
class Links:
    """Bandwidth (Gbit/s) and latency (seconds) of each link tier."""

    nvlink_gbps: float = 3600.0
    """Per GPU, one direction, inside a node (H100/H200 NVLink 4: 450 GB/s)."""
    ib_gbps: float = 3200.0
    """Per node, in-cluster (8 x 400 Gbit/s NICs)."""
    cross_cluster_gbps: float | None = None
    """Per node, to the other cluster (None: the engine is in the same cluster)."""
    object_store_gbps: float | None = None
    """Aggregate object-store throughput (None: payloads go point to point)."""
    intra_node_name: str = "NVLink"
    """What the intra-node tier is (``loopback`` on a CPU host)."""
    nvlink_latency_s: float = 10e-6
    ib_latency_s: float = 20e-6
    cross_cluster_latency_s: float = 30e-3
    object_store_latency_s: float = 50e-3


@dataclass(frozen=True)
class Hardware:
    """The machines: GPUs per node and host cores, and which device runs the codec kernels."""

    gpus_per_node: int = 8
    """Ranks per node (trainer and engine alike)."""
    host_cores_per_node: int = 112
    """Host CPU cores of one node; ranks on a node share them for host-side kernels."""
    gpus: bool = True
    """The ranks own GPUs (the capture scan runs on the device); False: a CPU-only host."""
    pcie_gbytes_s: float = 25.0
    """Device-to-host copy per GPU, GB/s (a host baseline of export-then-diff); an assumption."""
    codec_device: str = "gpu"
    """``cpu``: the compiled host codec of the refit path (one core per rank); ``gpu``: device
    kernels (figures are named assumptions until measured)."""
    name: str = "8x H200 (NVLink 4, 8x400G IB), 112 host cores"


@dataclass(frozen=True)
class PlanSetup:
    """Everything a plan needs besides the model and the measured figures."""

    trainer: ParallelLayout
    """Megatron-Core sizes of the trainer (rank coordinates unused; cp = 1)."""
    engine: EngineDeployment
    links: Links = field(default_factory=Links)
    hardware: Hardware = field(default_factory=Hardware)
    placement: str = "cluster"
    encode_per_view: bool = True
    """As on main: an owner encodes each engine rank's view of its tensors separately (replicas and
    engine-DP copies included); False: each distinct view once, its bytes sent to every holder."""
    fanout: str = "direct"
    """``direct``: the owners send every replica its records (the trainer-to-engine link carries a view
    once per replica); ``relay``: once per view, to replica 0's rank of that view, which relays it to
    the other replicas over the engines' in-cluster link (``dcr.fanout: relay``)."""
    preset: str = "custom"
    """Name of the preset these values came from (printed with the plan)."""

    def validate(self, dims: ModelDims) -> None:
        """Raise :class:`LayoutError` for layouts the model or the placement cannot take."""
        if self.placement not in PLACEMENTS:
            raise LayoutError(f"placement {self.placement!r}; known: {', '.join(PLACEMENTS)}")
        if self.placement == "cross-cluster" and not self.links.cross_cluster_gbps:
            raise LayoutError("placement cross-cluster needs --cross-cluster-gbps")
        if self.placement == "colocated" and self.engine.world_size > self.trainer.world_size:
            raise LayoutError(f"colocated engine of {self.engine.world_size} ranks on {self.trainer.world_size} "
                              "trainer GPUs")
        if self.fanout not in FANOUTS:
            raise LayoutError(f"fanout {self.fanout!r}; known: {', '.join(FANOUTS)}")
        if self.hardware.codec_device not in ("cpu", "gpu"):
            raise LayoutError(f"codec device {self.hardware.codec_device!r}; known: cpu, gpu")
        if self.trainer.cp != 1:
            raise LayoutError(f"trainer cp={self.trainer.cp}: the planner models cp = 1")
        self.trainer.validate(dims=dims)
        e = self.engine
        if e.ep > 1 and e.per_replica % e.ep:
            raise LayoutError(f"engine ep={e.ep} must divide the replica's tp*dp = {e.per_replica}")
        e.layout(bool(dims.num_experts)).validate(dims=dims)
