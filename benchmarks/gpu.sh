#!/usr/bin/env bash
# The GPU path in one run (benchmarks/gpu.py): one refit of real-shaped bf16 tensors through the engine path,
# bytes across PCIe per changed element, scan and apply against a dense refit, bit-exactness.
# Usage: benchmarks/gpu.sh [--device cuda|cpu] [--json OUT] [gpu.py options]; cuda: < 8 minutes on one H200 (2 GB),
# cpu: < 5 minutes (the same device code on host tensors; what CI runs). Needs torch, numpy, numba, zstandard.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
device=cuda
for ((i = 1; i <= $#; i++)); do
  if [[ "${!i}" == "--device" ]]; then j=$((i + 1)); device="${!j}"; fi
  if [[ "${!i}" == --device=* ]]; then device="${!i#--device=}"; fi
done
if [[ "$device" == "cuda" ]]; then
  "$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device visible to torch'"
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || true
  exec timeout 470 "$PY" benchmarks/gpu.py --device cuda "$@"
fi
exec timeout 290 "$PY" benchmarks/gpu.py "$@"
