"""vLLM refit benchmark (CPU): sparse delta refit vs dense ``load_weights`` on the same engine, one run.

Usage:
    python benchmarks/vllm_refit.py [RUN_DIR] [--reps N] [--tokens T] [--no-stock] [--json OUT]

RUN_DIR holds real RL step checkpoints ``step_0`` and ``step_1`` (generated with
``nemo-dcr make-deltas --steps 1 --lr 3e-6 --out RUN_DIR`` when missing).  One vLLM engine
(SmolLM2-135M, TP=1, in-process, with the nemo_dcr worker extension) is started on ``step_0``;
then, N times: a dense refit to the step the engine holds (vLLM's ``load_weights`` from the
safetensors file, page-cached) and a delta refit to the other step (``step_0 -> step_1``, then
back: trainer-side encode with the per-rank fanout, then the engine's two-phase apply).  Printed, all measured in this run:

* the vLLM params the placement found (names and shapes, one row per pattern), aliases, packs;
* seconds of each phase (best and median of N) and the ratios delta/dense;
* after the last refit: every param equal to a fresh engine loaded from the step it holds, greedy
  tokens identical, checksums equal to the trainer's;
* generation time with linears run unpacked (the CPU patch) and, in a separate process, of
  stock vLLM (packed oneDNN/SGL linears) on the same prompts, whether the tokens agree, and what
  packing every linear weight again costs (the alternative to running unpacked).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPTS = [[1, 504, 3458, 314, 260, 1345, 282], [1, 9690, 28, 1288, 346, 2], [1, 216, 13, 216, 35, 1007]]
ARGS = dict(skip_tokenizer_init=True, max_num_seqs=8, max_model_len=512,
            hf_overrides={"architectures": ["LlamaForCausalLM"]})
KEY = b"vllm-benchmark-key-0123456789abc"


def ensure_steps(run: Path) -> tuple[Path, Path]:
    if not (run / "step_1" / "model.safetensors").is_file():
        subprocess.run([sys.executable, "-m", "nemo_dcr.tools.cli", "make-deltas", "--steps", "1", "--lr", "3e-6",
                        "--out", str(run)], check=True)
    return run / "step_0", run / "step_1"


def placement_table(engine) -> list[str]:
    """One row per (canonical pattern -> vLLM param pattern) with shapes; layer indices folded."""
    rows = {}
    for name, p in engine.placement()[0].items():
        key = (re.sub(r"\.\d+\.", ".N.", name), re.sub(r"\.\d+\.", ".N.", p["param"]))
        rows.setdefault(key, (p["shape"], p["param_shape"], len(p["canon"]), 0))
        s, ps, runs, n = rows[key]
        rows[key] = (s, ps, runs, n + 1)
    return [f"  {c:44s} {str(s):13s} -> {v:40s} {str(ps):13s} runs={r} x{n}"
            for (c, v), (s, ps, r, n) in sorted(rows.items())]


def timed_generation(generate, tokens: int, reps: int = 3) -> tuple[list[list[int]], float]:
    """Greedy tokens of :data:`PROMPTS` and the best seconds of generating ``tokens`` for 4x them."""
    generate(PROMPTS, 2)  # warm-up
    secs = []
    for _ in range(reps):
        t0 = time.perf_counter()
        generate(PROMPTS * 4, tokens)
        secs.append(time.perf_counter() - t0)
    return generate(PROMPTS, tokens), min(secs)


def repack_seconds(step: Path) -> tuple[float, int]:
    """Seconds vLLM's CPU dispatch takes to pack every 2-D linear weight of the checkpoint again
    (what re-packing the layers a refit touched would cost instead of running them unpacked)."""
    from types import SimpleNamespace

    import torch
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    from nemo_dcr.checkpoint import load_checkpoint

    weights = [w for n, w in load_checkpoint(step).items() if w.ndim == 2 and "embed" not in n]
    t0 = time.perf_counter()
    for w in weights:
        layer = SimpleNamespace(weight=torch.nn.Parameter(w, requires_grad=False), bias=None)
        dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
    return time.perf_counter() - t0, len(weights)


def stock_generation(step: Path, tokens: int) -> dict:
    """Stock vLLM (no extension, packed linears); run in a child process of this script."""
    import os

    from nemo_dcr.integrations.vllm.engine import CPU_ENV

    for k, v in CPU_ENV.items():
        os.environ.setdefault(k, v)
    import vllm
    from vllm.inputs import TokensPrompt

    llm = vllm.LLM(model=str(step), dtype="bfloat16", enforce_eager=True, **ARGS)

    def generate(ps, n):
        params = vllm.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ps], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    toks, secs = timed_generation(generate, tokens)
    repack, linears = repack_seconds(step)
    return dict(tokens=toks, seconds=secs, repack_seconds=repack, linears=linears)


def _index_moved(worker) -> None:
    """On an engine rank: wait for the kept class indexes' move behind the last commit."""
    worker.dcr_engine.indexes  # noqa: B018 -- the property waits for the move


