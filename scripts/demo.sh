#!/usr/bin/env bash
# Set up (or reuse) the venv, then run the whole loop on the embedded default (the committed tiny model in
# forkrl/models/default; nothing is built): start the three services, train with --entropy-top-frac 0.2, probe two
# checkpoints, print before/after numbers (the gain with a bootstrap 95% interval over eval prompts) and grad norms
# by entropy bin, write the training curve PNG, stop everything, and print the path of the run's HTML report
# (<run dir>/report.html: open it in a browser).
#
#   bash scripts/demo.sh                      # defaults: countdown, 200 steps (~3.5 min on 2 cores was timed with
#                                             # the removed torch backend; with vLLM: not yet re-timed)
#   bash scripts/demo.sh --seed 1             # another seed (data order, sampling, eval prompts)
#   bash scripts/demo.sh --num-steps 100      # extra arguments go to clients/demo.py
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${FORKRL_VENV:-.venv}/bin/python" clients/demo.py "$@"
