#!/usr/bin/env bash
# Launch the GRPO + delta-refit recipe with torchrun.
#
# Single node (defaults):   bash recipes/launch.sh [dotted.key=value ...]
# Multi node: run once per node with the same MASTER_ADDR/MASTER_PORT/NNODES and its NODE_RANK:
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 MASTER_PORT=29500 NPROC_PER_NODE=3 bash recipes/launch.sh
#
# Environment:
#   CONFIG          recipe YAML                    (configs/grpo_smollm2_cpu.yaml)
#   NPROC_PER_NODE  ranks on this node             (6; total ranks must equal trainer.tp * trainer.pp)
#   NNODES          number of nodes                (1)
#   NODE_RANK       this node's index              (0)
#   MASTER_ADDR     address of node 0              (127.0.0.1)
#   MASTER_PORT     rendezvous port on node 0      (29500)
#   OMP_NUM_THREADS threads per rank               (1)
#   PYTHON          interpreter                    (.venv/bin/python if present, else python3)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-}"
if [ -z "$py" ]; then
  if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" TQDM_DISABLE=1 PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}"
exec "$py" -m torch.distributed.run \
  --nnodes "${NNODES:-1}" --node-rank "${NODE_RANK:-0}" \
  --nproc-per-node "${NPROC_PER_NODE:-6}" \
  --master-addr "${MASTER_ADDR:-127.0.0.1}" --master-port "${MASTER_PORT:-29500}" \
  recipes/run_grpo_dcr.py --config "${CONFIG:-configs/grpo_smollm2_cpu.yaml}" "$@"
