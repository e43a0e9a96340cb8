"""One JSON line per refit step: reward, density per layer type, bytes, phase times, checks.

Line schema (``schema`` = 1)::

    {"schema": 1, "step": 3, "version": 3, "mode": "delta", "reward": 0.25, "loss": 0.01,
     "density": 0.012, "changed": 1634000, "numel": 134515008,
     "density_by_layer_type": {"attention": 0.011, ...},
     "bytes": {"dcr": 1.1e6, "reference": 3.5e6, "dense": 2.7e8}, "payload_bytes": 1.1e6,
     "times": {"capture": 0.4, "remap": 0.2, ..., "total": 2.1}, "dense_refit_s": 6.0,
     "verified": true, "bit_exact": true, "error": null,
     "engine_format": {"fp8_elements": 106168320, "fp8_changed": 359000, "scale_changes": 0, ...},
     "fp8_density": 0.0034}

``times`` are the reporting trainer rank's phase times of the refit (``total_slowest_rank``: the
slowest rank's total); ``dense_refit_s`` is a dense refit (gather + convert + load) of the same
weights timed in the same step.  ``engine_format`` holds the counts of an FP8 engine
(:attr:`nemo_dcr.refit.RefitReport.engine_format`; empty for a BF16 engine) and ``fp8_density``
its changed FP8 bytes over FP8 elements (null for a BF16 engine).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

TELEMETRY_FILE = "telemetry.jsonl"
SCHEMA = 1


def step_record(step: int, report, **extra) -> dict:
    """The JSON line of one step from a :class:`nemo_dcr.refit.RefitReport` plus ``extra``.

    Args:
        step: training step (1-based).
        report: the refit report of that step.
        **extra: further fields (``reward``, ``loss``, ``bit_exact``, ``dense_refit_s``...).
    """
    kinds = {k: v["changed"] / max(v["numel"], 1) for k, v in report.by_layer_type.items()}
    return {
        "schema": SCHEMA, "step": step, "version": report.version, "mode": report.mode,
        "density": report.density, "changed": report.changed, "numel": report.numel,
        "density_by_layer_type": kinds,
        "bytes": {**report.bytes_by_encoding, "dense": report.dense_bytes},
        "payload_bytes": report.payload_bytes,
        "times": {k: round(v, 6) for k, v in report.times.items()},
        "verified": report.verified, "error": report.error, "committed": report.committed,
        "resynced": report.resynced, "detected": list(report.detected),
        "engine_format": dict(report.engine_format), "fp8_density": report.fp8_density, **extra,
    }


class TelemetryWriter:
    """Appends step records to ``<run_dir>/telemetry.jsonl`` (flushed after every line).

    Args:
        run_dir: output folder (created).
        fresh: truncate an existing file first.
    """

    def __init__(self, run_dir: str | os.PathLike, fresh: bool = True):
        self.path = Path(run_dir) / TELEMETRY_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if fresh:
            self.path.write_text("")

    def write(self, record: dict) -> None:
        """Append one record as a JSON line."""
        with self.path.open("a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")


def read_steps(run_dir: str | os.PathLike) -> list[dict]:
    """Every record of ``<run_dir>/telemetry.jsonl`` (or of that file given directly).

    Raises:
        FileNotFoundError: no telemetry there.
        ValueError: a line is not JSON (names the line number).
    """
    path = Path(run_dir)
    path = path / TELEMETRY_FILE if path.is_dir() else path
    if not path.is_file():
        raise FileNotFoundError(f"no {TELEMETRY_FILE} in {run_dir}")
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{n}: not a JSON line ({exc.msg})") from None
    return out
