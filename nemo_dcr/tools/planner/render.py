"""A plan as JSON, as a table, and as a per-rank timeline PNG (matplotlib, imported lazily)."""

from __future__ import annotations

from pathlib import Path

from nemo_dcr.checkpoint import atomic_write
from nemo_dcr.telemetry.phases import Phase

from .cost import RankCost
from .estimate import Plan
from .presets import PRESET_NOTES

TRAINER_PHASES = (Phase.CAPTURE, Phase.REMAP, Phase.ROUTE, Phase.ENCODE, Phase.COMMIT)
"""The recorded refit phases a trainer rank's predicted seconds cover."""
ENGINE_PHASES = ("decode", "apply")
"""The engine rank's predicted seconds (the engine's part of the recorded ``await``)."""


def assumptions(plan: Plan) -> list[str]:
    """Every named assumption the plan rests on."""
    s, out = plan.setup, []
    if s.hardware.codec_device == "gpu" or s.hardware.gpus:
        out.append(f"GPU kernels: {plan.fig.gpu.source}")
    out.append(f"CPU kernels: {plan.fig.cpu.source}")
    out.append(f"densities: {plan.fig.density_source}")
    out.append("bytes per changed element: nearest measured density per layer type from "
               f"{plan.fig.codec.source}; types without their own figure use: experts/shared_experts/router -> mlp")
    out.append(f"machines: {s.hardware.name}; links: {s.links.intra_node_name} {s.links.nvlink_gbps:g} Gbit/s/rank, IB "
               f"{s.links.ib_gbps:g} Gbit/s/node" + (f", cross-cluster {s.links.cross_cluster_gbps:g} Gbit/s/node"
                                                     if s.links.cross_cluster_gbps else "")
               + (f", object store {s.links.object_store_gbps:g} Gbit/s" if s.links.object_store_gbps else ""))
    out.append("capture slices: the even split per copy-group (the distributed optimizer splits its buffer "
               "evenly too: same totals per rank, other tensors)")
    out.append("owners and engine copies as on main: assign_owners over all trainer ranks; a sharded engine "
               "gets records per rank, encoded per engine rank view (replicas included)")
    return out + plan.notes


def to_json(plan: Plan, extra: dict | None = None) -> dict:
    """The ``--json`` object."""
    s = plan.setup
    return {
        "model": plan.model, "params": plan.params, "preset": s.preset, "preset_note": PRESET_NOTES.get(
            s.preset.split("+")[0], ""),
        "trainer_layout": {**s.trainer.sizes(), "world_size": s.trainer.world_size, "expert_dp": s.trainer.expert_dp,
                           "describe": s.trainer.describe()},
        "engine_layout": {**vars(s.engine), "world_size": s.engine.world_size, "describe": s.engine.describe()},
        "placement": s.placement, "links": vars(s.links), "hardware": vars(s.hardware),
        "density_by_layer_type": plan.tensors.density_by_kind,
        "bytes_per_changed_by_layer_type": plan.tensors.bpc_by_kind,
        "bytes_per_changed_source": plan.tensors.bpc_source,
        "changed": plan.changed, "density": plan.changed / plan.params, "payload_bytes": plan.payload_bytes,
        "fanout": s.fanout, "bytes_on_links": {"trainer_to_engine": plan.cross_link_bytes,
                                               "engine_fanout": plan.engine_fanout_bytes},
        "refit_seconds": plan.refit_seconds, "dense_refit_seconds": plan.dense["seconds"],
        "dense_refit": plan.dense, "export_then_diff_seconds": plan.export_diff["seconds"],
        "export_then_diff": plan.export_diff,
        "critical_path": [p.to_dict() for p in plan.path],
        "kernels": {"cpu": plan.fig.cpu.to_dict(), "gpu": plan.fig.gpu.to_dict(),
                    "codec_device": s.hardware.codec_device},
        "assumptions": assumptions(plan), "plan_seconds": plan.build_seconds,
        "plan_cpu_seconds": plan.build_cpu_seconds,
        **(extra or {}),
        "ranks": [c.row() for c in plan.trainers + plan.engines],
    }


def _fmt_bytes(b: float) -> str:
    for unit, div in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= div:
            return f"{b / div:.2f} {unit}"
    return f"{b:.0f} B"


