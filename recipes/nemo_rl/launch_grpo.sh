#!/usr/bin/env bash
# NeMo-RL's GRPO (examples/run_grpo.py) with nemo_dcr's delta refit as its checkpoint engine.
#
# It starts through nemo_dcr's driver (python -m nemo_dcr.integrations.nemo_rl.driver), which
# loads the config with NeMo-RL's own loader and override parser, refuses a NeMo-RL without the
# checkpoint-engine seam and a bad plugin key (exit 2, naming it), and only then runs
# examples/run_grpo.py in the same process, before Ray starts.  NEMO_DCR_CHECK_ONLY=1: check, exit.
#
# Needs a NeMo-RL checkout (NVIDIA-NeMo/RL at the commit docs/nemo_rl.md targets) with its own
# environment set up (uv), GPUs for a non-colocated run (NeMo-RL's checkpoint engines serve
# non-colocated vLLM only), and nemo_dcr with numba in NeMo-RL's policy and vLLM worker
# environments: recipes/nemo_rl/install_into_workers.sh (this script also puts this checkout on
# PYTHONPATH, which reaches workers started on this node, but not numba).
#
#   NEMO_RL_DIR=/path/to/RL recipes/nemo_rl/launch_grpo.sh [hydra overrides...]
#
# Environment:
#   NEMO_RL_DIR          NeMo-RL checkout (required)
#   NEMO_DCR_CONFIG      overlay (default: configs/nemo_rl/grpo_math_1B_megatron_dcr.yaml)
#   NEMO_DCR_REFIT_DIR   folder every policy and vLLM worker can read and write (default /shared/nemo_dcr/refit)
#   NEMO_DCR_KEY_FILE    HMAC key file, created with 32 random bytes if missing (default /shared/nemo_dcr/hmac.key)
#   NEMO_RL_RUN          how to run Python in NeMo-RL's environment (default: "uv run python")
set -euo pipefail
# shellcheck source=recipes/nemo_rl/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
dcr_shared_files examples/run_grpo.py
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
cd "$NEMO_RL_DIR"
# shellcheck disable=SC2086  # NEMO_RL_RUN is a command line
exec ${NEMO_RL_RUN:-uv run python} -m nemo_dcr.integrations.nemo_rl.driver \
  ${NEMO_DCR_CHECK_ONLY:+--check-only} examples/run_grpo.py --config "$config" "$@"
