"""``nemo-dcr report RUN_DIR``: plots and a summary table from ``telemetry.jsonl``.

Writes into the run folder (or ``out``):

* ``density.png``: changed fraction per step, overall and per layer type (log scale);
* ``bytes.png``: payload bytes per step for each measured encoding against the dense refit
  (log scale), with the ratio to dense in the legend;
* ``times.png``: delta refit phase times per step (stacked) next to the dense refit time;
* ``report.md``: a per-step table and totals.

matplotlib is imported inside :func:`write_plots` (the ``recipes`` extra).
"""

from __future__ import annotations

import os
from pathlib import Path

from nemo_dcr.telemetry.jsonl import read_steps

PHASES = ("capture", "remap", "transfer", "encode", "apply", "verify", "commit")


def encodings(steps: list[dict]) -> list[str]:
    """Encodings measured in any step (``dense`` last)."""
    names = sorted({k for s in steps for k in s.get("bytes", {}) if k != "dense"})
    return names + ["dense"]


def totals(steps: list[dict]) -> dict:
    """Run totals: bytes per encoding, ratios to dense, mean density and times, checks."""
    def mean(xs):
        xs = [x for x in xs if x is not None]
        return sum(xs) / len(xs) if xs else None

    by_enc = {e: sum(s["bytes"].get(e, 0) for s in steps) for e in encodings(steps)}
    dense = by_enc.get("dense") or 1
    return {
        "steps": len(steps), "bytes": by_enc,
        "ratio_to_dense": {e: b / dense for e, b in by_enc.items()},
        "density_mean": mean(s.get("density") for s in steps),
        "reward_first": steps[0].get("reward"), "reward_last": steps[-1].get("reward"),
        "refit_seconds_delta": mean(s.get("times", {}).get("total") for s in steps),
        "refit_seconds_dense": mean(s.get("dense_refit_s") for s in steps),
        "bit_exact_steps": sum(1 for s in steps if s.get("bit_exact")),
        "verified_steps": sum(1 for s in steps if s.get("verified")),
    }


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def markdown(steps: list[dict]) -> str:
    """The summary table (per step, then totals) as markdown."""
    encs = [e for e in encodings(steps) if e != "dense"]
    head = ["step", "mode", "reward", "density"] + [f"{e} MB" for e in encs] + [
        "dense MB", "delta s", "dense s", "bit-exact"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in steps:
        row = [str(s["step"]), s.get("mode", ""), _fmt(s.get("reward"), ".3f"),
               _fmt(s.get("density"), ".3%")]
        row += [_fmt(s["bytes"].get(e, 0) / 1e6, ".3f") for e in encs]
        row += [_fmt(s["bytes"].get("dense", 0) / 1e6, ".1f"),
                _fmt(s.get("times", {}).get("total"), ".2f"), _fmt(s.get("dense_refit_s"), ".2f"),
                {True: "yes", False: "NO", None: "-"}[s.get("bit_exact")]]
        lines.append("| " + " | ".join(row) + " |")
    t = totals(steps)
    lines += ["", "| total | bytes | vs dense |", "|---|---|---|"]
    lines += [f"| {e} | {b:,} | {t['ratio_to_dense'][e]:.4%} |" for e, b in t["bytes"].items()]
    lines += ["", f"- steps: {t['steps']}, bit-exact steps: {t['bit_exact_steps']}, "
              f"verified: {t['verified_steps']}",
              f"- mean density: {_fmt(t['density_mean'], '.3%')}",
              f"- mean refit seconds: delta {_fmt(t['refit_seconds_delta'], '.2f')}, "
              f"dense {_fmt(t['refit_seconds_dense'], '.2f')}"]
    return "\n".join(lines) + "\n"


def _plot_density(plt, steps: list[dict], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(8, 4.5))
    x = [s["step"] for s in steps]
    ax.plot(x, [s["density"] for s in steps], "k-o", lw=2, label="all tensors")
    kinds = sorted({k for s in steps for k in s.get("density_by_layer_type", {})})
    for k in kinds:
        ax.plot(x, [s["density_by_layer_type"].get(k) for s in steps], "-o", ms=4, label=k)
    ax.set(xlabel="step", ylabel="changed fraction of elements", yscale="log",
           title="Delta density per step and layer type")
    ax.grid(True, which="both", alpha=0.3)
    _finish(plt, fig, ax, path)


def _plot_bytes(plt, steps: list[dict], path: Path) -> None:
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
    _finish(plt, fig, ax, path)


def _plot_times(plt, steps: list[dict], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(8, 4.5))
    x = [s["step"] for s in steps]
    bottom = [0.0] * len(steps)
    for ph in PHASES:
        vals = [s.get("times", {}).get(ph, 0.0) for s in steps]
        ax.bar(x, vals, bottom=bottom, width=0.6, label=ph)
        bottom = [b + v for b, v in zip(bottom, vals)]
    dense = [s.get("dense_refit_s") for s in steps]
    if any(d is not None for d in dense):
        ax.plot(x, dense, "k--o", label="dense refit")
    ax.set(xlabel="step", ylabel="seconds", title="Delta refit phases vs dense refit")
    _finish(plt, fig, ax, path, ncol=2)


def _finish(plt, fig, ax, path: Path, ncol: int = 1) -> None:
    """Legend, integer step ticks, save as PNG, close."""
    ax.legend(fontsize=8, ncol=ncol)
    ax.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_plots(steps: list[dict], out: str | os.PathLike) -> list[Path]:
    """Write the three PNG plots into ``out``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "density.png", out / "bytes.png", out / "times.png"]
    for fn, p in zip((_plot_density, _plot_bytes, _plot_times), paths):
        fn(plt, steps, p)
    return paths


def write_report(run_dir: str | os.PathLike, out: str | os.PathLike | None = None,
                 plots: bool = True) -> dict:
    """Plots + ``report.md`` for a run folder; returns the totals and the written paths.

    Raises:
        FileNotFoundError: no telemetry in ``run_dir``.
        ValueError: the telemetry is empty or malformed.
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
