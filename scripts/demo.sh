#!/usr/bin/env bash
# Set up (or reuse) the venv, then run the whole loop on the embedded default (the committed tiny model in
# forkrl/models/default; nothing is built): start the three services, train with --entropy-top-frac 0.2, probe two
# checkpoints, print before/after numbers and grad norms by entropy bin, stop everything.
#
#   bash scripts/demo.sh                      # defaults (about 5-10 minutes on 2 cores)
#   bash scripts/demo.sh --num-steps 100      # extra arguments go to clients/demo.py
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${FORKRL_VENV:-.venv}/bin/python" clients/demo.py "$@"
