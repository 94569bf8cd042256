#!/usr/bin/env bash
# Set up (or reuse) the venv, build the embedded tiny model (cached) and run the whole test suite.
#
#   bash scripts/test.sh                 # everything CI runs (~5 min on 2 cores once set up)
#   bash scripts/test.sh -m "not slow"   # extra arguments go to pytest (here: unit tests only, seconds)
#
# The Docker end-to-end test (tests/e2e/test_docker.py: image build, compose up, run, probe, down) is
# included when CI=true or FORKRL_DOCKER_TESTS=1 (root; ~4 min warm, ~8 min cold). In CI the Docker engine
# and docker-compose are installed first when missing; the test skips itself where Docker cannot run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${FORKRL_VENV:-.venv}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
[ -t 1 ] || export TQDM_MININTERVAL=${TQDM_MININTERVAL:-10}  # CI logs: a progress line every 10 s, not 10 a second
"$VENV/bin/python" -m forkrl.models.tiny build --out "${FORKRL_MODEL_DIR:-models/tiny}"

"$VENV/bin/ruff" check --quiet . || { echo "[test] ruff found problems (see above)"; exit 1; }

markers=()
if [ "${FORKRL_DOCKER_TESTS:-}" = 1 ] || { [ "${CI:-}" = true ] && [ "${FORKRL_DOCKER_TESTS:-}" != 0 ]; }; then
  if [ "${CI:-}" = true ] && [ "$(id -u)" = 0 ] && ! command -v docker-compose >/dev/null 2>&1; then
    echo "[test] installing docker.io, docker-compose and debootstrap for the Docker end-to-end test"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io docker-compose debootstrap) \
      >/tmp/forkrl-apt.log 2>&1 || echo "[test] apt-get failed (see /tmp/forkrl-apt.log); the Docker test will skip"
  fi
  markers=(-m "docker or not docker")
fi
exec "$VENV/bin/python" -m pytest tests -q "${markers[@]}" "$@"
