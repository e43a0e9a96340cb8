"""One JSON line per refit step: the one row schema, its one writer and its reader.

Rows are made by :func:`step_record` from a :class:`nemo_dcr.refit.RefitReport` and appended by
:class:`TelemetryWriter` (the demo, ``recipes/``, the NeMo-RL plugin); :func:`read_steps` reads
them back (``nemo-dcr report``, ``nemo-dcr plan --densities``).  Row schema (``schema`` = 2)::

    {"schema": 2, "step": 3, "version": 3, "mode": "delta", "committed": true, "resynced": false,
     "density": 0.012, "changed": 1634000, "numel": 134515008,
     "density_by_layer_type": {"attention": 0.011, ...},
     "bytes": {"dcr": 1.1e6, "reference": 3.5e6, "dense": 2.7e8}, "payload_bytes": 1.1e6,
     "bytes_on_links": {"trainer_to_trainer": 6.9e5, "trainer_to_engine": 1.1e6, "engine_fanout": 3.3e6},
     "bytes_by_host": {"n1": {"trainer_to_trainer": 3.4e5, "trainer_to_engine": 5.2e5,
                              "trainer_to_other_hosts": 0}, ...},
     "times": {"capture": 0.4, "remap": 0.2, ..., "total": 2.1, "total_slowest_rank": 2.2},
     "verified": true, "error": null, "detected": [],
     "engine_format": {"fp8_elements": 106168320, "fp8_changed": 359000, "scale_changes": 0, ...},
     "fp8_density": 0.0034,
     "reward": 0.25, "loss": 0.01, "bit_exact": true, "dense_refit_s": 6.0}

Every row has the keys of :data:`REQUIRED`; the keys of :data:`OPTIONAL` are present where the
producer measures them (the demo: ``reward`` ... ``dense_refit_s``; the NeMo-RL plugin:
``session``, ``sync_s``, ``time``, ``recovered``); no other key is written.  ``step`` is the
training step (the plugin: the sync's number in its session).  ``times`` are the reporting
trainer rank's seconds, keyed by :class:`nemo_dcr.telemetry.phases.Phase` values plus the totals ``total`` and
``total_slowest_rank`` (see :mod:`.phases` for which phases make up ``total``).
``bytes_on_links`` are the bytes the trainer ranks put on each link, measured from what they
sent (:attr:`nemo_dcr.refit.RefitReport.bytes_on_links`: routing packs between trainer ranks,
payloads to the engines, and ``engine_fanout``: what the engines' relay roots passed on to the
other replicas inside the rollout cluster, ``dcr.fanout: relay``); ``bytes_by_host`` the same per host of the sending ranks, with the
routing bytes addressed to another host (schema 2 added both).
``engine_format`` holds the counts of an FP8 engine (:attr:`nemo_dcr.refit.RefitReport.engine_format`;
empty for a BF16 engine) and ``fp8_density`` its changed FP8 bytes over FP8 elements (null for
a BF16 engine).
"""

from __future__ import annotations

import json
import os
import posixpath
from pathlib import Path

from nemo_dcr.telemetry.phases import TOTALS, Phase

TELEMETRY_FILE = "telemetry.jsonl"
SCHEMA = 2
REQUIRED = ("schema", "step", "version", "mode", "committed", "resynced", "density", "changed", "numel",
            "density_by_layer_type", "bytes", "payload_bytes", "bytes_on_links", "bytes_by_host", "times",
            "verified", "error", "detected", "engine_format", "fp8_density")
"""Keys of every row (:func:`step_record` fills them from the refit report)."""
OPTIONAL = {
    "reward": "demo: mean exact reward of the step's rollouts",
    "shaped_reward": "demo: mean shaped reward (exact + partial credit)",
    "loss": "demo: the step's policy-gradient loss",
    "rollout_version": "demo: engine version the step's rollouts were generated with",
    "bit_exact": "demo: the engine's weights equal an independent dense export bitwise (null: not compared)",
    "dense_refit_s": "demo: seconds of a dense refit of the same weights in the same step (null: none)",
    "session": "NeMo-RL plugin: the session the sync belongs to (a restarted worker starts a new one)",
    "sync_s": "NeMo-RL plugin: wall seconds of the whole sync on policy rank 0 (export, refit, END)",
    "time": "NeMo-RL plugin: Unix time the row was written",
    "detached": "engine ranks found lost in the refit and detached (their process died; refit/replicas.py)",
    "resynced_ranks": "engine ranks a resync was sent to in the refit (as sent)",
    "recovered": "NeMo-RL plugin: failures of the sync's first attempt that its resync recovered from",
    "engine_seconds": "the slowest engine rank's seconds of the refit's version: parts (first to last part "
                      "arriving), apply (decode + transactional apply), checksums (after it); part of times.await",
}
"""Keys a producer may add (name -> meaning); :func:`step_record` refuses any other."""


