"""What the NeMo-RL plugin says: one line per sync, one telemetry row per sync, once-only notes,
and the refit metrics as NeMo-RL's logger takes them.

NeMo-RL's checkpoint-engine synchronizer returns nothing from ``sync_weights``, so no refit
metric reaches NeMo-RL's logger on its own.  Policy rank 0 prints one ``[nemo-dcr refit]`` line
per sync and appends one row to ``<telemetry_dir>/telemetry.jsonl`` (the schema of
:mod:`nemo_dcr.telemetry.jsonl`); :func:`refit_metrics` turns such a row into the flat
``{name: float}`` that NeMo-RL's ``Logger.log_metrics(metrics, step, prefix=...)`` accepts, and
:func:`log_latest` reads the newest row and hands it to such a logger (a training loop calls it
after ``sync_weights``; see docs/nemo_rl.md).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Mapping

from nemo_dcr.telemetry import TelemetryWriter, step_record

_SAID: set = set()


def log_once(key: Any, message: str, show: bool = True) -> bool:
    """Print ``[nemo-dcr] message`` the first time ``key`` is seen in this process (and ``show``)."""
    if key in _SAID:
        return False
    _SAID.add(key)
    if show:
        print(f"[nemo-dcr] {message}", flush=True)
    return show


def log_unloaded(session: str, names) -> None:
    """Say once per session which exported tensors no vLLM worker loads (skipped as vLLM skips them)."""
    names = sorted(names)
    if names:
        log_once(("unloaded", session), f"{len(names)} exported tensor(s) no vLLM worker's load_weights loads are "
                                        f"skipped, as vLLM skips them: {names[:20]}"
                                        + (f" and {len(names) - 20} more" if len(names) > 20 else ""))


def log_sync(side, r, seconds: float) -> None:
    """One ``[nemo-dcr refit]`` line on stdout and one JSON line in ``<telemetry_dir>/telemetry.jsonl``
    for the sync ``side`` (a :class:`~.policy.PolicySide`) just finished with report ``r``."""
    ratio = r.dense_bytes / r.payload_bytes if r.payload_bytes else float("inf")
    recovered = f"; recovered from: {'; '.join(side.recovered)[:300]}" if side.recovered else ""
    print(f"[nemo-dcr refit] sync {side.syncs} {r.mode} -> v{r.version}: changed "
          f"{r.changed}/{r.numel} ({100 * r.density:.3f}%), payload {r.payload_bytes / 2**20:.3f} MiB vs dense "
          f"{r.dense_bytes / 2**20:.1f} MiB (x{ratio:.1f}), verified={r.verified}, resynced={r.resynced}, "
          f"{seconds:.2f}s" + (f"; handled: {'; '.join(r.detected)[:300]}" if r.detected else "") + recovered,
          flush=True)
    folder = side.options.dcr.telemetry_dir
    if not folder:
        return
    row = step_record(side.syncs, r, session=side.topo.session, sync_s=seconds, time=time.time(),
                      recovered=list(side.recovered))
    try:
        TelemetryWriter(folder, fresh=False).write(row)
    except (OSError, ValueError, NotImplementedError) as exc:
        print(f"[nemo-dcr refit] telemetry not written under {folder}: {exc}", flush=True)


def refit_metrics(row: Mapping[str, Any]) -> dict[str, float]:
    """A telemetry row as flat float metrics: bytes, density, phases (seconds), outcome flags."""
    out = {"density": float(row["density"]), "changed": float(row["changed"]), "version": float(row["version"]),
           "payload_bytes": float(row["payload_bytes"]), "dense_bytes": float(row["bytes"].get("dense", 0)),
           "committed": float(bool(row["committed"])), "resynced": float(bool(row["resynced"])),
           "bit_exact": float(row["verified"] is True), "recovered": float(bool(row.get("recovered")))}
    if "sync_s" in row:
        out["sync_s"] = float(row["sync_s"])
    out.update({f"time/{k}": float(v) for k, v in row["times"].items()})
    return out


def log_latest(logger, folder: str, step: int, prefix: str = "nemo_dcr") -> dict[str, float] | None:
    """Hand the newest row of ``<folder>/telemetry.jsonl`` to ``logger.log_metrics(metrics, step,
    prefix=prefix)`` (NeMo-RL's ``Logger``); returns the metrics (None: no row yet)."""
    path = Path(folder) / "telemetry.jsonl"
    if not path.exists():
        return None
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    if not lines:
        return None
    metrics = refit_metrics(json.loads(lines[-1]))
    logger.log_metrics(metrics, step, prefix=prefix)
    return metrics
