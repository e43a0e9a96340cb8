"""GRPO with a bit-exact delta refit after every step, on CPU (torchrun worker).

Trainer: the embedded SmolLM2-135M-Instruct in megatron-core (TP x PP ranks on gloo, fp32
master AdamW).  Engine: a transformers model hosted by trainer rank ``engine.rank`` producing
sampled rollouts for arithmetic prompts (exact-answer reward).  Each step: rollouts ->
group-relative advantages -> policy-gradient step -> :meth:`nemo_dcr.refit.DeltaRefit.step`
(every rank encodes what it owns; payloads cross ``dcr.transport`` to the engine's server) ->
the engine checked bitwise against an independent dense export, and a dense refit of the same
weights timed::

    torchrun --nproc-per-node 6 -m nemo_dcr.demo.grpo \
        --config configs/grpo_smollm2_cpu.yaml run.steps=3

Rank ``engine.rank`` prints one progress line per step, writes ``telemetry.jsonl`` and
``summary.json`` (or ``--summary-json``) into ``run.run_dir``.  The initial weights travel to
the trainer ranks as a safetensors file under the run folder, removed once every rank loaded it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import nemo_dcr.integrations.megatron  # noqa: F401  (registers the megatron-core trainer source)
from nemo_dcr.config import load_config, to_yaml
from nemo_dcr.demo.rollout import rl_config, rollout
from nemo_dcr.demo.trainer import build_trainer, policy_gradient_backward
from nemo_dcr.integrations.megatron.params import dense_export
from nemo_dcr.refit import DeltaRefit
from nemo_dcr.telemetry import TelemetryWriter, step_record
from nemo_dcr.types import int_view


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=None, help="recipe YAML (default: schema defaults)")
    p.add_argument("--summary-json", default=None, help="summary path (default run_dir/summary.json)")
    p.add_argument("overrides", nargs="*", help="dotted.key=value config overrides")
    return p.parse_args(argv)


def _log(msg: str) -> None:
    print(f"[grpo] {msg}", flush=True)


def prepare(cfg, is_engine: bool):
    """Engine rank: load the embedded model + tokenizer and hand the initial weights over as safetensors."""
    from nemo_dcr.integrations.hf.engine import HFEngine
    from nemo_dcr.integrations.hf.model import load_embedded_model, load_embedded_tokenizer

    path = Path(cfg.run.run_dir) / ".init" / "model.safetensors"
    engine = tokenizer = None
    if is_engine:
        model = load_embedded_model(torch.float32)
        path.parent.mkdir(parents=True, exist_ok=True)
        from nemo_dcr.checkpoint import save_checkpoint

        save_checkpoint({k: v.detach().contiguous() for k, v in model.state_dict().items()}, path)
        tokenizer = load_embedded_tokenizer()
        engine = HFEngine(model, torch.bfloat16)
    dist.barrier()
    return path, engine, tokenizer


def dense_check(trainer, engine, engine_rank: int) -> tuple[float, bool | None]:
    """Dense refit timing (gather + convert + load into scratch) and the bitwise engine
    comparison against that independent export (collective)."""
    t0 = time.perf_counter()
    dense = dense_export(trainer.chunks, trainer.dims, dst=engine_rank)
    if engine is None:
        return 0.0, None
    for name, t in dense.items():
        torch.empty_like(engine.tensors[name]).copy_(t)
    seconds = time.perf_counter() - t0
    live = engine.tensors
    same = set(dense) == set(live) and all(torch.equal(int_view(live[n]), int_view(t)) for n, t in dense.items())
    return seconds, same


def _gather_loss(loss: float | None) -> float | None:
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(loss, out, dst=0)
    return None if out is None else next((x for x in out if x is not None), None)


def train_step(trainer, refit: DeltaRefit, engine, tokenizer, rng, rl_cfg, engine_rank: int):
    """Rollouts on the engine rank, broadcast, policy-gradient step, refit; returns stats."""
    box = [None]
    if engine is not None:
        box[0] = rollout(engine, tokenizer, rng, rl_cfg)
    dist.broadcast_object_list(box, src=engine_rank)  # the rollout batch (demo data, not the refit)
    batch = box[0]
    loss = policy_gradient_backward(trainer.chunks[0], batch.tokens, batch.weights, trainer.dims.hidden_size)
    trainer.optimizer.step()
    report = refit.step()
    return batch, _gather_loss(loss), report


def _load_trainer(cfg, path: Path, is_engine: bool):
    t = cfg.trainer
    trainer = build_trainer(t.model, t.tp, t.pp, str(path), t.lr, t.weight_decay)
    dist.barrier()  # every rank loaded the initial weights: remove them
    if is_engine:
        path.unlink()
        path.parent.rmdir()
    return trainer


def run(cfg) -> dict | None:
    """The whole recipe; returns the summary on the engine rank (None elsewhere)."""
    dist.init_process_group("gloo")
    rank = cfg.engine.rank
    is_engine = dist.get_rank() == rank
    Path(cfg.run.run_dir).mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    path, engine, tokenizer = prepare(cfg, is_engine)
    trainer = _load_trainer(cfg, path, is_engine)
    refit = DeltaRefit.from_config(cfg.dcr, trainer.chunks, engine=engine, engine_rank=rank)
    init = refit.attach()
    t = cfg.trainer
    if is_engine:
        _log(f"ready in {time.perf_counter() - t0:.1f}s: tp={t.tp} pp={t.pp}, hf engine hosted by rank {rank}, "
             f"transport {cfg.dcr.transport}; attach: {'resync' if init.resynced else 'engine already identical'}, "
             f"{init.payload_bytes / 1e6:.2f} MB, {init.times['total']:.2f}s")
    telemetry = TelemetryWriter(cfg.dcr.telemetry_dir or cfg.run.run_dir) if is_engine else None
    rng, rl_cfg = random.Random(t.seed), rl_config(cfg.task, cfg.engine, t.seed)
    torch.manual_seed(t.seed)
    steps = []
    for step in range(1, cfg.run.steps + 1):
        batch, loss, report = train_step(trainer, refit, engine, tokenizer, rng, rl_cfg, rank)
        every = cfg.run.dense_compare_interval
        dense_s, same = dense_check(trainer, engine, rank) if every and step % every == 0 else (None, None)
        if is_engine:
            rec = step_record(step, report, reward=batch.reward_mean, shaped_reward=batch.shaped_reward_mean,
                              loss=loss, rollout_version=batch.version, bit_exact=same, dense_refit_s=dense_s)
            telemetry.write(rec)
            steps.append(rec)
            _log(progress_line(rec, cfg.run.steps))
    refit.close()
    if is_engine:
        (Path(cfg.run.run_dir) / "config.yaml").write_text(to_yaml(cfg))
        return summarize(cfg, steps, init, time.perf_counter() - t0)
    return None


def progress_line(rec: dict, steps: int) -> str:
    """One human line per step."""
    enc = {k: v for k, v in rec["bytes"].items() if k != "dense"}
    sizes = " ".join(f"{k}={v / 1e6:.2f}MB" for k, v in sorted(enc.items()))
    exact = {True: "bit-exact", False: "MISMATCH", None: "unchecked"}[rec["bit_exact"]]
    return (f"step {rec['step']}/{steps}: reward {rec['reward']:.3f} loss {rec['loss']:+.4f} "
            f"{rec['mode']} density {rec['density']:.3%} {sizes} (dense "
            f"{rec['bytes']['dense'] / 1e6:.0f}MB) refit {rec['times'].get('total', 0):.2f}s "
            f"vs dense {rec['dense_refit_s'] or 0:.2f}s ({_ratio(rec['times'].get('total'), rec['dense_refit_s'])}) "
            f"{exact}")


def _ratio(delta: float | None, dense: float | None) -> str:
    return f"{delta / dense:.2f}x" if delta is not None and dense else "no dense reference"


def summarize(cfg, steps: list[dict], init, seconds: float) -> dict:
    """The summary JSON (see docs/recipes.md)."""
    def mean(xs):
        xs = [x for x in xs if x is not None]
        return sum(xs) / len(xs) if xs else None

    t = cfg.trainer
    delta_s, dense_s = mean(s["times"].get("total") for s in steps), mean(s["dense_refit_s"] for s in steps)
    return {
        "steps": len(steps), "trainer_layout": {"tp": t.tp, "pp": t.pp, "ep": t.ep, "dp": 1},
        "engine": cfg.engine.kind, "model": t.model, "encoding": cfg.dcr.encoding,
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
        "attach_seconds": init.times["total"], "attach_payload_bytes": init.payload_bytes,
        "attach_resynced": init.resynced,
        "phase_seconds_mean": {k: mean(s["times"].get(k) for s in steps)
                               for k in steps[0]["times"]},
        "modes": [s["mode"] for s in steps], "wall_seconds": seconds,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TQDM_DISABLE", "1")  # GGUF conversion progress bars
    cfg = load_config(args.config, args.overrides)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    summary = run(cfg)
    if summary is not None:
        out = Path(args.summary_json or Path(cfg.run.run_dir) / "summary.json")
        out.write_text(json.dumps(summary, indent=1) + "\n")
        _log(f"summary: {out}")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
