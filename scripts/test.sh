#!/usr/bin/env bash
# Run the test suite in the project's .venv (created on first use). Extra args go to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup_env.sh"
cd "$root"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "$root/.venv/bin/python" -m pytest -q -p no:cacheprovider "$@"
