"""The library's one configuration: :class:`DcrConfig`, the ``dcr:`` block, a docstring under every field.

Every entry point reads it: :meth:`nemo_dcr.DeltaRefit.from_config`, the NeMo-RL plugin (whose
options are this block's fields, same names and units, read by :meth:`DcrConfig.from_mapping`), the
demo recipe (``configs/``) and chaos.
:meth:`DcrConfig.validate` refuses values outside their range; every error is a :class:`ConfigError`
whose message starts with the dotted key (``dcr.encoding: must be one of ...``).
"""

from __future__ import annotations

import difflib
import math
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields

ENCODINGS = ("dcr", "reference", "raw")
TRANSPORTS = ("inprocess", "gloo", "store")
REFUSED_TRANSPORTS = {
    "nccl": "there is no NCCL transport (NCCL has no any-source receive and takes device tensors only). "
            "Deltas are small (~0.6 B per changed element): use gloo (TCP, also on GPU clusters) or store. "
            "A full resync is dense and travels the same way (gloo or store); a dense NCCL broadcast of "
            "a large model is not implemented (docs/refit.md, \"GPU path\")",
    "cuda_ipc": "there is no CUDA IPC transport: use gloo (a colocated engine in its own process) or "
                "inprocess (one process)",
}
"""Transport names users may know from other systems, refused by :meth:`DcrConfig.validate` with why."""
BASELINES = ("device", "pinned", "file")
FANOUTS = ("direct", "relay")
FANOUT_ROOTS = ("view", "node")
VERIFY_MODES = ("full", "sampled", "incremental")
ENGINE_FORMATS = ("bf16", "fp8")
FP8_GRANULARITIES = ("block", "channel", "tensor")
"""The granularities of :class:`nemo_dcr.quant.Fp8Scheme` (a test keeps the two lists equal)."""


class ConfigError(ValueError):
    """A config key or value was refused; the message names the dotted key."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"{key}: {message}" if key else message)


def check_finite(prefix: str, block) -> None:
    """Every float field of ``block`` must be finite (NaN and Inf pass ``> 0``-style checks)."""
    for f in fields(block):
        value = getattr(block, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{prefix}.{f.name}", f"must be a finite number, got {value!r}")


def check_one_of(prefix: str, name: str, value, allowed) -> None:
    if value not in allowed:
        raise ConfigError(f"{prefix}.{name}", f"must be one of {list(allowed)}, got {value!r}")


def check_at_least(prefix: str, name: str, value, low) -> None:
    if value < low:
        raise ConfigError(f"{prefix}.{name}", f"must be >= {low}, got {value!r}")


def _typed(key: str, value, hint):
    """``value`` as the field type ``hint`` (bool, int, float, str, ``list[...]``, ``X | None``);
    an int is taken for a float and any sequence but a string for a list."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        if value is None and type(None) in typing.get_args(hint):
            return None
        kinds = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(kinds) > 1:  # ``int | str``: the first kind the value is
            for kind in kinds:
                try:
                    return _typed(key, value, kind)
                except ConfigError:
                    pass
            raise ConfigError(key, f"must be {' or '.join(k.__name__ for k in kinds)}, got "
                                   f"{type(value).__name__} {value!r}")
        (hint,) = kinds
    if typing.get_origin(hint) is list:
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
            raise ConfigError(key, f"must be a list, got {type(value).__name__} {value!r}")
        (item,) = typing.get_args(hint)
        return [_typed(f"{key}[{i}]", v, item) for i, v in enumerate(value)]
    ok = {bool: (bool,), int: (int,), float: (int, float), str: (str,)}[hint]
    if not isinstance(value, ok) or (isinstance(value, bool) and hint is not bool):
        raise ConfigError(key, f"must be {hint.__name__}, got {type(value).__name__} {value!r}")
    return float(value) if hint is float else value


