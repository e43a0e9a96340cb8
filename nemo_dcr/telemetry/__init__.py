"""Telemetry of refits: the phase vocabulary and clock, and the per-step JSONL rows."""

from nemo_dcr.telemetry.jsonl import TELEMETRY_FILE, TelemetryWriter, read_steps, step_record
from nemo_dcr.telemetry.phases import TOTAL, TOTAL_SLOWEST_RANK, Phase, PhaseClock

__all__ = ["TELEMETRY_FILE", "TOTAL", "TOTAL_SLOWEST_RANK", "Phase", "PhaseClock", "TelemetryWriter", "read_steps",
           "step_record"]
