"""Telemetry JSONL and ``nemo-dcr report``: records, totals, markdown, PNG files, and one phase
vocabulary: every phase a refit records is a :class:`Phase`, and the report shows every phase
the rows recorded (the stack of the phases inside the total adds up to the total)."""

from __future__ import annotations

import json

import fsspec
import matplotlib
import pytest
import torch

from nemo_dcr.apply import TensorEngine
from nemo_dcr.config.schema import DcrConfig
from nemo_dcr.refit import DeltaRefit, RefitReport, colocated_wiring
from nemo_dcr.telemetry import TOTAL, Phase, PhaseClock, TelemetryWriter, read_steps, step_record
from nemo_dcr.tools.cli import main
from nemo_dcr.tools.run_report import OTHER, markdown, plot_times, time_stack, totals, write_report
from nemo_dcr.verify.compare import VerifyReport
from tests.report_reader import check_phases_shown
from tests.standins.shard_trainer import ShardTrainer

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

KEY = b"t" * 32
SHAPES = {"a.weight": (48, 32), "b.weight": (64, 16), "norm.weight": (32,)}
DEMO = dict(reward=0.1, shaped_reward=0.2, loss=0.0, rollout_version=1, bit_exact=True, dense_refit_s=1.0)
"""The optional keys the demo writes."""


def _report(step: int, times: dict) -> RefitReport:
    return RefitReport(step, "delta", True, changed=1000 * step, numel=100_000, payload_bytes=700 * step,
                       route_bytes=400 * step, dense_bytes=200_000, bytes_by_encoding={"dcr": 700 * step, "reference": 2000 * step},
                       by_layer_type={"mlp": {"changed": 600 * step, "numel": 60_000},
                                      "norms": {"changed": 1, "numel": 40_000}},
                       times=times, verify=VerifyReport(step, False, 2))


def _run(tmp_path, n=3):
    w = TelemetryWriter(tmp_path)
    for step in range(1, n + 1):
        times = {"capture": 0.1, "send": 0.05, "await": 0.12, "telemetry": 0.02, "total": 0.3}
        w.write(step_record(step, _report(step, times), **dict(DEMO, reward=0.1 * step)))
    return tmp_path


def _every_phase(step: int) -> dict:
    times = {p.value: 0.01 * (k + 1) * step for k, p in enumerate(Phase)}
    times[TOTAL] = sum(v for p, v in zip(Phase, times.values()) if p.in_total) + 0.05
    return times


def test_records_and_totals(tmp_path):
    steps = read_steps(_run(tmp_path))
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert steps[1]["density_by_layer_type"] == {"mlp": 0.02, "norms": 1 / 40_000}
    assert steps[0]["bytes"] == {"dcr": 700, "reference": 2000, "dense": 200_000}
    assert steps[2]["bytes_on_links"] == {"trainer_to_trainer": 1200, "trainer_to_engine": 2100, "engine_fanout": 0}
    t = totals(steps)
    assert t["bytes"]["dcr"] == 4200 and t["ratio_to_dense"]["dense"] == 1.0
    assert t["bytes_on_links"] == {"trainer_to_trainer": 2400, "trainer_to_engine": 4200, "engine_fanout": 0}
    assert t["bit_exact_steps"] == 3 and abs(t["density_mean"] - 0.02) < 1e-12
    assert t["phase_seconds_mean"][OTHER] == pytest.approx(0.03)
    md = markdown(steps)
    assert "| 3 | delta | 0.300 | 3.000% | 0.002 | 0.006 | 0.2 | 0.001 | 0.002 | 0.000 | 0.30 | 1.00 | yes |" in md
    assert "| trainer_to_trainer (link) | 2,400 | 0.4000% |" in md
    assert "| step | mode | capture | send | await | other | total | total_slowest_rank | telemetry (not in total) |" \
        in md
    check_phases_shown(steps, md)


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
    row = step_record(1, _report(1, {"total": 0.3}))
    (tmp_path / "telemetry.jsonl").write_text(json.dumps(row) + "\nnot json\n")
    with pytest.raises(ValueError, match="telemetry.jsonl:2"):
        write_report(tmp_path)


def test_a_row_of_another_schema_is_refused_naming_its_line(tmp_path):
    good = json.dumps(step_record(1, _report(1, {"total": 0.3})))
    old_plugin_row = {"time": 1.0, "session": "s", "sync": 2, "seconds": 0.4, "version": 2, "mode": "delta",
                      "changed": 5, "payload_bytes": 10, "dense_bytes": 99, "times": {"route": 0.1, "total": 0.2}}
    (tmp_path / "telemetry.jsonl").write_text(good + "\n" + json.dumps(old_plugin_row) + "\n")
    with pytest.raises(ValueError, match=r"telemetry.jsonl:2: .*missing keys .*'bytes'.*unknown keys .*'seconds'"):
        write_report(tmp_path)
    schema1 = {k: v for k, v in json.loads(good).items() if k not in ("bytes_on_links", "bytes_by_host")}
    (tmp_path / "telemetry.jsonl").write_text(json.dumps(dict(schema1, schema=1)) + "\n")
    with pytest.raises(ValueError, match=r"telemetry.jsonl:1: .*schema 1, expected 2; missing keys "
                                         r"\['bytes_on_links', 'bytes_by_host'\]"):
        read_steps(tmp_path)
    bad_phase = dict(json.loads(good), times={"transfer": 0.1, "total": 0.2})
    (tmp_path / "telemetry.jsonl").write_text(json.dumps(bad_phase) + "\n")
    with pytest.raises(ValueError, match=r"telemetry.jsonl:1: .*times \['transfer'\] are not phases"):
        read_steps(tmp_path)