def step_record(step: int, report, **extra) -> dict:
    """The JSON line of one step from a :class:`nemo_dcr.refit.RefitReport` plus ``extra``.

    Args:
        step: training step (1-based).
        report: the refit report of that step.
        **extra: keys of :data:`OPTIONAL` (``reward``, ``loss``, ``bit_exact``, ``dense_refit_s``...).

    Raises:
        ValueError: a key of ``extra`` is not in :data:`OPTIONAL`, or ``report.times`` has a key
            that is neither a :class:`Phase` value nor a total.
    """
    unknown = sorted(set(extra) - set(OPTIONAL))
    if unknown:
        raise ValueError(f"step_record: unknown telemetry keys {unknown}; optional keys: {sorted(OPTIONAL)}")
    kinds = {k: v["changed"] / max(v["numel"], 1) for k, v in report.by_layer_type.items()}
    row = {
        "schema": SCHEMA, "step": step, "version": report.version, "mode": report.mode,
        "density": report.density, "changed": report.changed, "numel": report.numel,
        "density_by_layer_type": kinds,
        "bytes": {**report.bytes_by_encoding, "dense": report.dense_bytes},
        "payload_bytes": report.payload_bytes, "bytes_on_links": report.bytes_on_links,
        "bytes_by_host": {h: dict(v) for h, v in report.bytes_by_host.items()},
        "times": {k: round(v, 6) for k, v in report.times.items()},
        "verified": report.verified, "error": report.error, "committed": report.committed,
        "resynced": report.resynced, "detected": list(report.detected),
        "engine_format": dict(report.engine_format), "fp8_density": report.fp8_density, **extra,
    }
    for key in ("detached", "resynced_ranks"):  # written where the refit had any
        if getattr(report, key):
            row[key] = list(getattr(report, key))
    if report.engine_seconds:
        row["engine_seconds"] = {k: round(v, 6) for k, v in report.engine_seconds.items()}
    check_row(row)
    return row


def check_row(row: dict) -> None:
    """Refuse a row that is not of this schema.

    Raises:
        ValueError: naming the wrong schema number, the missing and unknown keys, and ``times``
            keys that are neither :class:`Phase` values nor totals.
    """
    if not isinstance(row, dict):
        raise ValueError(f"not a telemetry row: a JSON {type(row).__name__}, not an object")
    problems = []
    if row.get("schema") != SCHEMA:
        problems.append(f"schema {row.get('schema')!r}, expected {SCHEMA}")
    missing = [k for k in REQUIRED if k not in row]
    unknown = sorted(set(row) - set(REQUIRED) - set(OPTIONAL))
    if missing:
        problems.append(f"missing keys {missing}")
    if unknown:
        problems.append(f"unknown keys {unknown}")
    times = row.get("times")
    if isinstance(times, dict):
        odd = sorted(set(times) - {p.value for p in Phase} - set(TOTALS))
        if odd:
            problems.append(f"times {odd} are not phases (phases: {[p.value for p in Phase]}; totals: {list(TOTALS)})")
    if problems:
        raise ValueError(f"not a telemetry row of schema {SCHEMA}: " + "; ".join(problems))


class TelemetryWriter:
    """Appends rows to ``<run_dir>/telemetry.jsonl`` (each line written and closed at once).

    Args:
        run_dir: output folder (created), or a folder-like fsspec URL (``memory://``,
            ``s3://bucket/run``...: the ``store`` extra; the file system must support appending).
        fresh: truncate an existing file first.
    """

    def __init__(self, run_dir: str | os.PathLike, fresh: bool = True):
        self.path = f"{os.fspath(run_dir).rstrip('/')}/{TELEMETRY_FILE}"
        if self._is_url:
            import fsspec

            fs, path = fsspec.core.url_to_fs(self.path)
            fs.makedirs(posixpath.dirname(path), exist_ok=True)
        else:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        if fresh:
            with self._open("w"):
                pass

    @property
    def _is_url(self) -> bool:
        return "://" in self.path

    def _open(self, mode: str):
        if self._is_url:
            import fsspec

            return fsspec.open(self.path, mode)
        return open(self.path, mode)

    def write(self, record: dict) -> None:
        """Append one row (of :func:`step_record`) as a JSON line.

        Raises:
            ValueError: ``record`` is not a row of this schema (:func:`check_row`); nothing written.
        """
        check_row(record)
        line = json.dumps(record, sort_keys=True) + "\n"
        with self._open("a") as f:
            f.write(line)


def read_steps(run_dir: str | os.PathLike, check: bool = True) -> list[dict]:
    """Every row of ``<run_dir>/telemetry.jsonl`` (or of that file given directly).

    Args:
        run_dir: the run folder or the file.
        check: refuse a row that is not of this schema (:func:`check_row`).

    Raises:
        FileNotFoundError: no telemetry there.
        ValueError: a line is not JSON, or (``check``) not a row of this schema (names the line).
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
            row = json.loads(line)
            if check:
                check_row(row)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{n}: not a JSON line ({exc.msg})") from None
        except ValueError as exc:
            raise ValueError(f"{path}:{n}: {exc}") from None
        out.append(row)
    return out