@dataclass
class DcrConfig:
    """The ``dcr:`` block: how weights move from the trainer to the engine."""

    enabled: bool = True
    """Delta refit on; when false every refit is a dense (full) refit."""
    encoding: str = "dcr"
    """Payload encoding: ``dcr`` (baseline-conditioned), ``reference`` (gaps+XOR+zstd), ``raw``."""
    transport: str = "gloo"
    """How payloads travel between trainer ranks and engines: ``inprocess`` (one process),
    ``gloo`` (torch.distributed point-to-point over TCP, CPU and GPU clusters alike) or ``store``
    (files or an object store under ``url``, authenticated with ``key_file``)."""
    url: str | None = None
    """Folder or fsspec URL of the ``store`` transport (required for it)."""
    baseline: str = "device"
    """Where the trainer keeps the engine's bits: ``device``, ``pinned`` (host) or ``file``."""
    baseline_dir: str | None = None
    """Folder of the ``file`` baseline (required for it)."""
    verify: str = "sampled"
    """How trainer and engine are compared after every refit (docs/refit.md, "Verification").
    Every mode first compares the checksums the refit's deltas moved on both sides (what was
    sent was applied, on every engine rank); then:

    * ``full``: both sides recompute every tensor's checksum from the live tensors (trainer
      shards, engine params), every refit: an element the capture missed, or a write behind
      the refit's back on either side, is caught at the next refit (a full pass over the
      weights on both sides per refit);
    * ``sampled``: both sides recompute from the live tensors the checksums of one slice of
      every tensor (about 1/``verify_steps`` of its elements, a different pseudo-random slice
      each refit, every element once in every ``verify_steps`` refits): caught within
      ``verify_steps`` refits, at about 1/``verify_steps`` of a full pass per refit;
    * ``incremental``: the deltas' checksums only, and a ``full`` check every ``verify_steps``
      refits (0: never, so a missed capture or a stray write stays unseen).

    A live mismatch re-reads the trainer's weights (as a restarted trainer's first sync does) and
    resyncs the tensors that differ."""
    verify_steps: int = 16
    """``sampled``: slices per cycle (every element checked once in every N refits);
    ``incremental``: refits between full checks (0: none)."""
    verify_block: int = 256
    """``sampled``: elements per block of a slice (a slice takes one block in every
    ``verify_steps`` consecutive blocks of a tensor)."""
    verify_seed: int = 0
    """``sampled``: seed of the pseudo-random slices (the same on every rank)."""
    full_resync_interval: int = 0
    """Force a full resync (a delta at 100% density) every N refits; 0: only on mismatch."""
    bucket_size_mb: float = 256.0
    """Payload parts are cut so that the raw changes of one part (position + bits) stay within
    this many MiB: bounds encode, transfer and decode memory per message."""
    reply_timeout_s: float = 300.0
    """Seconds a trainer rank waits for an engine's answer before treating the refit as failed."""
    key_file: str | None = None
    """File with the HMAC key (>= 16 bytes) authenticating payloads; None: no MAC."""
    telemetry_dir: str | None = None
    """Folder for per-step ``telemetry.jsonl``; None: no telemetry."""
    telemetry_encodings: list[str] = field(default_factory=list)
    """Further encodings whose payload sizes are measured for telemetry (the sent one always is):
    each one re-encodes every refit's changes (not sent), so the default is none."""
    engine_format: str = "bf16"
    """What the engine holds: ``bf16`` (the canonical tensors as they are) or ``fp8`` (the linear
    layers' weights as FP8 e4m3 bytes plus fp32 scales, the rest BF16; docs/fp8.md).  The owners
    of the tensors turn the BF16 changes into FP8 changes; the engine must hold the same format."""
    fp8_granularity: str = "block"
    """``engine_format: fp8``: one scale per ``fp8_block`` tile (``block``), per output row
    (``channel``) or per weight (``tensor``)."""
    fp8_block: list[int] = field(default_factory=lambda: [128, 128])
    """``engine_format: fp8`` with ``block`` scales: rows and columns of a block."""
    fp8_keep: list[str] | None = None
    """``engine_format: fp8``: name patterns (fnmatch, canonical names) of 2-D weights kept in
    BF16; None: the convention's (embeddings, lm_head, norms, MoE router, biases)."""
    preflight: bool = True
    """On the first sync (``DeltaRefit.attach``), every engine compares everything it holds (params,
    buffers, derived tensors) with its own dense load of the same weights (its loader and post-load
    processing; for vLLM an in-place reload), and ``attach`` raises ``PreflightError`` naming what
    differs.  Costs about one dense load and two hashes of the engine's weights, once per job;
    false skips it.  ``nemo-dcr check-engine`` runs the stronger check against a fresh engine."""
    engine_index: bool = True
    """Engines keep a ``dcr`` class index of the tensors they hold between versions (host memory,
    about 2.3 bytes per element of the tensors that receive ``dcr`` records, ~1.15x a BF16 shard),
    so decoding costs in proportion to the changes; false: no such memory, each refit ranks the
    touched tensors again (a pass over each)."""
    fanout: str | None = None
    """How a version reaches the replicas of an engine view: ``direct`` (the owners send every
    replica its parts: the trainer-to-rollout link carries them once per replica) or ``relay``
    (once to the view's relay root, which broadcasts the same bytes to the other replicas inside
    the rollout cluster; docs/refit.md "Fan-out").  None: relay where the wiring has relay
    groups of several replicas, else direct."""
    fanout_roots: str = "view"
    """``relay``: one relay root per engine view (``view``: the slow link carries each view once)
    or per view and node (``node``: no relay crosses between rollout nodes)."""
    threads: int | str = "auto"
    """Worker threads over the records (tensors) of a payload part, on both sides of the host path:
    the sender's encode and commit, the engine's decode, write, read-back check and index update
    (the compiled kernels release the GIL).  A positive int, or ``auto``: the cores the process may
    run on divided by the processes of its host that share them (``LOCAL_WORLD_SIZE``, as under
    torchrun; an engine counts as one), at least 1.  Payload bytes, engine state and errors are
    those of one thread; a part with few changes stays on the calling thread."""

    @classmethod
    def from_mapping(cls, settings: Mapping[str, object], prefix: str = "dcr") -> DcrConfig:
        """The validated config of ``settings`` (field name -> value, in the fields' units).

        Raises:
            ConfigError: an unknown key (named, with the closest known one), a value of the wrong
                type, or one :meth:`validate` refuses.
        """
        hints = typing.get_type_hints(cls)
        for key in settings:
            if key not in hints:
                close = difflib.get_close_matches(str(key), hints, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ConfigError(f"{prefix}.{key}", f"unknown key{hint}; known: {', '.join(hints)}")
        cfg = cls(**{k: _typed(f"{prefix}.{k}", v, hints[k]) for k, v in settings.items()})
        cfg.validate(prefix)
        return cfg

    def validate(self, prefix: str = "dcr") -> None:
        """Raise :class:`ConfigError` naming the first bad key."""
        check_finite(prefix, self)
        check_one_of(prefix, "encoding", self.encoding, ENCODINGS)
        if self.transport in REFUSED_TRANSPORTS:
            raise ConfigError(f"{prefix}.transport", f"{self.transport!r}: {REFUSED_TRANSPORTS[self.transport]}")
        check_one_of(prefix, "transport", self.transport, TRANSPORTS)
        check_one_of(prefix, "baseline", self.baseline, BASELINES)
        if self.fanout is not None:
            check_one_of(prefix, "fanout", self.fanout, FANOUTS)
        check_one_of(prefix, "fanout_roots", self.fanout_roots, FANOUT_ROOTS)
        for enc in self.telemetry_encodings:
            check_one_of(prefix, "telemetry_encodings[]", enc, ENCODINGS)
        if self.transport == "store" and not self.url:
            raise ConfigError(f"{prefix}.url", "the store transport needs a url")
        if self.transport == "store" and not self.key_file:
            raise ConfigError(f"{prefix}.key_file", "the store transport authenticates messages: set a key file")
        if self.baseline == "file" and not self.baseline_dir:
            raise ConfigError(f"{prefix}.baseline_dir", "the file baseline needs a folder")
        check_one_of(prefix, "verify", self.verify, VERIFY_MODES)
        check_at_least(prefix, "verify_steps", self.verify_steps, 1 if self.verify == "sampled" else 0)
        check_at_least(prefix, "verify_block", self.verify_block, 1)
        check_at_least(prefix, "verify_seed", self.verify_seed, 0)
        check_at_least(prefix, "full_resync_interval", self.full_resync_interval, 0)
        if not self.bucket_size_mb > 0:
            raise ConfigError(f"{prefix}.bucket_size_mb", f"must be > 0, got {self.bucket_size_mb!r}")
        if not self.reply_timeout_s > 0:
            raise ConfigError(f"{prefix}.reply_timeout_s", f"must be > 0, got {self.reply_timeout_s!r}")
        if self.threads != "auto" and (isinstance(self.threads, bool) or not isinstance(self.threads, int)
                                       or self.threads < 1):
            raise ConfigError(f"{prefix}.threads", f"must be a positive int or 'auto', got {self.threads!r}")
        self._validate_fp8(prefix)

    def _validate_fp8(self, prefix: str) -> None:
        check_one_of(prefix, "engine_format", self.engine_format, ENGINE_FORMATS)
        check_one_of(prefix, "fp8_granularity", self.fp8_granularity, FP8_GRANULARITIES)
        if len(self.fp8_block) != 2 or min(self.fp8_block) < 1:
            raise ConfigError(f"{prefix}.fp8_block", f"must be two sizes >= 1 (rows, cols), got {self.fp8_block!r}")
        if self.fp8_keep is not None and not all(isinstance(p, str) and p for p in self.fp8_keep):
            raise ConfigError(f"{prefix}.fp8_keep", f"must be non-empty name patterns, got {self.fp8_keep!r}")
