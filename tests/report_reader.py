"""Reads the phase table of ``nemo-dcr report``'s markdown back, apart from the report's own code,
and checks it against the telemetry rows: every phase a row recorded has a column, and the columns
inside the total (``other`` included) add up to the recorded ``total``."""

from __future__ import annotations

OUTSIDE = " (not in total)"
NOT_BARS = ("step", "mode", "total", "total_slowest_rank")


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def phase_rows(markdown: str) -> list[dict[str, str]]:
    """The rows of the ``## Phase seconds`` table (its last row is the mean)."""
    lines = markdown.split("## Phase seconds\n", 1)[1].strip().splitlines()
    head = _cells(lines[0])
    return [dict(zip(head, _cells(line))) for line in lines[2:] if line.startswith("|")]


def check_phases_shown(steps: list[dict], markdown: str) -> None:
    """Every recorded ``times`` key is a column; per step the in-total columns sum to ``total``
    (within the table's rounding to milliseconds)."""
    rows = phase_rows(markdown)
    shown = {c.removesuffix(OUTSIDE) for c in rows[0]}
    recorded = {k for s in steps for k in s["times"]}
    assert recorded <= shown, f"recorded but not in the report: {sorted(recorded - shown)}"
    assert len(rows) == len(steps) + 1, (len(rows), len(steps))
    for s, row in zip(steps, rows):
        bars = [float(v) for c, v in row.items() if c not in NOT_BARS and not c.endswith(OUTSIDE)]
        if "total" in s["times"]:
            assert abs(sum(bars) - s["times"]["total"]) <= 5e-4 * (len(bars) + 1), (row, s["times"])
