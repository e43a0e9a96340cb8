"""The numbers a plan stands on: kernel throughput, bytes per changed element, densities.

* **Kernel throughput** (:class:`Kernels`): CPU figures measured on a machine by
  ``nemo-dcr plan --calibrate`` (written to ``figures/cpu.json``, read back by every plan, so a
  faster codec flows in by rerunning the calibration); GPU figures are :data:`GPU_ASSUMPTIONS`,
  named as assumptions in every output until a GPU run measures them.
* **Bytes per changed element** per layer type: measured points from ``nemo-dcr diff --json``
  on real RL steps (``figures/codec_points.json``, each with the command that produced it).  A
  plan takes, per layer type, the point whose density is nearest (in log) to the planned one.
* **Densities**: one number, or per layer type from ``nemo-dcr diff --json`` or a run's
  ``telemetry.jsonl``.  Layer types a source did not measure (experts of a dense model's run)
  take a named stand-in type (:data:`TYPE_FALLBACK`).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, Mapping

from nemo_dcr.telemetry import read_steps

FIGURES_DIR = Path(__file__).resolve().parent / "figures"
CPU_FIGURES = FIGURES_DIR / "cpu.json"
CODEC_POINTS = FIGURES_DIR / "codec_points.json"

TYPE_FALLBACK = {"experts": "mlp", "shared_experts": "mlp", "router": "mlp", "other": "mlp"}
"""Layer type -> the measured type standing in for it when a source has no figure of its own."""


class FiguresError(ValueError):
    """A figures file is missing, unreadable, or lacks a field (names the file and the field)."""


@dataclass(frozen=True)
class Kernels:
    """Throughput of the refit's kernels on one worker (one CPU core or one GPU)."""

    scan_gbps: float
    """GB/s of model compared by the capture scan (bytes of one bf16 copy)."""
    remap_per_s: float
    """Changes remapped megatron -> canonical per second."""
    route_per_s: float
    """Changes packed, unpacked and merged at the owner per second."""
    encode_pass_gbps: float
    """GB/s of base bits the ``dcr`` encoder passes over per tensor with changes."""
    encode_per_s: float
    """Changes encoded per second (on top of the pass)."""
    decode_pass_gbps: float
    """GB/s of base bits the ``dcr`` decoder passes over."""
    decode_per_s: float
    """Changes decoded and checked per second (on top of the pass)."""
    apply_per_s: float
    """Changes written in place with their undo log and read back per second."""
    ref_encode_per_s: float
    """Changes per second of the ``reference`` coding (gaps + XOR + zstd; export-then-diff)."""
    ref_decode_per_s: float
    """Changes per second decoding ``reference``."""
    memcpy_gbps: float
    """Copy bandwidth (a dense load)."""
    source: str
    """Where the figures come from (a measurement command or ``assumption``)."""

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (JSON)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "figures") -> "Kernels":
        """Inverse of :meth:`to_dict`; a missing field raises :class:`FiguresError` naming it."""
        names = [f.name for f in fields(cls)]
        missing = [n for n in names if n not in d]
        if missing:
            raise FiguresError(f"{where}: missing kernel figures {missing}")
        return cls(**{n: d[n] for n in names})


GPU_ASSUMPTIONS = Kernels(
    scan_gbps=2000.0, remap_per_s=2e9, route_per_s=5e8, encode_pass_gbps=1000.0, encode_per_s=2e8,
    decode_pass_gbps=1000.0, decode_per_s=2e8, apply_per_s=1e9, ref_encode_per_s=1e8, ref_decode_per_s=1e8,
    memcpy_gbps=2000.0,
    source="ASSUMPTION (no GPU measured): H200-class device; scan and copies at ~40% of 4.8 TB/s HBM, "
           "dcr encode/decode 200 M changes/s, apply 1 G changes/s; benchmarks/gpu.sh measures them",
)
"""Named GPU assumptions; replace by measured figures (``--gpu-figures FILE``) when a GPU run exists."""


def read_json(path: str | Path, what: str) -> Any:
    """Parse a JSON file, naming it and ``what`` it should hold when that fails."""
    p = Path(path)
    if not p.is_file():
        raise FiguresError(f"{what}: no file {p}")
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise FiguresError(f"{what}: {p} is not JSON ({exc.msg} at line {exc.lineno})") from None


def cpu_kernels(path: str | Path = CPU_FIGURES) -> Kernels:
    """Measured CPU figures (``nemo-dcr plan --calibrate`` writes them)."""
    doc = read_json(path, "CPU kernel figures")
    if "kernels" not in doc:
        raise FiguresError(f"{path}: no 'kernels' (write it with `nemo-dcr plan --calibrate`)")
    k = Kernels.from_dict(doc["kernels"], str(path))
    when = ", ".join(str(doc[f]) for f in ("data", "measured") if f in doc)
    return replace(k, source=f"{k.source} ({when})") if when else k


@dataclass(frozen=True)
class CodecPoint:
    """One measured (density, bytes per changed element) point of one layer type."""

    layer_type: str
    density: float
    bytes_per_changed: dict[str, float]
    """Encoding -> record bytes per changed element (``dcr``, ``reference``)."""
    label: str
    """Which step of which run (with the command in the table's ``source``)."""


