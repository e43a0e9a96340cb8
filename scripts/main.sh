#!/usr/bin/env bash
# The main job on the embedded default: real RL steps on SmolLM2-135M-Instruct (fp32 master
# AdamW, bf16 checkpoints), then every step's delta encoded with `reference` and `dcr`, applied
# to a copy of the base and checked bit-exact against the target, with a summary.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup_env.sh"
cd "$root"
run="${RUN_DIR:-runs/main}"
steps="${STEPS:-3}"
if [ ! -d "$run/step_$steps" ]; then
  .venv/bin/nemo-dcr make-deltas --steps "$steps" --lr "${LR:-1e-6}" --out "$run"
fi
exec .venv/bin/python benchmarks/codec.py "$run" --json "$run/codec_summary.json"
