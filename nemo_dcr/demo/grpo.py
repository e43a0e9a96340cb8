"""GRPO with a bit-exact delta refit after every step, on CPU (torchrun worker).

Trainer: the embedded SmolLM2-135M-Instruct in megatron-core (TP x PP ranks on gloo, fp32
master AdamW).  Engine: a transformers model on ``engine.rank`` producing sampled rollouts for
arithmetic prompts (exact-answer reward).  Each step: rollouts -> group-relative advantages ->
policy-gradient step -> :meth:`nemo_dcr.hook.DeltaRefit.step` -> the engine checked bitwise
against an independent dense export, and a dense refit of the same weights timed::

    torchrun --nproc-per-node 6 -m nemo_dcr.demo.grpo \
        --config configs/grpo_smollm2_cpu.yaml run.steps=3

Rank ``engine.rank`` prints one progress line per step, writes ``telemetry.jsonl`` and
``summary.json`` (or ``--summary-json``) into ``run.run_dir``.
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

from nemo_dcr.demo.rollout import rl_config, rollout
from nemo_dcr.demo.trainer import build_trainer, policy_gradient_backward
from nemo_dcr.config import load_config, to_yaml
from nemo_dcr.hook import DeltaRefit
from nemo_dcr.telemetry import TelemetryWriter, step_record
from nemo_dcr.types import int_view


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=None, help="recipe YAML (default: schema defaults)")
    p.add_argument("--summary-json", default=None, help="summary path (default run_dir/summary.json)")
    p.add_argument("--hf-state", default=None, help="fp32 HF state dict (made from the GGUF if absent)")
    p.add_argument("overrides", nargs="*", help="dotted.key=value config overrides")
    return p.parse_args(argv)


def _log(msg: str) -> None:
    print(f"[grpo] {msg}", flush=True)


def prepare(cfg, hf_state: str | None, is_engine: bool):
    """Engine rank: load the embedded model + tokenizer and save the HF state the trainer loads."""
    from nemo_dcr.integrations.hf.model import load_embedded_model, load_embedded_tokenizer
    from nemo_dcr.integrations.hf.engine import HFEngine

    path = hf_state or str(Path(cfg.run.run_dir) / "hf_state.pt")
    engine = tokenizer = None
    if is_engine:
        model = load_embedded_model(torch.float32)
        if not os.path.exists(path):
            torch.save({k: v.contiguous() for k, v in model.state_dict().items()}, path)
        tokenizer = load_embedded_tokenizer()
        engine = HFEngine(model, torch.bfloat16)
    dist.barrier()
    return path, engine, tokenizer


def dense_check(refit: DeltaRefit, engine) -> tuple[float, bool | None]:
    """Dense refit timing (export + load into scratch) and the bitwise engine comparison."""
    t0 = time.perf_counter()
    dense = refit.shard.dense_export()
    if engine is None:
        return 0.0, None
    for name, t in dense.items():
        torch.empty_like(engine.tensors[name]).copy_(t)
    seconds = time.perf_counter() - t0
    live = engine.tensors
    same = set(dense) == set(live) and all(
        torch.equal(int_view(live[n]), int_view(t)) for n, t in dense.items())
    return seconds, same


def _gather_loss(loss: float | None) -> float | None:
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(loss, out, dst=0)
    return None if out is None else next((x for x in out if x is not None), None)


def train_step(trainer, refit: DeltaRefit, engine, tokenizer, rng, rl_cfg):
    """Rollouts on the engine rank, broadcast, policy-gradient step, refit; returns stats."""
    box = [None]
    if engine is not None:
        box[0] = rollout(engine, tokenizer, rng, rl_cfg)
    dist.broadcast_object_list(box, src=refit.engine_rank)
    batch = box[0]
    loss = policy_gradient_backward(trainer.chunks[0], batch.tokens, batch.weights,
                                    trainer.preset.hidden)
    trainer.optimizer.step()
    report = refit.step()
    return batch, _gather_loss(loss), report


def run(cfg, hf_state: str | None) -> dict | None:
    """The whole recipe; returns the summary on the engine rank (None elsewhere)."""
    dist.init_process_group("gloo")
    is_engine = dist.get_rank() == cfg.engine.rank
    Path(cfg.run.run_dir).mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    path, engine, tokenizer = prepare(cfg, hf_state, is_engine)
    t = cfg.trainer
    trainer = build_trainer(t.model, t.tp, t.pp, path, t.lr, t.weight_decay)
    refit = DeltaRefit.from_config(cfg.dcr, trainer.chunks, engine=engine, preset=trainer.preset,
                                   engine_rank=cfg.engine.rank)
    init = refit.initial_sync()
    if is_engine:
        _log(f"ready in {time.perf_counter() - t0:.1f}s: tp={t.tp} pp={t.pp}, engine hf on rank "
             f"{cfg.engine.rank}, initial dense refit {init.times['total']:.2f}s")
    telemetry = TelemetryWriter(cfg.dcr.telemetry_dir or cfg.run.run_dir) if is_engine else None
    rng, rl_cfg = random.Random(t.seed), rl_config(cfg.task, cfg.engine, t.seed)
    torch.manual_seed(t.seed)
    steps = []
    for step in range(1, cfg.run.steps + 1):
        batch, loss, report = train_step(trainer, refit, engine, tokenizer, rng, rl_cfg)
        every = cfg.run.dense_compare_interval
        dense_s, same = dense_check(refit, engine) if every and step % every == 0 else (None, None)
        if is_engine:
            rec = step_record(step, report, reward=batch.reward_mean,
                              shaped_reward=batch.shaped_reward_mean, loss=loss,
                              rollout_version=batch.version, bit_exact=same, dense_refit_s=dense_s)
            telemetry.write(rec)
            steps.append(rec)
            _log(progress_line(rec, cfg.run.steps))
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
            f"vs dense {rec['dense_refit_s'] or 0:.2f}s {exact}")


def summarize(cfg, steps: list[dict], init, seconds: float) -> dict:
    """The summary JSON (see docs/recipes.md)."""
    def mean(xs):
        xs = [x for x in xs if x is not None]
        return sum(xs) / len(xs) if xs else None

    t = cfg.trainer
    return {
        "steps": len(steps), "trainer_layout": {"tp": t.tp, "pp": t.pp, "ep": t.ep, "dp": 1},
        "engine": cfg.engine.kind, "model": t.model, "encoding": cfg.dcr.encoding,
        "reward_first": steps[0]["reward"], "reward_last": steps[-1]["reward"],
        "reward_mean": mean(s["reward"] for s in steps),
        "density_mean": mean(s["density"] for s in steps),
        "delta_bytes_total": sum(s["payload_bytes"] for s in steps),
        "dense_bytes_total": sum(s["bytes"]["dense"] for s in steps),
        "bytes_by_encoding_total": {k: sum(s["bytes"].get(k, 0) for s in steps)
                                    for k in steps[0]["bytes"]},
        "bit_exact_steps": sum(1 for s in steps if s["bit_exact"]),
        "checked_steps": sum(1 for s in steps if s["bit_exact"] is not None),
        "refit_seconds_delta": mean(s["times"].get("total") for s in steps),
        "refit_seconds_dense": mean(s["dense_refit_s"] for s in steps),
        "refit_seconds_initial_dense": init.times["total"],
        "phase_seconds_mean": {k: mean(s["times"].get(k) for s in steps)
                               for k in steps[0]["times"]},
        "modes": [s["mode"] for s in steps], "wall_seconds": seconds,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TQDM_DISABLE", "1")  # GGUF conversion progress bars
    cfg = load_config(args.config, args.overrides)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    summary = run(cfg, args.hf_state)
    if summary is not None:
        out = Path(args.summary_json or Path(cfg.run.run_dir) / "summary.json")
        out.write_text(json.dumps(summary, indent=1) + "\n")
        _log(f"summary: {out}")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
