"""Every command that writes files leaves no output file and no temp file when it fails: ``encode``,
``apply``, ``make-deltas``, ``report``, ``plan --png``, ``plan --calibrate --calibrate-out`` and the
demo's summary (each written through temp files renamed into place only once everything succeeded)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from nemo_dcr.checkpoint import save_checkpoint
from nemo_dcr.tools.cli import main

ENOSPC = OSError(28, "No space left on device")


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def _checkpoints(tmp_path: Path) -> tuple[Path, Path]:
    g = torch.Generator().manual_seed(0)
    a = {"w": torch.randn(32, 8, generator=g).to(torch.bfloat16)}
    b = {"w": (a["w"].float() * 1.01).to(torch.bfloat16)}
    save_checkpoint(a, tmp_path / "a.safetensors")
    save_checkpoint(b, tmp_path / "b.safetensors")
    return tmp_path / "a.safetensors", tmp_path / "b.safetensors"


def _no_space(monkeypatch) -> None:
    """The rename into place fails as on a full disk (the temp file was written already)."""
    def replace(src, dst):
        raise ENOSPC

    monkeypatch.setattr(os, "replace", replace)


def test_encode_and_apply_that_fail_leave_no_file(tmp_path, monkeypatch):
    a, b = _checkpoints(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    assert main(["encode", str(a), str(b), "-o", str(out / "d.dcr")]) == 0
    assert main(["apply", str(a), str(out / "d.dcr"), "-o", str(out / "bad.safetensors"),
                 "--key-file", str(a)]) == 2  # a key the payload does not carry: refused
    _no_space(monkeypatch)
    assert main(["encode", str(a), str(b), "-o", str(out / "e.dcr")]) == 2
    assert main(["apply", str(a), str(out / "d.dcr"), "-o", str(out / "c.safetensors")]) == 2
    assert _files(out) == ["d.dcr"]


def test_make_deltas_that_fails_midway_leaves_no_step_folder(tmp_path, monkeypatch):
    from nemo_dcr.tools.demo import task

    model = torch.nn.Linear(16, 16)
    fail = {"at": 2, "calls": 0}

    def train_step(model, optimizer, tokenizer, problems, cfg):
        fail["calls"] += 1
        if fail["calls"] == fail["at"]:
            raise RuntimeError("the second step failed")
        with torch.no_grad():
            model.weight.mul_(1.5)
        return task.StepStats(0.0, 0.5, 0.5, False)

    monkeypatch.setattr(task, "train_step", train_step)
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    for out in (tmp_path / "new", kept):
        fail["calls"] = 0
        with pytest.raises(RuntimeError, match="second step"):
            task.make_deltas(out, 3, model=model, tokenizer=object(), log=lambda line: None)
    assert not (tmp_path / "new").exists() and _files(kept) == ["notes.txt"]
    fail["at"] = 0
    dirs = task.make_deltas(kept, 1, model=model, tokenizer=object(), log=lambda line: None)
    assert [d.name for d in dirs] == ["step_0", "step_1"] and all(d.is_dir() for d in dirs)
    assert sorted(p.name for p in kept.iterdir()) == ["notes.txt", "step_0", "step_1"]


def _telemetry(run: Path) -> None:
    from nemo_dcr.refit import RefitReport
    from nemo_dcr.telemetry import TelemetryWriter, step_record

    w = TelemetryWriter(run)
    for step in (1, 2):
        w.write(step_record(step, RefitReport(step, "delta", True, changed=10, numel=100, payload_bytes=7,
                                              dense_bytes=200, times={"capture": 0.1, "total": 0.2})))


def test_report_that_fails_while_drawing_or_writing_leaves_no_file(tmp_path, monkeypatch):
    from nemo_dcr.tools import run_report

    run = tmp_path / "run"
    _telemetry(run)
    before = _files(run)

    def broken(plt, steps):
        raise RuntimeError("the last plot failed")

    monkeypatch.setitem(run_report.PLOTS, "times.png", broken)
    with pytest.raises(RuntimeError, match="last plot"):
        run_report.write_report(run)
    assert _files(run) == before
    monkeypatch.undo()
    _no_space(monkeypatch)
    assert main(["report", str(run)]) == 2
    assert _files(run) == before


def test_plan_png_and_calibrate_out_that_fail_leave_no_file(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    from nemo_dcr.tools.planner import calibrate

    def half_written(self, f, **kwargs):
        f.write(b"\x89PNG partial")
        raise ENOSPC

    monkeypatch.setattr(Figure, "savefig", half_written)
    assert main(["plan", "--model", "dense-tiny", "--png", str(tmp_path / "t.png")]) == 2
    monkeypatch.setattr(calibrate, "calibrate", lambda run=None: {"kernels": {}})
    _no_space(monkeypatch)
    assert main(["plan", "--calibrate", "--calibrate-out", str(tmp_path / "cpu.json")]) == 2
    assert _files(tmp_path) == []


def test_demo_that_fails_leaves_no_summary(tmp_path, monkeypatch):
    """Not even the summary an earlier run wrote at the same path."""
    import subprocess

    from nemo_dcr.tools.commands import demo

    summary = tmp_path / "summary.json"
    summary.write_text("{}")
    monkeypatch.setattr(demo, "run_job", lambda *a, **k: subprocess.CompletedProcess(a, 3))
    assert main(["demo", "--run-dir", str(tmp_path / "run"), "--summary-json", str(summary)]) == 3
    assert not summary.exists()