def refits(engine, w0, w1, step0: Path, step1: Path, reps: int) -> dict:
    """N x (dense refit to the step the engine holds, delta refit to the other step); phase seconds
    per repetition.  The deltas alternate step_0 -> step_1 -> step_0 ..., so that a delta starts
    from what the previous refit left, as in an RL loop: a dense load of the same bits keeps the
    engine's kept indexes, while a dense load of other bits drops them and the next delta would
    pay their rebuild, a cost an RL loop's deltas do not have.  The delta's apply includes each
    rank's index move, which runs behind its commit (in a job, beside generation), so the next
    dense load does not wait for it."""
    from nemo_dcr.apply import apply_version
    from nemo_dcr.codec import Identity, diff_tensors
    from nemo_dcr.refit.fanout import Fanout
    from nemo_dcr.refit.mirror import SenderMirror

    mirror = SenderMirror({n: ("bf16", tuple(t.shape)) for n, t in w0.items()})
    fanout = Fanout(engine.routes(), mirror)
    out = {k: [] for k in ("dense_load", "dense_total", "diff", "encode", "apply", "apply_rank")}
    steps, weights = (step0, step1), (w0, w1)
    for i in range(reps):
        held, target = weights[i % 2], weights[(i + 1) % 2]
        v = engine.version + 1
        t0 = time.perf_counter()
        engine.load_weights(str(steps[i % 2]), v)
        out["dense_total"].append(time.perf_counter() - t0)
        out["dense_load"].append(engine.last_dense[0]["load_seconds"])
        mirror.reset(held, v)
        t0 = time.perf_counter()
        deltas = mirror.changes(diff_tensors(held, target))
        t1 = time.perf_counter()
        parts = fanout.encode(deltas, Identity(base_version=v, target_version=v + 1), "dcr", KEY, 1 << 22)
        t2 = time.perf_counter()
        result = apply_version(engine, parts)
        engine.llm.collective_rpc(_index_moved)  # the move behind the commit is the delta's, not the next dense load's
        t3 = time.perf_counter()
        out["diff"].append(t1 - t0)
        out["encode"].append(t2 - t1)
        out["apply"].append(t3 - t2)
        out["apply_rank"].append(engine.last_apply[0]["seconds"])
        out["changed"] = sum(result.touched.values())
        out["payload_bytes"] = sum(len(p) for ps in parts.values() for p in ps)
    out["held"] = reps % 2  # the step the engine holds after the last delta
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", nargs="?", default="runs/vllm_bench")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--no-stock", action="store_true")
    ap.add_argument("--stock-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json")
    a = ap.parse_args()
    step0, step1 = ensure_steps(Path(a.run))
    if a.stock_child:
        print(json.dumps(stock_generation(step0, a.tokens)))
        return
    report = run_all(a, step0, step1)
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=2))


