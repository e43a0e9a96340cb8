#!/usr/bin/env bash
# GPU kernel figures (scan, apply, dcr encode/decode, bit-exactness) in under 5 minutes.
# Needs only torch (CUDA build), numpy and zstandard; run from anywhere: benchmarks/gpu.sh [--json OUT]
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device visible to torch'"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || true
exec timeout 280 "$PY" benchmarks/gpu.py --device cuda "$@"