def test_only_rows_of_the_schema_are_written(tmp_path):
    w = TelemetryWriter(tmp_path)
    with pytest.raises(ValueError, match="unknown telemetry keys \\['seconds'\\]"):
        step_record(1, _report(1, {}), seconds=1.0)
    with pytest.raises(ValueError, match="times \\['apply'\\] are not phases"):
        step_record(1, _report(1, {"apply": 0.2}))
    with pytest.raises(ValueError, match="missing keys"):
        w.write({"schema": 2, "step": 1})
    assert (tmp_path / "telemetry.jsonl").read_text() == ""


def test_phase_clock_takes_only_phase_members():
    clock = PhaseClock()
    with clock(Phase.SEND):
        pass
    with pytest.raises(TypeError, match="PhaseClock takes a Phase member, got 'transfer'"):
        clock("transfer")
    with pytest.raises(TypeError, match="got 'send'"):
        clock("send")  # the right name as a plain string: still refused
    assert list(clock.seconds) == ["send"] and type(next(iter(clock.seconds))) is str
    assert [p for p in Phase if not p.in_total] == [Phase.EXPORT, Phase.TELEMETRY]


def test_the_report_shows_every_phase_member(tmp_path):
    steps = [step_record(s, _report(s, _every_phase(s))) for s in (1, 2)]
    labels = [b.name for b in time_stack(steps)]
    assert labels[:-2] == [p.value for p in Phase if p.in_total] + [OTHER]
    assert set(labels) == {p.value for p in Phase} | {OTHER}
    check_phases_shown(steps, markdown(steps))
    fig = plot_times(plt, steps)
    drawn = {t.get_text().removesuffix(" (not in total)") for t in fig.axes[0].get_legend().get_texts()}
    plt.close(fig)
    assert {p.value for p in Phase} <= drawn, sorted({p.value for p in Phase} - drawn)


def test_the_plotted_stack_is_the_total():
    steps = [step_record(s, _report(s, _every_phase(s))) for s in (1, 2, 3)]
    steps.append(step_record(4, _report(4, {"route": 0.2, "await": 0.5, "total": 1.0})))  # 0.3 s in no phase
    fig = plot_times(plt, steps)
    bars = fig.axes[0].containers
    plt.close(fig)
    inside = [c for c in bars if not c.get_label().endswith("(not in total)")]
    assert inside[-1].get_label() == OTHER
    for i, s in enumerate(steps):
        stack = sum(c.patches[i].get_height() for c in inside)
        assert stack == pytest.approx(s["times"][TOTAL], abs=1e-9)
        top = max(p.get_y() + p.get_height() for c in bars for p in [c.patches[i]])
        outside = sum(s["times"].get(p.value, 0.0) for p in Phase if not p.in_total)
        assert top == pytest.approx(s["times"][TOTAL] + outside, abs=1e-9)  # hatched above the total
    assert inside[-1].patches[3].get_height() == pytest.approx(0.3)


def test_rows_as_the_refit_and_the_demo_record_them(tmp_path):
    """A real DeltaRefit (attach, delta steps with telemetry encodings, a forced resync): every
    phase but the plugin's export is recorded, and the report shows them all."""
    trainer = ShardTrainer(SHAPES, 0, 1, lr=2e-4)
    engine = TensorEngine({n: torch.zeros(s, dtype=torch.bfloat16) for n, s in SHAPES.items()}, key=KEY)
    cfg = DcrConfig(transport="inprocess", reply_timeout_s=120, full_resync_interval=3,
                    telemetry_encodings=["reference"])
    refit = DeltaRefit(cfg, trainer, colocated_wiring(cfg, 0, KEY), engine, key=KEY)
    w = TelemetryWriter(tmp_path)
    try:
        w.write(step_record(0, refit.attach(), **DEMO))
        for step in range(1, 4):
            trainer.step()
            w.write(step_record(step, refit.step(), **DEMO))
    finally:
        refit.close(5)
    steps = read_steps(tmp_path)
    assert [s["mode"] for s in steps] == ["attach", "delta", "delta", "resync"]
    recorded = {k for s in steps for k in s["times"]} - {"total", "total_slowest_rank"}
    assert recorded == {p.value for p in Phase} - {"export"}
    write_report(tmp_path, tmp_path / "report")
    check_phases_shown(steps, (tmp_path / "report" / "report.md").read_text())


def test_plugin_rows_go_through_the_same_writer_to_a_url():
    url = "memory://telemetry-test/refit"
    times = {"export": 0.2, "capture": 0.1, "route": 0.05, "await": 0.2, "total": 0.4, "total_slowest_rank": 0.45}
    row = step_record(2, _report(2, times), session="abc", sync_s=0.7, time=1.0)
    TelemetryWriter(url, fresh=False).write(row)
    TelemetryWriter(url, fresh=False).write(row)
    with fsspec.open(f"{url}/telemetry.jsonl", "r") as f:
        steps = [json.loads(x) for x in f.read().splitlines()]
    assert steps == [row, row] and totals(steps)["bytes"]["dense"] == 400_000
    md = markdown(steps)
    assert "| export (not in total) |" in md
    check_phases_shown(steps, md)