def run_all(a, step0: Path, step1: Path) -> dict:
    from nemo_dcr.checkpoint import load_checkpoint
    from nemo_dcr.integrations.vllm.engine import VllmEngine
    from nemo_dcr.integrations.vllm.verify import engine_state, state_differences
    from nemo_dcr.types import bits_view
    from nemo_dcr.verify.checksum import tensor_checksum

    w0 = {n: t.clone() for n, t in load_checkpoint(step0).items()}
    w1 = {n: t.clone() for n, t in load_checkpoint(step1).items()}
    t0 = time.perf_counter()
    engine = VllmEngine.start(str(step0), key=KEY, **ARGS)
    print(f"engine start (in-process, TP=1): {time.perf_counter() - t0:.1f} s")
    print("placement (canonical -> vLLM param):", *placement_table(engine), sep="\n")
    print("aliases:", engine.probed[0]["aliases"], " prepacked:", engine.probed[0]["packed"])
    ours0, gen_ours = timed_generation(lambda ps, n: engine.generate(ps, n, ignore_eos=True)[0], a.tokens)
    t = refits(engine, w0, w1, step0, step1, a.reps)
    model_mb = sum(x.numel() * x.element_size() for x in w0.values()) / 1e6
    print(f"\nchanged elements {t['changed']} ({100 * t['changed'] / sum(x.numel() for x in w0.values()):.2f}%), "
          f"payload {t['payload_bytes'] / 1e6:.2f} MB, dense {model_mb:.1f} MB, {a.reps} repetitions")
    print(f"{'phase':30s} {'best s':>8s} {'median s':>9s}")
    for k, label in [("dense_load", "dense: read + load_weights"), ("dense_total", "dense: + checksum rescan"),
                     ("diff", "delta: trainer diff"), ("encode", "delta: trainer encode"),
                     ("apply", "delta: engine apply (2-phase)"), ("apply_rank", "delta: rank prepare")]:
        print(f"{label:30s} {min(t[k]):8.3f} {statistics.median(t[k]):9.3f}")
    med = {k: statistics.median(v) for k, v in t.items() if isinstance(v, list)}
    print(f"ratio engine apply / dense load_weights: {med['apply'] / med['dense_load']:.3f}")
    print(f"ratio (encode + apply) / dense load_weights: {(med['encode'] + med['apply']) / med['dense_load']:.3f}")
    last, last_dir = (w0, step0) if t["held"] == 0 else (w1, step1)
    ok_ck = engine.checksums().canonical == {n: tensor_checksum(bits_view(x)) for n, x in last.items()} \
        == engine.checksums(True).canonical
    refit, ours1 = engine_state(engine.llm), engine.generate(PROMPTS, a.tokens)[0]
    engine.close()
    with VllmEngine.start(str(last_dir), key=KEY, **ARGS) as fresh:
        diffs = [str(d) for d in state_differences(refit, engine_state(fresh.llm))]
        same_tokens = fresh.generate(PROMPTS, a.tokens)[0] == ours1
    print(f"\nafter the last delta refit: checksums = trainer's: {ok_ck}; params vs a fresh engine on step_{t['held']}: "
          f"{'identical' if not diffs else diffs[:5]} ({len(refit[0])} params, buffers, attributes); greedy tokens identical: {same_tokens}")
    report = dict(timings=t, checksums_ok=ok_ck, state_differences=diffs, tokens_identical=same_tokens,
                  generation=dict(unpacked_seconds=gen_ours, tokens=ours0))
    print(f"generation {len(PROMPTS) * 4} prompts x {a.tokens} tokens (best of 3), linears unpacked (F.linear): "
          f"{gen_ours:.2f} s")
    if not a.no_stock:
        child = subprocess.run([sys.executable, __file__, str(Path(a.run)), "--stock-child", "--tokens", str(a.tokens)],
                               capture_output=True, text=True, check=True)
        stock = json.loads(child.stdout.strip().splitlines()[-1])
        print(f"generation, stock vLLM (packed linears, separate process): {stock['seconds']:.2f} s; "
              f"unpacked / stock: {gen_ours / stock['seconds']:.2f}x; "
              f"greedy tokens on step_0 identical to stock: {stock['tokens'] == ours0}")
        print(f"packing all {stock['linears']} linear weights again with vLLM's CPU dispatch: "
              f"{stock['repack_seconds']:.3f} s")
        report["generation"]["stock"] = stock
    return report


if __name__ == "__main__":
    main()
