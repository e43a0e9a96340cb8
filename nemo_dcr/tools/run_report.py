"""``nemo-dcr report RUN_DIR``: plots and a summary table from ``telemetry.jsonl``.

Writes into the run folder (or ``out``):

* ``density.png``: changed fraction per step, overall and per layer type (log scale);
* ``bytes.png``: payload bytes per step for each measured encoding against the dense refit
  (log scale), with the ratio to dense in the legend;
* ``times.png``: the refit's phase times per step (stacked) next to the dense refit time;
* ``report.md``: a per-step table, totals, and the phase seconds per step.

The phase bars and columns are :func:`time_stack`: every :class:`~nemo_dcr.telemetry.phases.Phase`
some row recorded, in ``Phase`` order, never a fixed list.  The phases inside the refit's
``total`` are stacked first, then ``other`` (``total`` minus those phases: time in no phase), so
that part of the stack is the recorded ``total``; phases outside the total (``telemetry``, the
plugin's ``export``) are stacked above it, hatched.

matplotlib is imported inside :func:`write_plots` (the ``recipes`` extra).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from nemo_dcr.telemetry.jsonl import read_steps
from nemo_dcr.telemetry.phases import TOTAL, TOTAL_SLOWEST_RANK, Phase

OTHER = "other"
"""Label of the seconds of ``total`` in no recorded phase."""


@dataclass(frozen=True)
class Bar:
    """One layer of the stacked phase times: a phase (or :data:`OTHER`) over every step.

    Attributes:
        name: the phase's value, or ``other``.
        seconds: one value per step (0.0 where the step did not record it).
        in_total: part of the refit's ``total``.
    """

    name: str
    seconds: list[float]
    in_total: bool

    @property
    def label(self) -> str:
        """The name, marked ``(not in total)`` for a phase outside the total."""
        return self.name if self.in_total else f"{self.name} (not in total)"


def recorded_phases(steps: list[dict]) -> list[Phase]:
    """Every phase some step recorded, in :class:`Phase` order."""
    seen = {k for s in steps for k in s.get("times", {})}
    return [p for p in Phase if p.value in seen]


def time_stack(steps: list[dict]) -> list[Bar]:
    """The stacked phase times of ``steps``: phases in the total, :data:`OTHER`, then the rest.

    For every step that recorded a ``total``, the bars with ``in_total`` add up to it (``other``
    is never negative: phases rounded to microseconds may exceed ``total`` by rounding only).
    """
    phases = recorded_phases(steps)
    times = [s.get("times", {}) for s in steps]
    inside = [Bar(p.value, [t.get(p.value, 0.0) for t in times], True) for p in phases if p.in_total]
    bars = list(inside)
    if any(TOTAL in t for t in times):
        rest = [max(t[TOTAL] - sum(b.seconds[i] for b in inside), 0.0) if TOTAL in t else 0.0
                for i, t in enumerate(times)]
        bars.append(Bar(OTHER, rest, True))
    bars += [Bar(p.value, [t.get(p.value, 0.0) for t in times], False) for p in phases if not p.in_total]
    return bars


def encodings(steps: list[dict]) -> list[str]:
    """Encodings measured in any step (``dense`` last)."""
    names = sorted({k for s in steps for k in s.get("bytes", {}) if k != "dense"})
    return names + ["dense"]


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def totals(steps: list[dict]) -> dict:
    """Run totals: bytes per encoding, ratios to dense, mean density and times, checks."""
    by_enc = {e: sum(s["bytes"].get(e, 0) for s in steps) for e in encodings(steps)}
    dense = by_enc.get("dense") or 1
    return {
        "steps": len(steps), "bytes": by_enc,
        "ratio_to_dense": {e: b / dense for e, b in by_enc.items()},
        "density_mean": _mean(s.get("density") for s in steps),
        "reward_first": steps[0].get("reward"), "reward_last": steps[-1].get("reward"),
        "refit_seconds_delta": _mean(s.get("times", {}).get(TOTAL) for s in steps),
        "refit_seconds_dense": _mean(s.get("dense_refit_s") for s in steps),
        "phase_seconds_mean": {b.name: _mean(b.seconds) for b in time_stack(steps)},
        "bit_exact_steps": sum(1 for s in steps if s.get("bit_exact")),
        "verified_steps": sum(1 for s in steps if s.get("verified")),
    }


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def markdown(steps: list[dict]) -> str:
    """The summary table (per step, then totals, then phase seconds per step) as markdown."""
    encs = [e for e in encodings(steps) if e != "dense"]
    head = ["step", "mode", "reward", "density"] + [f"{e} MB" for e in encs] + [
        "dense MB", "delta s", "dense s", "bit-exact"]
    lines = [_row(head), "|" + "---|" * len(head)]
    for s in steps:
        row = [str(s["step"]), s.get("mode", ""), _fmt(s.get("reward"), ".3f"),
               _fmt(s.get("density"), ".3%")]
        row += [_fmt(s["bytes"].get(e, 0) / 1e6, ".3f") for e in encs]
        row += [_fmt(s["bytes"].get("dense", 0) / 1e6, ".1f"),
                _fmt(s.get("times", {}).get(TOTAL), ".2f"), _fmt(s.get("dense_refit_s"), ".2f"),
                {True: "yes", False: "NO", None: "-"}[s.get("bit_exact")]]
        lines.append(_row(row))
    t = totals(steps)
    lines += ["", "| total | bytes | vs dense |", "|---|---|---|"]
    lines += [f"| {e} | {b:,} | {t['ratio_to_dense'][e]:.4%} |" for e, b in t["bytes"].items()]
    lines += ["", f"- steps: {t['steps']}, bit-exact steps: {t['bit_exact_steps']}, "
              f"verified: {t['verified_steps']}",
              f"- mean density: {_fmt(t['density_mean'], '.3%')}",
              f"- mean refit seconds: delta {_fmt(t['refit_seconds_delta'], '.2f')}, "
              f"dense {_fmt(t['refit_seconds_dense'], '.2f')}"]
    return "\n".join(lines + phase_table(steps)) + "\n"


def phase_table(steps: list[dict]) -> list[str]:
    """Markdown lines: per step the seconds of the :func:`time_stack` bars inside the total,
    ``total``, ``total_slowest_rank``, then the bars outside the total; a last row of means
    (no lines when no step recorded times)."""
    bars = time_stack(steps)
    if not bars:
        return []
    inside, outside = [b for b in bars if b.in_total], [b for b in bars if not b.in_total]
    keys = (TOTAL, TOTAL_SLOWEST_RANK)
    head = ["step", "mode"] + [b.label for b in inside] + list(keys) + [b.label for b in outside]
    lines = ["", "## Phase seconds", "", _row(head), "|" + "---|" * len(head)]
    columns = [b.seconds for b in inside] + [[s.get("times", {}).get(k) for s in steps] for k in keys]
    columns += [b.seconds for b in outside]
    for i, s in enumerate(steps):
        lines.append(_row([str(s["step"]), s.get("mode", "")] + [_fmt(c[i], ".3f") for c in columns]))
    lines.append(_row(["mean", ""] + [_fmt(_mean(c), ".3f") for c in columns]))
    return lines


def plot_density(plt, steps: list[dict]):
    """Changed fraction per step, overall and per layer type; returns the figure."""
    fig, ax = plt.subplots(figsize=(8, 4.5))
    x = [s["step"] for s in steps]
    ax.plot(x, [s["density"] for s in steps], "k-o", lw=2, label="all tensors")
    kinds = sorted({k for s in steps for k in s.get("density_by_layer_type", {})})
    for k in kinds:
        ax.plot(x, [s["density_by_layer_type"].get(k) for s in steps], "-o", ms=4, label=k)
    ax.set(xlabel="step", ylabel="changed fraction of elements", yscale="log",
           title="Delta density per step and layer type")
    ax.grid(True, which="both", alpha=0.3)
    return _finish(plt, fig, ax)


def plot_bytes(plt, steps: list[dict]):
    """Payload bytes per step and encoding against dense; returns the figure."""
    fig, ax = plt.subplots(figsize=(8, 4.5))
    x = [s["step"] for s in steps]
    t = totals(steps)
    for e in encodings(steps):
        style = "k--" if e == "dense" else "-o"
        label = e if e == "dense" else f"{e} ({t['ratio_to_dense'][e]:.3%} of dense)"
        ax.plot(x, [s["bytes"].get(e) for s in steps], style, label=label)
    ax.set(xlabel="step", ylabel="bytes per refit", yscale="log",
           title="Refit payload bytes per encoding vs dense")
    ax.grid(True, which="both", alpha=0.3)
    return _finish(plt, fig, ax)


def plot_times(plt, steps: list[dict]):
    """The bars of :func:`time_stack` stacked per step, and the dense refit; returns the figure."""
    fig, ax = plt.subplots(figsize=(10, 4.5))
    x = [s["step"] for s in steps]
    bottom = [0.0] * len(steps)
    colors = plt.get_cmap("tab20")
    for k, bar in enumerate(time_stack(steps)):
        ax.bar(x, bar.seconds, bottom=bottom, width=0.6, label=bar.label, color=colors(k % 20),
               hatch=None if bar.in_total else "//")
        bottom = [b + v for b, v in zip(bottom, bar.seconds)]
    dense = [s.get("dense_refit_s") for s in steps]
    if any(d is not None for d in dense):
        ax.plot(x, dense, "k--o", label="dense refit", zorder=3)
    ax.set(xlabel="step", ylabel="seconds", title="Refit phases (stacked up to the total) vs dense refit")
    return _finish(plt, fig, ax, beside=True)


def _finish(plt, fig, ax, beside: bool = False):
    """Legend (``beside`` the axes: right of them) and integer step ticks."""
    where = {"loc": "upper left", "bbox_to_anchor": (1.01, 1.0)} if beside else {}
    ax.legend(fontsize=8, **where)
    ax.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
    fig.tight_layout()
    return fig


def plot_reward(plt, steps: list[dict]):
    """The reward curve: the exact-answer reward per step, its running mean, and the reward with the
    named partial credit that shapes the advantages (when recorded); returns the figure, or None
    when no step recorded a reward (the NeMo-RL plugin's rows)."""
    if all(s.get("reward") is None for s in steps):
        return None
    nan = float("nan")
    fig, ax = plt.subplots(figsize=(8, 4.5))
    x = [s["step"] for s in steps]
    exact = [nan if s.get("reward") is None else s["reward"] for s in steps]
    ax.plot(x, exact, "o-", color="tab:blue", alpha=0.5, label="exact-answer reward")
    known = [(i, r) for i, r in zip(x, exact) if r == r]
    if known:
        run = [sum(r for _, r in known[: j + 1][-3:]) / len(known[: j + 1][-3:]) for j in range(len(known))]
        ax.plot([i for i, _ in known], run, "-", color="tab:blue", lw=2.5, label="running mean (3 steps)")
    if any(s.get("shaped_reward") is not None for s in steps):
        ax.plot(x, [nan if s.get("shaped_reward") is None else s["shaped_reward"] for s in steps], "s--", color="tab:orange", ms=4,
                label="with partial credit (shapes the advantages)")
    ax.set(xlabel="step", ylabel="mean reward of the step's rollouts", title="GRPO reward per step")
    ax.grid(True, alpha=0.3)
    return _finish(plt, fig, ax)


PLOTS = {"reward.png": plot_reward, "density.png": plot_density, "bytes.png": plot_bytes, "times.png": plot_times}
"""File name -> the function drawing it."""


def write_plots(steps: list[dict], out: str | os.PathLike) -> list[Path]:
    """Write the :data:`PLOTS` (those with something to draw) as PNG files into ``out``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, plot in PLOTS.items():
        fig = plot(plt, steps)
        if fig is None:
            continue
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        paths.append(out / name)
    return paths


def write_report(run_dir: str | os.PathLike, out: str | os.PathLike | None = None,
                 plots: bool = True) -> dict:
    """Plots + ``report.md`` for a run folder; returns the totals and the written paths.

    Raises:
        FileNotFoundError: no telemetry in ``run_dir``.
        ValueError: the telemetry is empty, or a line is not a row of the schema (named).
    """
    steps = read_steps(run_dir)
    if not steps:
        raise ValueError(f"{run_dir}: telemetry has no steps")
    out = Path(out or (run_dir if Path(run_dir).is_dir() else Path(run_dir).parent))
    out.mkdir(parents=True, exist_ok=True)
    files = write_plots(steps, out) if plots else []
    md = out / "report.md"
    md.write_text("# Refit report\n\n" + markdown(steps))
    return {"totals": totals(steps), "files": [str(p) for p in files + [md]]}
