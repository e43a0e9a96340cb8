"""What the demo shows and keeps: progress lines, ``summary.json`` and the closing table.

Progress lines carry the ``[demo]`` marker: ``nemo-dcr demo`` shows them on the terminal and keeps
everything else the ranks print in ``job.log`` (:mod:`nemo_dcr.tools.commands.demo`).
"""

from __future__ import annotations

import time

MARK = "[demo] "
"""Prefix of the lines the launcher shows."""


class Progress:
    """Progress lines stamped with the time since the job started (``[m:ss]``), on one rank."""

    def __init__(self, start: float, on: bool):
        self.start, self.on = start, on

    def __call__(self, text: str) -> None:
        if self.on:
            s = int(time.time() - self.start)
            print(f"{MARK}[{s // 60}:{s % 60:02d}] {text}", flush=True)


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _ratio(delta: float | None, dense: float | None) -> str:
    return f"{delta / dense:.2f}x" if delta is not None and dense else "-"


def eta(done: int, total: int, seconds_per_step: float) -> str:
    s = int(round((total - done) * seconds_per_step))
    return f"ETA {s // 60}:{s % 60:02d}" if done < total else "done"


def step_line(rec: dict, steps: int, eta_text: str) -> str:
    """One line per step: reward, density, bytes (the payload to the engine, as the other encodings
    and dense would be, then the routing between trainer ranks), delta vs dense time, bit-exact, ETA."""
    others = " ".join(f"{k} {v / 1e6:.2f} MB," for k, v in sorted(rec["bytes"].items())
                      if k not in ("dense", rec.get("encoding")))
    routed = (rec.get("bytes_on_links") or {}).get("trainer_to_trainer", 0)
    routed_text = f" + {routed / 1e6:.2f} MB between trainer ranks" if routed else ""
    exact = {True: "bit-exact", False: "MISMATCH", None: "unchecked"}[rec["bit_exact"]]
    fp8 = f", FP8 density {rec['fp8_density']:.3%}" if rec.get("fp8_density") is not None else ""
    dense = rec.get("dense_refit_s")
    return (f"step {rec['step']}/{steps}  reward {rec['reward']:.2f} (with partial credit "
            f"{rec['shaped_reward']:.2f})  density {rec['density']:.2%}{fp8}  sent "
            f"{rec['payload_bytes'] / 1e6:.2f} MB to the engine ({others} dense {rec['bytes']['dense'] / 1e6:.0f} MB)"
            f"{routed_text}  refit {rec['times'].get('total', 0):.2f} s "
            f"vs dense {dense if dense is not None else float('nan'):.2f} s "
            f"({_ratio(rec['times'].get('total'), dense)})  {exact}  {eta_text}")


