"""GRPO with a bit-exact delta refit after every step, on CPU (torchrun worker).

Trainer: the embedded SmolLM2-135M-Instruct in megatron-core (TP x PP ranks on gloo, fp32
master AdamW).  Engine (``engine.kind``/``engine.placement``): a vLLM engine in a process of its
own started by trainer rank ``engine.rank`` (the main job), or a transformers model in that
rank's process, producing sampled rollouts for arithmetic prompts (exact-answer reward, with a
named partial credit shaping the advantages).  Each step: rollouts -> group-relative advantages
-> policy-gradient step -> :meth:`nemo_dcr.refit.DeltaRefit.step` (every rank encodes what it owns;
payloads cross ``dcr.transport`` to the engine's server) -> the efficient dense refit of the same
weights, timed, which also checks that the engine held exactly what its own full load gives it::

    torchrun --nproc-per-node 6 -m nemo_dcr.tools.demo.grpo \
        --config configs/grpo_smollm2_cpu.yaml run.steps=3

Rank ``engine.rank`` prints the progress lines (``[demo]``, :mod:`.results`), writes
``telemetry.jsonl``, ``summary.json`` (or ``--summary-json``) and ``config.yaml`` into
``run.run_dir``.  The initial weights travel to the trainer ranks and the engine as a bf16
safetensors folder under the run folder, removed once everything loaded it.
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
from nemo_dcr.refit import DeltaRefit
from nemo_dcr.telemetry import TelemetryWriter, step_record
from nemo_dcr.tools.demo.dense_refit import METHOD, DenseLink
from nemo_dcr.tools.demo.recipe_load import load_config, to_yaml
from nemo_dcr.tools.demo.results import Progress, eta, step_line, summarize
from nemo_dcr.tools.demo.rollout import rl_config
from nemo_dcr.tools.demo.trainer import build_trainer, policy_gradient_backward


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=None, help="recipe YAML (default: schema defaults)")
    p.add_argument("--summary-json", default=None, help="summary path (default run_dir/summary.json)")
    p.add_argument("--job-start", type=float, default=None, help="job start (time.time()) for the progress stamps")
    p.add_argument("overrides", nargs="*", help="dotted.key=value config overrides")
    return p.parse_args(argv)


def dense_refit(link: DenseLink, handle, starter: int, version: int) -> tuple[float | None, bool | None, dict]:
    """The efficient dense refit of the trainer's current weights (collective over the trainer
    ranks): ``(seconds on the starting rank, the engine held what its own load gives, parts)``;
    seconds exclude only the checks around the load."""
    dist.barrier()
    t0 = time.perf_counter()
    if handle is None:  # not the starting rank: send this rank's shards unless it hosts the engine
        if link.rank != link.host:
            link.send()
        return None, None, {}
    r = handle.dense(link, version)
    seconds = time.perf_counter() - t0 - r.check_s
    return seconds, r.same, {"recv": r.recv_s, "convert": r.convert_s, "load": r.load_s, "bytes": r.bytes}


def _behind(refit: DeltaRefit, handle) -> float:
    """The longest wait, over the trainer ranks and the engine (asked by the rank holding its
    ``handle``), for the work the refit left behind its report (collective): the kept indexes'
    moves, done before the dense refit is timed, so that work does not slow the baseline."""
    waited = torch.tensor([max(refit.wait(), handle.settle() if handle is not None else 0.0)], dtype=torch.float64)
    dist.all_reduce(waited, op=dist.ReduceOp.MAX)
    return float(waited)


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


def _engine_handle(cfg, hf_dir: Path, init_dir: Path, world: int, key, rl_cfg, dims):
    from nemo_dcr.tools.demo.engines import ColocatedEngine, SeparateEngine

    if cfg.engine.placement != "separate":
        return ColocatedEngine(hf_dir, key, rl_cfg, cfg.trainer.seed, cfg.dcr)
    from nemo_dcr.tools.demo.engine_process import EngineSetup

    log = None if cfg.run.verbose else str(Path(cfg.run.run_dir).resolve() / "engine.log")
    return SeparateEngine(EngineSetup(cfg.engine.kind, str(hf_dir), str(init_dir), world, key, rl_cfg,
                                      cfg.trainer.seed, cfg.dcr, dims, log))


def _start(cfg, starter: int, rl_cfg, say: Progress):
    """Initial weights on disk, the engine started, the trainer built, the refit attached
    (collective); returns ``(trainer, refit, handle or None, dense link, attach report)``."""
    from nemo_dcr.codec.auth import read_key_file
    from nemo_dcr.layout import model_dims
    from nemo_dcr.tools.demo.engines import remove_initial_weights, write_initial_weights

    me, world = dist.get_rank(), dist.get_world_size()
    init_dir = Path(cfg.run.run_dir) / ".init"
    if me == starter:
        write_initial_weights(init_dir)
        say(f"weights: {cfg.trainer.model} written once as bf16 for the trainer ranks and the engine")
    dist.barrier()
    hf_dir, key = init_dir / "hf", read_key_file(cfg.dcr.key_file) if cfg.dcr.key_file else None
    separate = cfg.engine.placement == "separate"
    handle = _engine_handle(cfg, hf_dir, init_dir, world, key, rl_cfg, model_dims(cfg.trainer.model)) \
        if me == starter else None
    if handle is not None:
        say(f"engine: starting {handle.describe()}" + ("" if cfg.run.verbose or not separate else
                                                       f" (its output: {cfg.run.run_dir}/engine.log)"))
    t = cfg.trainer
    trainer = build_trainer(t.model, t.tp, t.pp, str(hf_dir), t.lr, t.weight_decay)
    dist.barrier()
    say(f"trainer: megatron-core GPTModel shards built and loaded on {world} gloo ranks (TP={t.tp} PP={t.pp})")
    wiring, link = None, None
    if separate:
        from nemo_dcr.refit import engine_wiring
        from nemo_dcr.tools.demo.engine_process import dense_link, refit_group

        wiring = engine_wiring(refit_group(init_dir, me, world), range(world), [world])
        link = dense_link(init_dir, me, world, trainer.chunks, trainer.dims)
    else:
        link = DenseLink(dist.new_group(backend="gloo"), me, starter, world, trainer.chunks, trainer.dims)
    hosted = handle.engine if handle is not None and not separate else None
    refit = DeltaRefit.from_config(cfg.dcr, trainer.chunks, engine=hosted, engine_rank=starter, wiring=wiring,
                                   key=key, vocab_size=trainer.dims.vocab_size)
    if handle is not None:
        up = handle.wait_ready()
        say("engine: ready (" + ", ".join(f"{k} {v:.1f} s" for k, v in up.items()) + ")")
    dist.barrier()  # every rank and the engine loaded the initial weights: remove them
    if me == starter:
        remove_initial_weights(init_dir)
    init = refit.attach()
    top = sorted(((v, k) for k, v in init.times.items() if not k.startswith("total")), reverse=True)[:4]
    say(f"first sync: {'resync' if init.resynced else 'the engine already holds the trainer weights'} "
        f"(checksums of {len(refit.source.canonical)} tensors compared), {init.payload_bytes / 1e6:.2f} MB sent, "
        f"{init.times['total']:.1f} s (" + ", ".join(f"{k} {v:.1f} s" for v, k in top) + ")")
    return trainer, refit, handle, link, init


def _steps(cfg, trainer, refit, handle, link, starter, telemetry, steps: list[dict], say, loop0: float) -> None:
    """The GRPO steps: train, delta refit, and (every ``dense_compare_interval``) the dense refit."""
    is_starter = dist.get_rank() == starter
    for step in range(1, cfg.run.steps + 1):
        batch, loss, report = train_step(trainer, refit, handle, starter)
        behind = _behind(refit, handle)
        every = cfg.run.dense_compare_interval
        dense_s, same, parts = dense_refit(link, handle, starter, report.version) \
            if every and step % every == 0 else (None, None, {})
        if is_starter:
            rec = step_record(step, report, reward=batch.reward_mean, shaped_reward=batch.shaped_reward_mean,
                              loss=loss, rollout_version=batch.version, bit_exact=same, dense_refit_s=dense_s)
            telemetry.write(rec)
            steps.append(dict(rec, encoding=cfg.dcr.encoding, dense_parts=parts, behind_s=behind))
            per_step = (time.perf_counter() - loop0) / step
            say(step_line(steps[-1], cfg.run.steps, eta(step, cfg.run.steps, per_step)))


def run(cfg, start: float) -> dict | None:
    """The whole recipe; returns the summary on the engine's rank (None elsewhere)."""
    dist.init_process_group("gloo")
    starter = cfg.engine.rank
    is_starter = dist.get_rank() == starter
    say = Progress(start, is_starter)
    Path(cfg.run.run_dir).mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    t, task = cfg.trainer, cfg.task
    rl_cfg = rl_config(task, cfg.engine, t.seed)
    hosts = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    trainer, refit, handle, link, init = _start(cfg, starter, rl_cfg, say)
    say(f"{cfg.run.steps} GRPO steps: {task.prompts_per_step} single-digit arithmetic prompts x {task.group_size} "
        f"samples each, lr {t.lr:g}; per step a {cfg.dcr.encoding} delta refit, then an efficient dense refit "
        "of the same weights timed and compared")
    telemetry = TelemetryWriter(cfg.dcr.telemetry_dir or cfg.run.run_dir) if is_starter else None
    torch.manual_seed(t.seed)
    steps, loop0 = [], time.perf_counter()
    try:
        _steps(cfg, trainer, refit, handle, link, starter, telemetry, steps, say, loop0)
    except BaseException:
        if is_starter and handle.died():
            say(handle.died())
        raise
    if is_starter:
        handle.stop_server(refit.wiring.transport)
    refit.close()
    if is_starter:
        handle.close()
        (Path(cfg.run.run_dir) / "config.yaml").write_text(to_yaml(cfg))
        return dict(summarize(cfg, steps, init, time.perf_counter() - t0, METHOD), nodes=len(set(hosts)))
    return None


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TQDM_DISABLE", "1")  # GGUF conversion progress bars
    cfg = load_config(args.config, args.overrides)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    summary = run(cfg, args.job_start or time.time())
    if summary is not None:
        out = Path(args.summary_json or Path(cfg.run.run_dir) / "summary.json")
        text = json.dumps(summary, indent=1) + "\n"
        atomic_write({out: lambda f: f.write(text.encode())})
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
