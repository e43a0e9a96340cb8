"""Telemetry JSONL and ``nemo-dcr report``: records, totals, markdown, PNG files."""

from __future__ import annotations

import json

import pytest

from nemo_dcr.tools.cli import main
from nemo_dcr.refit import RefitReport
from nemo_dcr.telemetry import TelemetryWriter, read_steps, step_record
from nemo_dcr.tools.run_report import markdown, totals, write_report
from nemo_dcr.verify.compare import VerifyReport


def _run(tmp_path, n=3):
    w = TelemetryWriter(tmp_path)
    for step in range(1, n + 1):
        r = RefitReport(step, "delta", True, changed=1000 * step, numel=100_000, payload_bytes=700 * step,
                        dense_bytes=200_000, bytes_by_encoding={"dcr": 700 * step, "reference": 2000 * step},
                        by_layer_type={"mlp": {"changed": 600 * step, "numel": 60_000},
                                       "norms": {"changed": 1, "numel": 40_000}},
                        times={"capture": 0.1, "apply": 0.2, "total": 0.3}, verify=VerifyReport(step, False, 2))
        w.write(step_record(step, r, reward=0.1 * step, loss=0.0, bit_exact=True, dense_refit_s=1.0))
    return tmp_path


def test_records_and_totals(tmp_path):
    steps = read_steps(_run(tmp_path))
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert steps[1]["density_by_layer_type"] == {"mlp": 0.02, "norms": 1 / 40_000}
    assert steps[0]["bytes"] == {"dcr": 700, "reference": 2000, "dense": 200_000}
    t = totals(steps)
    assert t["bytes"]["dcr"] == 4200 and t["ratio_to_dense"]["dense"] == 1.0
    assert t["bit_exact_steps"] == 3 and abs(t["density_mean"] - 0.02) < 1e-12
    md = markdown(steps)
    assert "| 3 | delta | 0.300 | 3.000% | 0.002 | 0.006 | 0.2 | 0.30 | 1.00 | yes |" in md


def test_report_command_writes_pngs(tmp_path, capsys):
    _run(tmp_path)
    assert main(["report", str(tmp_path)]) == 0
    for name in ("density.png", "bytes.png", "times.png", "report.md"):
        data = (tmp_path / name).read_bytes()
        assert len(data) > 1000 or name == "report.md"
    assert (tmp_path / "bytes.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "Refit report" in capsys.readouterr().out
    assert main(["report", str(tmp_path), "--no-plots", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["totals"]["steps"] == 3


def test_report_errors(tmp_path, capsys):
    assert main(["report", str(tmp_path / "none")]) == 2
    (tmp_path / "telemetry.jsonl").write_text('{"step": 1}\nnot json\n')
    with pytest.raises(ValueError, match="telemetry.jsonl:2"):
        write_report(tmp_path)
