#!/usr/bin/env bash
# Set up (or reuse) the venv, build the embedded tiny model (cached) and run the whole test suite.
#
#   bash scripts/test.sh                 # everything CI runs
#   bash scripts/test.sh -m "not slow"   # extra arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${FORKRL_VENV:-.venv}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
"$VENV/bin/python" -m forkrl.tiny build --out "${FORKRL_MODEL_DIR:-models/tiny}"
exec "$VENV/bin/python" -m pytest tests -q "$@"
