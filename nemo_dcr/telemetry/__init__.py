"""Per-step telemetry of refits (JSONL) and the ``nemo-dcr report`` plots and tables."""

from nemo_dcr.telemetry.jsonl import TELEMETRY_FILE, TelemetryWriter, read_steps, step_record

__all__ = ["TELEMETRY_FILE", "TelemetryWriter", "read_steps", "step_record"]
