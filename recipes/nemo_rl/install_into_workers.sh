#!/usr/bin/env bash
# Install nemo_dcr (and numba, zstandard, safetensors) into the Python environments NeMo-RL builds
# for its workers, so the checkpoint engine imports wherever NeMo-RL creates it.
#
# NeMo-RL runs every Ray actor in its own uv environment under $NEMO_RL_VENV_DIR (default
# $NEMO_RL_DIR/venvs), one per actor class, built from its lock with one extra each (mcore, fsdp,
# automodel, vllm); numba is in the vllm extra only.  This script installs into the environments
# of the policy workers (*PolicyWorker*), of the vLLM workers (*vllm*GenerationWorker*) and into
# NeMo-RL's project environment ($NEMO_RL_DIR/.venv, where the driver runs), pinning each one's
# installed torch and numpy so nothing of NeMo-RL's changes, then imports the plugin with each.
# NeMo-RL builds an environment only where none exists (NRL_FORCE_REBUILD_VENVS=true rebuilds
# them: run this again afterwards).  With NEMO_DCR_PREFETCH=1 it first has NeMo-RL build them
# (python -m nemo_rl.utils.prefetch_venvs PolicyWorker GenerationWorker).  On several nodes with
# node-local environments run it on every node.
#
#   NEMO_RL_DIR=/path/to/RL recipes/nemo_rl/install_into_workers.sh
#
# Environment:
#   NEMO_RL_DIR        NeMo-RL checkout (required)
#   NEMO_RL_VENV_DIR   NeMo-RL's worker environments (default: $NEMO_RL_DIR/venvs)
#   NEMO_DCR_PREFETCH  1: build NeMo-RL's policy and generation worker environments first
#   NEMO_DCR_UV        the uv command (default: uv)
set -euo pipefail
: "${NEMO_RL_DIR:?set NEMO_RL_DIR to a NeMo-RL checkout (see docs/nemo_rl.md)}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
venvs="${NEMO_RL_VENV_DIR:-$NEMO_RL_DIR/venvs}"
uv="${NEMO_DCR_UV:-uv}"
deps=("numba>=0.60" "zstandard>=0.22" "safetensors>=0.6")
if [ "${NEMO_DCR_PREFETCH:-0}" = 1 ]; then
  (cd "$NEMO_RL_DIR" && $uv run python -m nemo_rl.utils.prefetch_venvs PolicyWorker GenerationWorker)
fi
pins='import importlib.metadata as m
for p in ("torch", "numpy"):
    try:
        print(f"{p}=={m.version(p)}")
    except m.PackageNotFoundError:
        pass'
install() {  # install into the environment of python $1 (named $2)
  local py="$1" name="$2"
  mapfile -t pinned < <("$py" -c "$pins")
  $uv pip install --python "$py" --no-deps "$here"
  $uv pip install --python "$py" "${pinned[@]}" "${deps[@]}"
  "$py" -c 'import sys, numba, nemo_dcr.integrations.nemo_rl as p
print(f"[nemo-dcr] {sys.argv[1]}: {p.SELECTOR} imports, numba {numba.__version__}")' "$name"
}
found=0
for py in "$venvs"/*/bin/python; do
  [ -x "$py" ] || continue
  name="$(basename "$(dirname "$(dirname "$py")")")"
  case "$name" in
    *PolicyWorker*|*[vV]llm*GenerationWorker*) install "$py" "$name"; found=$((found + 1)) ;;
  esac
done
if [ "$found" = 0 ]; then
  echo "[nemo-dcr] no policy or vLLM worker environment under $venvs: run NeMo-RL once, or set NEMO_DCR_PREFETCH=1" >&2
  exit 2
fi
if [ -x "$NEMO_RL_DIR/.venv/bin/python" ]; then
  install "$NEMO_RL_DIR/.venv/bin/python" "NeMo-RL's project environment (the driver)"
fi
echo "[nemo-dcr] installed into $found worker environment(s) under $venvs"
