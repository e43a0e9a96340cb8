"""GRPO with a bit-exact delta refit after every step, on CPU (torchrun worker).

Trainer: the embedded SmolLM2-135M-Instruct in megatron-core (TP x PP ranks on gloo, fp32
master AdamW).  Engine (``engine.kind``/``engine.placement``): a vLLM engine in a process of its
own started by trainer rank ``engine.rank`` (the main job), or a transformers model in that
rank's process, producing sampled rollouts for arithmetic prompts (exact-answer reward).  Each step: rollouts ->
group-relative advantages -> policy-gradient step -> :meth:`nemo_dcr.refit.DeltaRefit.step`
(every rank encodes what it owns; payloads cross ``dcr.transport`` to the engine's server) ->
the engine checked bitwise against an independent dense export, and a dense refit of the same
weights timed::

    torchrun --nproc-per-node 6 -m nemo_dcr.tools.demo.grpo \
        --config configs/grpo_smollm2_cpu.yaml run.steps=3

Rank ``engine.rank`` prints one progress line per step, writes ``telemetry.jsonl`` and
``summary.json`` (or ``--summary-json``) into ``run.run_dir``.  The initial weights travel to
the trainer ranks as a safetensors file under the run folder, removed once every rank loaded it.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from nemo_dcr.checkpoint import atomic_write
from nemo_dcr.tools.demo.recipe_load import load_config, to_yaml
from nemo_dcr.tools.demo.rollout import rl_config
from nemo_dcr.tools.demo.trainer import build_trainer, policy_gradient_backward
from nemo_dcr.tools.megatron.dense import dense_export
from nemo_dcr.refit import DeltaRefit
from nemo_dcr.telemetry import TOTAL, TelemetryWriter, step_record


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=None, help="recipe YAML (default: schema defaults)")
    p.add_argument("--summary-json", default=None, help="summary path (default run_dir/summary.json)")
    p.add_argument("overrides", nargs="*", help="dotted.key=value config overrides")
    return p.parse_args(argv)


def _log(msg: str) -> None:
    print(f"[grpo] {msg}", flush=True)


def dense_check(trainer, handle, starter: int) -> tuple[float, bool | None]:
    """Dense refit seconds and the bitwise engine comparison against that independent export
    (collective).  The dense refit timed is gather + convert (every rank) + hand-over and load into
    scratch copies next to the engine (an FP8 engine quantizing it); the comparison itself is not
    counted (a real dense refit into vLLM goes through its loaders, slower than a copy: the
    reference errs in dense's favour)."""
    t0 = time.perf_counter()
    dense = dense_export(trainer.chunks, trainer.dims, dst=starter)
    export_s = time.perf_counter() - t0
    if handle is None:
        return export_s, None
    load_s, same = handle.compare(dense)
    return export_s + load_s, same


def _gather_loss(loss: float | None) -> float | None:
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(loss, out, dst=0)
    return None if out is None else next((x for x in out if x is not None), None)


def train_step(trainer, refit: DeltaRefit, handle, starter: int):
    """Rollouts from the engine, broadcast, policy-gradient step, refit; returns stats."""
    box = [handle.rollout() if handle is not None else None]
    dist.broadcast_object_list(box, src=starter)  # the rollout batch (demo data, not the refit)
    batch = box[0]
    loss = policy_gradient_backward(trainer.chunks[0], batch.tokens, batch.weights, trainer.dims.hidden_size)
    trainer.optimizer.step()
    # Pipeline stages finish their step at different times: the refit (and the dense refit timed
    # after it) start together, so the refit's phase times measure the refit, not the stage skew.
    dist.barrier()
    report = refit.step()
    return batch, _gather_loss(loss), report


def _start(cfg, starter: int, rl_cfg):
    """Initial weights on disk, the engine started, the trainer built, the refit attached
    (collective); returns ``(trainer, refit, handle or None, attach report, engine description)``."""
    from nemo_dcr.codec.auth import read_key_file
    from nemo_dcr.tools.demo.engines import ColocatedEngine, SeparateEngine, remove_initial_weights, write_initial_weights

    me, world = dist.get_rank(), dist.get_world_size()
    init_dir = Path(cfg.run.run_dir) / ".init"
    if me == starter:
        write_initial_weights(init_dir)
    dist.barrier()
    hf_dir, key = init_dir / "hf", read_key_file(cfg.dcr.key_file) if cfg.dcr.key_file else None
    separate = cfg.engine.placement == "separate"
    handle = None
    if me == starter:
        handle = (SeparateEngine(cfg.engine.kind, hf_dir, init_dir, world, key, rl_cfg, cfg.trainer.seed, cfg.dcr)
                  if separate else ColocatedEngine(hf_dir, key, rl_cfg, cfg.trainer.seed, cfg.dcr))
    t = cfg.trainer
    trainer = build_trainer(t.model, t.tp, t.pp, str(hf_dir), t.lr, t.weight_decay)
    wiring = None
    if separate:
        from nemo_dcr.tools.demo.engine_process import refit_group
        from nemo_dcr.refit import engine_wiring

        wiring = engine_wiring(refit_group(init_dir, me, world), range(world), [world])
    hosted = handle.engine if handle is not None and not separate else None
    refit = DeltaRefit.from_config(cfg.dcr, trainer.chunks, engine=hosted, engine_rank=starter, wiring=wiring,
                                   key=key, vocab_size=trainer.dims.vocab_size)
    described = handle.wait_ready() if handle is not None else ""
    dist.barrier()  # every rank and the engine loaded the initial weights: remove them
    if me == starter:
        remove_initial_weights(init_dir)
    return trainer, refit, handle, refit.attach(), described


def run(cfg) -> dict | None:
    """The whole recipe; returns the summary on the engine's rank (None elsewhere)."""
    dist.init_process_group("gloo")
    starter = cfg.engine.rank
    is_starter = dist.get_rank() == starter
    Path(cfg.run.run_dir).mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    t = cfg.trainer
    rl_cfg = rl_config(cfg.task, cfg.engine, t.seed)
    hosts = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    trainer, refit, handle, init, described = _start(cfg, starter, rl_cfg)
    if is_starter:
        _log(f"ready in {time.perf_counter() - t0:.1f}s: tp={t.tp} pp={t.pp}, engine {described} next to rank "
             f"{starter}, transport {cfg.dcr.transport}; attach: "
             f"{'resync' if init.resynced else 'engine already identical'}, {init.payload_bytes / 1e6:.2f} MB, "
             f"{init.times[TOTAL]:.2f}s")
    telemetry = TelemetryWriter(cfg.dcr.telemetry_dir or cfg.run.run_dir) if is_starter else None
    torch.manual_seed(t.seed)
    steps = []
    for step in range(1, cfg.run.steps + 1):
        batch, loss, report = train_step(trainer, refit, handle, starter)
        every = cfg.run.dense_compare_interval
        dense_s, same = dense_check(trainer, handle, starter) if every and step % every == 0 else (None, None)
        if is_starter:
            rec = step_record(step, report, reward=batch.reward_mean, shaped_reward=batch.shaped_reward_mean,
                              loss=loss, rollout_version=batch.version, bit_exact=same, dense_refit_s=dense_s)
            telemetry.write(rec)
            steps.append(rec)
            _log(progress_line(rec, cfg.run.steps))
    if is_starter:
        handle.stop_server(refit.wiring.transport)
    refit.close()
    if is_starter:
        handle.close()
        (Path(cfg.run.run_dir) / "config.yaml").write_text(to_yaml(cfg))
        return dict(summarize(cfg, steps, init, time.perf_counter() - t0), nodes=len(set(hosts)))
    return None


def progress_line(rec: dict, steps: int) -> str:
    """One human line per step."""
    enc = {k: v for k, v in rec["bytes"].items() if k != "dense"}
    sizes = " ".join(f"{k}={v / 1e6:.2f}MB" for k, v in sorted(enc.items()))
    exact = {True: "bit-exact", False: "MISMATCH", None: "unchecked"}[rec["bit_exact"]]
    return (f"step {rec['step']}/{steps}: reward {rec['reward']:.3f} loss {rec['loss']:+.4f} "
            f"{rec['mode']} density {rec['density']:.3%} {sizes} (dense "
            f"{rec['bytes']['dense'] / 1e6:.0f}MB) refit {rec['times'].get(TOTAL, 0):.2f}s "
            f"vs dense {rec['dense_refit_s'] or 0:.2f}s ({_ratio(rec['times'].get(TOTAL), rec['dense_refit_s'])}) "
            f"{exact}{_fp8_line(rec)}")


def _fp8_line(rec: dict) -> str:
    f = rec.get("engine_format") or {}
    if rec.get("fp8_density") is None:
        return ""
    bf16 = _mb(f, "bf16_delta_bytes")
    return (f"; FP8 density {rec['fp8_density']:.3%} scale changes {f['scale_changes']}/{f['fp8_blocks']} "
            f"(sent {rec['payload_bytes'] / 1e6:.2f}MB vs BF16 delta {bf16}, FP8 dense "
            f"{rec['bytes']['dense'] / 1e6:.1f}MB; FP8 weights alone {_mb(f, 'fp8_weights_delta_bytes')} vs "
            f"BF16 {_mb(f, 'bf16_weights_delta_bytes')})")


def _mb(f: dict, key: str) -> str:
    return f"{f[key] / 1e6:.3f}MB" if key in f else "-"


def _ratio(delta: float | None, dense: float | None) -> str:
    return f"{delta / dense:.2f}x" if delta is not None and dense else "no dense reference"


def summarize(cfg, steps: list[dict], init, seconds: float) -> dict:
    """The summary JSON (see docs/recipes.md)."""
    def mean(xs):
        xs = [x for x in xs if x is not None]
        return sum(xs) / len(xs) if xs else None

    t = cfg.trainer
    delta_s, dense_s = mean(s["times"].get(TOTAL) for s in steps), mean(s["dense_refit_s"] for s in steps)
    return {
        "steps": len(steps), "trainer_layout": {"tp": t.tp, "pp": t.pp, "ep": t.ep, "dp": 1},
        "engine": cfg.engine.kind, "engine_placement": cfg.engine.placement, "model": t.model,
        "encoding": cfg.dcr.encoding,
        "transport": cfg.dcr.transport,
        "reward_first": steps[0]["reward"], "reward_last": steps[-1]["reward"],
        "reward_mean": mean(s["reward"] for s in steps),
        "density_mean": mean(s["density"] for s in steps),
        "delta_bytes_total": sum(s["payload_bytes"] for s in steps),
        "dense_bytes_total": sum(s["bytes"]["dense"] for s in steps),
        "bytes_by_encoding_total": {k: sum(s["bytes"].get(k, 0) for s in steps)
                                    for k in steps[0]["bytes"]},
        "bit_exact_steps": sum(1 for s in steps if s["bit_exact"]),
        "checked_steps": sum(1 for s in steps if s["bit_exact"] is not None),
        "refit_seconds_delta": delta_s, "refit_seconds_dense": dense_s,
        "refit_ratio_delta_over_dense": delta_s / dense_s if delta_s is not None and dense_s else None,
        "attach_seconds": init.times[TOTAL], "attach_payload_bytes": init.payload_bytes,
        "attach_resynced": init.resynced,
        "phase_seconds_mean": {k: mean(s["times"].get(k) for s in steps)
                               for k in steps[0]["times"]},
        "modes": [s["mode"] for s in steps], "wall_seconds": seconds,
        "engine_weights": cfg.engine.weights, **_fp8_summary(steps),
    }


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


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TQDM_DISABLE", "1")  # GGUF conversion progress bars
    cfg = load_config(args.config, args.overrides)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    summary = run(cfg)
    if summary is not None:
        out = Path(args.summary_json or Path(cfg.run.run_dir) / "summary.json")
        text = json.dumps(summary, indent=1) + "\n"
        atomic_write({out: lambda f: f.write(text.encode())})
        _log(f"summary: {out}")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