@dataclass(frozen=True)
class CodecTable:
    """Measured points and the per-record framing overhead."""

    points: tuple[CodecPoint, ...]
    header_bytes_per_record: float
    source: str
    default_label: str = ""
    """The point set whose densities a plan uses when none are given."""

    def default_densities(self) -> tuple[dict[str, float], str]:
        """(layer type -> density, source) of the default measured step."""
        pts = [p for p in self.points if p.label == self.default_label]
        if not pts:
            raise FiguresError(f"codec table: no points labelled {self.default_label!r} for default densities")
        return {p.layer_type: p.density for p in pts}, f"measured step {self.default_label} ({self.source})"

    def bytes_per_changed(self, layer_type: str, density: float, encoding: str = "dcr") -> tuple[float, str]:
        """(bytes per changed element, label of the point used) for ``layer_type`` at ``density``."""
        kind = layer_type if any(p.layer_type == layer_type for p in self.points) else TYPE_FALLBACK.get(layer_type)
        cands = [p for p in self.points if p.layer_type == kind and encoding in p.bytes_per_changed]
        if not cands:
            raise FiguresError(f"codec table: no {encoding!r} point for layer type {layer_type!r} (stand-in "
                               f"{kind!r}; measured: {sorted({p.layer_type for p in self.points})}; {self.source})")
        d = max(density, 1e-12)
        best = min(cands, key=lambda p: abs(math.log(max(p.density, 1e-12) / d)))
        return best.bytes_per_changed[encoding], f"{kind} @ {best.density:.3%} ({best.label})"


def codec_table(path: str | Path = CODEC_POINTS) -> CodecTable:
    """The committed table of measured codec points."""
    d = read_json(path, "codec points")
    try:
        pts = tuple(CodecPoint(**p) for p in d["points"])
        return CodecTable(pts, float(d["header_bytes_per_record"]), str(d["source"]), str(d.get("default", "")))
    except (KeyError, TypeError) as exc:
        raise FiguresError(f"{path}: malformed codec table ({exc})") from None


def densities_from_file(path: str | Path) -> tuple[dict[str, float], str]:
    """Per-layer-type densities of a ``nemo-dcr diff --json`` output or a run's telemetry.

    A telemetry file (or run folder) gives the mean over its ``delta`` steps (only ``mode`` and
    ``density_by_layer_type`` are read, so rows are not checked against the schema).

    Returns:
        (layer type -> density, a description of the source).
    """
    p = Path(path)
    if p.is_dir() or p.suffix == ".jsonl":
        rows = read_steps(p, check=False)
        steps = [s for s in rows if s.get("mode") == "delta" and s.get("density_by_layer_type")]
        if not steps:
            raise FiguresError(f"{path}: no delta steps with density_by_layer_type")
        kinds = sorted({k for s in steps for k in s["density_by_layer_type"]})
        out = {k: sum(s["density_by_layer_type"].get(k, 0.0) for s in steps) / len(steps) for k in kinds}
        return out, f"telemetry {p} (mean of {len(steps)} delta steps)"
    d = read_json(p, "densities")
    if "by_layer_type" not in d:
        raise FiguresError(f"{path}: neither telemetry nor a `nemo-dcr diff --json` output (no by_layer_type)")
    return {k: v["density"] for k, v in d["by_layer_type"].items()}, f"diff {p}"


def density_of(densities: Mapping[str, float], layer_type: str) -> float:
    """Density of a layer type, through :data:`TYPE_FALLBACK` when the source lacks it."""
    if layer_type in densities:
        return densities[layer_type]
    kind = TYPE_FALLBACK.get(layer_type)
    if kind not in densities:
        raise FiguresError(f"densities: no figure for {layer_type!r} nor its stand-in {kind!r}; "
                           f"have {sorted(densities)}")
    return densities[kind]


@dataclass(frozen=True)
class Figures:
    """Measured and assumed inputs of a plan."""

    cpu: Kernels
    gpu: Kernels
    codec: CodecTable
    densities: dict[str, float]
    density_source: str


def default_figures(density: float | None = None, densities: str | Path | None = None,
                    cpu: str | Path | None = None, gpu: str | Path | None = None,
                    codec: str | Path | None = None) -> Figures:
    """The figures of a plan: committed calibration and codec points unless files are given.

    Args:
        density: changed fraction of every layer type.
        densities: a ``nemo-dcr diff --json`` output or a run's telemetry (per layer type).
        cpu / gpu / codec: figures files (GPU default: :data:`GPU_ASSUMPTIONS`).

    Without ``density`` and ``densities``, the densities of the table's default measured step.
    """
    if density is not None and densities is not None:
        raise FiguresError("give a density or a densities file, not both")
    table = codec_table(codec or CODEC_POINTS)
    if density is not None:
        if not 0 < density <= 1:
            raise FiguresError(f"--density {density}: must be in (0, 1]")
        dens = {k: density for k in ("attention", "embeddings", "mlp", "norms")}
        source = f"{density:.3%} for every layer type (--density)"
    elif densities is not None:
        dens, source = densities_from_file(densities)
    else:
        dens, source = table.default_densities()
    gpu_k = Kernels.from_dict(read_json(gpu, "GPU figures").get("kernels", {}), str(gpu)) if gpu else GPU_ASSUMPTIONS
    return Figures(cpu_kernels(cpu or CPU_FIGURES), gpu_k, table, dens, source)