def _short(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _busiest(costs: list[RankCost], phases: tuple[str, ...], n: int) -> list[RankCost]:
    return sorted(costs, key=lambda c: -sum(c.seconds[p] for p in phases))[:n]


def _rank_line(c: RankCost) -> str:
    s = c.share
    secs = " ".join(f"{p} {v:.3g}s" for p, v in c.seconds.items())
    mem = " ".join(f"{k} {_fmt_bytes(v)}" for k, v in c.memory.items())
    if s.side == "engine":
        return (f"  engine  {s.rank:>5} node {s.node:>4}  held {s.scanned:>14,}  changes {c.changes:>13,.0f}  "
                f"received {_fmt_bytes(c.payload_bytes):>9}  {secs}  [{mem}]")
    return (f"  trainer {s.rank:>5} node {s.node:>4}  scan {s.scanned:>14,}  changes {c.changes:>13,.0f}  "
            f"owned {c.owned_elements:>14,}  sent {_fmt_bytes(c.payload_bytes):>9}  {secs}  [{mem}]")


def table(plan: Plan, rows: int = 6, extra: dict | None = None) -> str:
    """Human-readable summary: the layouts, totals, the critical path, the busiest ranks, assumptions."""
    s = plan.setup
    lines = [f"nemo-dcr plan: {plan.model} ({plan.params / 1e9:.2f} B params), preset {s.preset}",
             f"  {PRESET_NOTES.get(s.preset.split('+')[0], '')}",
             f"  trainer {s.trainer.describe()} = {s.trainer.world_size} ranks; engine {s.engine.describe()} = "
             f"{s.engine.world_size} ranks; placement {s.placement}; codec on {s.hardware.codec_device}",
             f"  density {plan.changed / plan.params:.3%} -> {plan.changed:,.0f} changed elements; payload "
             f"{_fmt_bytes(plan.payload_bytes)} on the wire (all engine ranks)",
             f"  delta refit {plan.refit_seconds:.2f} s | dense refit {plan.dense['seconds']:.2f} s "
             f"({plan.dense['seconds'] / plan.refit_seconds:.1f}x) | export-then-diff "
             f"{plan.export_diff['seconds']:.2f} s ({plan.export_diff['seconds'] / plan.refit_seconds:.1f}x)",
             "critical path:"]
    lines += [f"  {p.name:<20} {p.seconds:>9.3f} s  {p.rank:<14} {p.bound}" for p in plan.path]
    lines.append(f"busiest trainer ranks (of {len(plan.trainers)}):")
    lines += [_rank_line(c) for c in _busiest(plan.trainers, TRAINER_PHASES, rows)]
    lines.append(f"busiest engine ranks (of {len(plan.engines)}):")
    lines += [_rank_line(c) for c in _busiest(plan.engines, ENGINE_PHASES, rows)]
    for key, value in (extra or {}).items():
        if isinstance(value, dict):
            lines.append(f"{key.replace('_', ' ')}:")
            lines += [f"  {k}: {_short(v)}" for k, v in value.items()]
        else:
            lines.append(f"{key.replace('_', ' ')}: {value}")
    lines.append("assumptions:")
    lines += [f"  - {a}" for a in assumptions(plan)]
    lines.append(f"planned in {plan.build_seconds:.2f} s wall, {plan.build_cpu_seconds:.2f} s CPU")
    return "\n".join(lines)


def timeline_png(plan: Plan, path: str | Path, rows: int = 24) -> Path:
    """Per-rank timeline of the critical path's phases (the busiest ``rows`` ranks of each side)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    starts, t = {}, 0.0
    for p in plan.path:
        starts[p.name] = t
        t += p.seconds
    ranks = _busiest(plan.trainers, TRAINER_PHASES, rows) + _busiest(plan.engines, ENGINE_PHASES, rows)
    fig, ax = plt.subplots(figsize=(11, 0.25 * len(ranks) + 2))
    colors = plt.get_cmap("tab10")
    for y, c in enumerate(ranks):
        for k, (phase, offset) in enumerate(_bars(c, starts)):
            ax.broken_barh([(offset, c.seconds[phase])], (y - 0.4, 0.8), color=colors(k))
    send = next(p for p in plan.path if p.name == "send")
    ax.axvspan(starts["send"], starts["send"] + send.seconds, color="grey", alpha=0.2, label=f"send: {send.bound}")
    ax.set_yticks(range(len(ranks)), [f"{c.share.side[0]}{c.share.rank}" for c in ranks], fontsize=6)
    ax.set_xlabel("seconds")
    ax.set_title(f"{plan.model} {plan.setup.preset}: delta refit {plan.refit_seconds:.2f} s "
                 f"(dense {plan.dense['seconds']:.1f} s)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors(k)) for k in range(5)]
    ax.legend(handles + [ax.patches[-1]], ["capture / decode", "remap / apply", "route", "encode", "commit", "send"],
              fontsize=7, loc="lower right")
    fig.tight_layout()
    out = Path(path)
    try:  # through a temp file renamed into place: a failure leaves no file
        atomic_write({out: lambda f: fig.savefig(f, format="png", dpi=110)})
    finally:
        plt.close(fig)
    return out


def _bars(c: RankCost, starts: dict[str, float]) -> list[tuple[str, float]]:
    if c.share.side == "engine":
        t0 = starts["engine decode+apply"]
        return [("decode", t0), ("apply", t0 + c.seconds["decode"])]
    t0 = starts["capture+remap"]
    return [(Phase.CAPTURE, t0), (Phase.REMAP, t0 + c.seconds[Phase.CAPTURE]), (Phase.ROUTE, starts["route"]),
            (Phase.ENCODE, starts["encode"]), (Phase.COMMIT, starts["ack+verify+commit"])]
