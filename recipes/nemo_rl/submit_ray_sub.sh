#!/usr/bin/env bash
# Submit NeMo-RL's GRPO with nemo_dcr's refit through NeMo-RL's own Slurm launcher (ray.sub).
#
# recipes/slurm/dcr_grpo.sbatch runs this project's own loop; a NeMo-RL job starts through
# NeMo-RL's ray.sub, which brings up Ray on every node and then runs COMMAND in the head
# container.  This script, run on the submit host from anywhere:
#   1. creates the HMAC key file if missing (it and NEMO_DCR_REFIT_DIR must be on a file system
#      every node mounts at the same path);
#   2. checks the NeMo-RL seam and the plugin's settings here, with NeMo-RL's own config loader,
#      before anything is submitted (python -m nemo_dcr.integrations.nemo_rl.driver --check-only;
#      NEMO_DCR_SKIP_CHECK=1 skips it where the submit host has no NeMo-RL environment);
#   3. submits ray.sub with SETUP_COMMAND installing nemo_dcr and numba into NeMo-RL's worker
#      environments on every node (recipes/nemo_rl/install_into_workers.sh with NeMo-RL building
#      them first, NEMO_DCR_PREFETCH=1, before Ray starts) and
#      COMMAND running examples/run_grpo.py through the same driver (checked again, then run).
#
#   NEMO_RL_DIR=/path/to/RL CONTAINER=... MOUNTS=... recipes/nemo_rl/submit_ray_sub.sh \
#       --nodes=2 --account=ACCOUNT --partition=PARTITION -- grpo.max_num_steps=100
#
# Arguments before "--" go to sbatch, after it to NeMo-RL (hydra overrides).  Environment: as
# recipes/nemo_rl/launch_grpo.sh (NEMO_RL_DIR, NEMO_DCR_CONFIG, NEMO_DCR_REFIT_DIR,
# NEMO_DCR_KEY_FILE, NEMO_RL_RUN), plus ray.sub's own (CONTAINER, MOUNTS, GPUS_PER_NODE, ...),
# passed through unchanged.  The nemo_dcr checkout must be visible at the same path in the
# containers (add it to MOUNTS).
set -euo pipefail
# shellcheck source=recipes/nemo_rl/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
run="${NEMO_RL_RUN:-uv run python}"
sbatch_args=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do sbatch_args+=("$1"); shift; done
[ $# -gt 0 ] && shift
dcr_shared_files ray.sub
driver=(-m nemo_dcr.integrations.nemo_rl.driver examples/run_grpo.py --config "$config" "$@")
if [ "${NEMO_DCR_SKIP_CHECK:-0}" != 1 ]; then
  # shellcheck disable=SC2086  # NEMO_RL_RUN is a command line
  (cd "$NEMO_RL_DIR" && PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" $run "${driver[0]}" "${driver[1]}" \
    --check-only "${driver[@]:2}")
fi
quoted="$(printf ' %q' "${driver[@]}")"
export SETUP_COMMAND="${SETUP_COMMAND:+$SETUP_COMMAND; }NEMO_DCR_PREFETCH=1 NEMO_RL_DIR=$(printf %q "$NEMO_RL_DIR") \
$(printf %q "$here/recipes/nemo_rl/install_into_workers.sh")"
export COMMAND="export PYTHONPATH=$(printf %q "$here")\${PYTHONPATH:+:\$PYTHONPATH} \
NEMO_DCR_REFIT_DIR=$(printf %q "$NEMO_DCR_REFIT_DIR") NEMO_DCR_KEY_FILE=$(printf %q "$NEMO_DCR_KEY_FILE") \
NEMO_RL_DIR=$(printf %q "$NEMO_RL_DIR"); cd \"\$NEMO_RL_DIR\" && $run$quoted"
cd "$NEMO_RL_DIR"
exec sbatch "${sbatch_args[@]}" ray.sub
