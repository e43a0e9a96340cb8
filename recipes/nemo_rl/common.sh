# Sourced by launch_grpo.sh and submit_ray_sub.sh: the settings both take from the environment
# and the HMAC key file.  Sets `here` (this checkout) and `config` (the overlay), makes
# NEMO_RL_DIR absolute, exports NEMO_DCR_REFIT_DIR and NEMO_DCR_KEY_FILE with their defaults,
# creates both folders and, if missing, the key (32 random bytes, readable by its owner only).
: "${NEMO_RL_DIR:?set NEMO_RL_DIR to a NeMo-RL checkout (see docs/nemo_rl.md)}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
config="${NEMO_DCR_CONFIG:-$here/configs/nemo_rl/grpo_math_1B_megatron_dcr.yaml}"
NEMO_RL_DIR="$(cd "$NEMO_RL_DIR" && pwd)"
export NEMO_RL_DIR
export NEMO_DCR_REFIT_DIR="${NEMO_DCR_REFIT_DIR:-/shared/nemo_dcr/refit}"
export NEMO_DCR_KEY_FILE="${NEMO_DCR_KEY_FILE:-/shared/nemo_dcr/hmac.key}"

# dcr_shared_files FILE: checks that FILE is in NEMO_RL_DIR, then creates the refit folder and the key.
dcr_shared_files() {
  [ -f "$NEMO_RL_DIR/$1" ] || { echo "no $1 in $NEMO_RL_DIR" >&2; exit 2; }
  mkdir -p "$NEMO_DCR_REFIT_DIR" "$(dirname "$NEMO_DCR_KEY_FILE")"
  if [ ! -f "$NEMO_DCR_KEY_FILE" ]; then
    (umask 077 && head -c 32 /dev/urandom > "$NEMO_DCR_KEY_FILE")
    echo "[nemo-dcr] created the HMAC key $NEMO_DCR_KEY_FILE (every worker, on every node, must read the same file)" >&2
  fi
}
