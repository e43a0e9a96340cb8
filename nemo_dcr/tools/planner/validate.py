"""Compare a plan with what a run measured (the main job's ``summary.json`` and ``telemetry.jsonl``).

The plan gets from the run only what a user would know beforehand: the model, the trainer layout,
the engine kind, and the densities per layer type (``telemetry.jsonl``; they are an input of every
plan).  Bytes per changed element come from the committed codec table and throughput from the
calibration, never from the run's own payloads or timings.  Targets: bytes within 20%, refit
time within 2x.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from nemo_dcr.layout import MegatronSpec, ParallelLayout, model_dims

from .figures import Figures, FiguresError, densities_from_file, read_json
from .inputs import EngineDeployment
from .estimate import Plan, make_plan
from .presets import preset_for

BYTES_TOLERANCE = 0.20
TIME_FACTOR = 2.0


def plan_for_run(run_dir: str | Path, fig: Figures) -> tuple[Plan, dict]:
    """The plan of the job a run folder describes, and the run's summary."""
    summary = read_json(Path(run_dir) / "summary.json", "run summary")
    for key in ("model", "trainer_layout", "steps", "delta_bytes_total", "refit_seconds_delta"):
        if key not in summary:
            raise FiguresError(f"{run_dir}/summary.json: missing {key!r}")
    if summary.get("engine") not in ("hf", "vllm"):
        raise FiguresError(f"{run_dir}: engine {summary.get('engine')!r}; validation knows the main job's "
                           "engines (hf, vllm: one engine rank on the trainer's host)")
    lay = summary["trainer_layout"]
    setup = preset_for("smollm2", "smollm2-main-job")
    trainer = ParallelLayout(tp=lay["tp"], pp=lay["pp"], ep=lay.get("ep", 1), dp=lay.get("dp", 1))
    setup = replace(setup, trainer=trainer, engine=EngineDeployment(), preset=f"run {Path(run_dir).name}")
    dens, source = densities_from_file(Path(run_dir))
    fig = replace(fig, densities=dens, density_source=source)
    plan = make_plan(summary["model"], model_dims(summary["model"]), setup, fig, spec=MegatronSpec(),
                     notes=["validation: densities are the run's own (an input); bytes and seconds are predicted"])
    return plan, summary


def validate(run_dir: str | Path, fig: Figures) -> dict:
    """Predicted vs measured bytes and seconds per refit step, with pass/fail against the targets."""
    plan, s = plan_for_run(run_dir, fig)
    steps = s["steps"]
    payload = s.get("bytes_on_links_total", {}).get("trainer_to_engine", s["delta_bytes_total"])  # runs before links: the payload
    bytes_measured = payload / steps
    bytes_ratio = plan.payload_bytes / bytes_measured
    time_ratio = plan.refit_seconds / s["refit_seconds_delta"]
    phases = s.get("phase_seconds_mean", {})
    return {
        "run": str(run_dir), "model": s["model"], "trainer_layout": s["trainer_layout"],
        "payload_bytes_per_step": {"predicted": plan.payload_bytes, "measured": bytes_measured,
                                   "ratio": bytes_ratio, "ok": abs(bytes_ratio - 1) <= BYTES_TOLERANCE},
        "refit_seconds": {"predicted": plan.refit_seconds, "measured": s["refit_seconds_delta"],
                          "ratio": time_ratio, "ok": 1 / TIME_FACTOR <= time_ratio <= TIME_FACTOR},
        "dense_refit_seconds": {"predicted": plan.dense["seconds"], "measured": s.get("refit_seconds_dense")},
        "changed_per_step": {"predicted": plan.changed,
                             "measured": s.get("density_mean", 0) * plan.params},
        "phases_predicted": {p.name: p.seconds for p in plan.path},
        "phases_measured_rank0": phases,
        "targets": {"bytes_within": BYTES_TOLERANCE, "time_within_factor": TIME_FACTOR},
        "ok": abs(bytes_ratio - 1) <= BYTES_TOLERANCE and 1 / TIME_FACTOR <= time_ratio <= TIME_FACTOR,
    }