def summarize(cfg, steps: list[dict], init, seconds: float, dense_method: str) -> dict:
    """The summary JSON (see docs/recipes.md)."""
    t = cfg.trainer
    delta_s, dense_s = _mean(s["times"].get("total") for s in steps), _mean(s["dense_refit_s"] for s in steps)
    half = max(1, len(steps) // 3)
    return {
        "steps": len(steps), "trainer_layout": {"tp": t.tp, "pp": t.pp, "ep": t.ep, "dp": 1},
        "engine": cfg.engine.kind, "engine_placement": cfg.engine.placement, "model": t.model,
        "encoding": cfg.dcr.encoding, "transport": cfg.dcr.transport,
        "reward_per_step": [s["reward"] for s in steps],
        "shaped_reward_per_step": [s["shaped_reward"] for s in steps],
        "reward_first": steps[0]["reward"], "reward_last": steps[-1]["reward"],
        "reward_mean": _mean(s["reward"] for s in steps),
        "reward_mean_first_third": _mean(s["reward"] for s in steps[:half]),
        "reward_mean_last_third": _mean(s["reward"] for s in steps[-half:]),
        "density_mean": _mean(s["density"] for s in steps),
        **_links_summary(steps),
        "dense_bytes_total": sum(s["bytes"]["dense"] for s in steps),
        "bytes_by_encoding_total": {k: sum(s["bytes"].get(k, 0) for s in steps) for k in steps[0]["bytes"]},
        "bit_exact_steps": sum(1 for s in steps if s["bit_exact"]),
        "checked_steps": sum(1 for s in steps if s["bit_exact"] is not None),
        "refit_seconds_delta": delta_s, "refit_seconds_dense": dense_s,
        "refit_ratio_delta_over_dense": delta_s / dense_s if delta_s is not None and dense_s else None,
        "dense_method": dense_method,
        "dense_seconds_parts_mean": {k: _mean(s.get("dense_parts", {}).get(k) for s in steps)
                                     for k in ("recv", "convert", "load")},
        "behind_seconds_mean": _mean(s.get("behind_s") for s in steps),
        "attach_seconds": init.times["total"], "attach_payload_bytes": init.payload_bytes,
        "attach_resynced": init.resynced, "attach_phase_seconds": dict(init.times),
        "phase_seconds_mean": {k: _mean(s["times"].get(k) for s in steps)
                               for k in sorted({k for s in steps for k in s["times"]})},
        "engine_seconds_mean": {k: _mean(s.get("engine_seconds", {}).get(k) for s in steps)
                                for k in sorted({k for s in steps for k in s.get("engine_seconds", {})})},
        "modes": [s["mode"] for s in steps], "wall_seconds": seconds,
        "engine_weights": cfg.engine.weights, **_fp8_summary(steps),
    }


def _links_summary(steps: list[dict]) -> dict:
    """Bytes on every link over the run's steps, from what was sent: ``bytes_on_links_total``
    (trainer-to-trainer routing, trainer-to-engine payloads), their sum ``delta_bytes_total``, and
    ``bytes_by_host_total`` (per host of the sending ranks, with the routing to other hosts)."""
    links = {k: sum(s["bytes_on_links"][k] for s in steps) for k in steps[0]["bytes_on_links"]}
    hosts: dict[str, dict[str, int]] = {}
    for s in steps:
        for h, v in s["bytes_by_host"].items():
            for k, b in v.items():
                hosts.setdefault(h, {}).setdefault(k, 0)
                hosts[h][k] += b
    return {"delta_bytes_total": sum(links.values()), "bytes_on_links_total": links, "bytes_by_host_total": hosts}


def _links_text(links: dict, total: str) -> str:
    """Bytes per link, the payload first (what the other encodings' and dense figures compare
    with), then the routing between trainer ranks and their sum when there is any."""
    payload, routed = links.get("trainer_to_engine", 0) / 1e6, links.get("trainer_to_trainer", 0) / 1e6
    if not routed:
        return f"{payload:.2f} MB{total}"
    return (f"{payload:.2f} MB to the engine + {routed:.2f} MB between trainer ranks = "
            f"{payload + routed:.2f} MB{total}")


def table(summary: dict, run_dir: str, files: list[str]) -> str:
    """The closing table a person reads (the JSON stays in ``summary.json``)."""
    s, mb = summary, 1e6
    reward = (f"{s['reward_mean_first_third']:.2f} -> {s['reward_mean_last_third']:.2f} exact-answer reward "
              f"(mean of the first and last third of the steps)")
    others = ", ".join(f"{k} {v / mb:.1f} MB" for k, v in sorted(s["bytes_by_encoding_total"].items())
                       if k not in ("dense", s["encoding"]))
    rows = [
        ("steps", f"{s['steps']}, bit-exact {s['bit_exact_steps']}/{s['checked_steps']} (the engine equals its own "
                  "full load of the same weights)"),
        ("reward", reward),
        ("bytes", f"{s['encoding']} {_links_text(s['bytes_on_links_total'], ' sent')} vs dense "
                  f"{s['dense_bytes_total'] / mb:.0f} MB ({s['delta_bytes_total'] / max(s['dense_bytes_total'], 1):.2%})"
                  + (f"; the same changes as {others} to the engine" if others else "")),
        ("refit time", f"{s['refit_seconds_delta']:.2f} s per step vs efficient dense refit "
                       f"{s['refit_seconds_dense'] or float('nan'):.2f} s "
                       f"({_ratio(s['refit_seconds_delta'], s['refit_seconds_dense'])})"),
        ("first sync", f"{s['attach_seconds']:.1f} s, {s['attach_payload_bytes'] / mb:.2f} MB sent"),
        ("report", ", ".join(files)),
        ("summary", f"{run_dir}/summary.json"),
        ("logs", f"{run_dir}/job.log, {run_dir}/engine.log"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def _fp8_summary(steps: list[dict]) -> dict:
    """FP8 figures of the run, per step and totalled (empty for a BF16 engine), all from the
    steps' reports: changed FP8 bytes over FP8 elements, scale changes, and the payload sent (FP8
    delta) against the same version encoded as a BF16 delta and against an FP8 dense refit (the
    engine's tensors whole: FP8 weights, scales and the kept BF16 tensors); then the FP8 weights'
    part alone, as FP8 bytes + scales and as BF16 (kept tensors, the embedding first, are the same
    in both payloads)."""
    fmts = [s["engine_format"] for s in steps if s.get("fp8_density") is not None]
    if not fmts:
        return {}
    sent = [s["payload_bytes"] for s in steps]
    bf16 = [f.get("bf16_delta_bytes") for f in fmts]
    w_fp8, w_bf16 = [f.get("fp8_weights_delta_bytes") for f in fmts], [f.get("bf16_weights_delta_bytes") for f in fmts]
    dense = [s["bytes"]["dense"] for s in steps]
    total = {k: sum(f.get(k, 0) for f in fmts) for k in ("fp8_changed", "scale_changes")}
    return {"fp8": {
        **total, "fp8_elements": fmts[0]["fp8_elements"], "fp8_blocks": fmts[0]["fp8_blocks"],
        "fp8_weights_dense_bytes": fmts[0]["fp8_dense_bytes"],
        "bit_exact_per_step": [s["bit_exact"] for s in steps],
        "fp8_density_per_step": [s["fp8_density"] for s in steps],
        "scale_changes_per_step": [f["scale_changes"] for f in fmts],
        "fp8_delta_bytes_per_step": sent, "bf16_delta_bytes_per_step": bf16, "fp8_dense_bytes_per_step": dense,
        "bf16_delta_over_fp8_delta": _ratios(bf16, sent), "fp8_dense_over_fp8_delta": _ratios(dense, sent),
        "fp8_weights_delta_bytes_per_step": w_fp8, "bf16_weights_delta_bytes_per_step": w_bf16,
        "fp8_weights_bf16_over_fp8": _ratios(w_bf16, w_fp8)}}


def _ratios(num: list, den: list) -> list:
    return [round(a / b, 2) if a is not None and b else None for a, b in zip(num, den)]
