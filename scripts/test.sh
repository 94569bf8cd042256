#!/usr/bin/env bash
# Set up (or reuse) the venv and run the whole test suite. The embedded tiny model is committed
# (forkrl/models/default, the same bytes on every machine): nothing is built.
#
#   bash scripts/test.sh                       # the suite in file order (what a developer runs)
#   bash scripts/test.sh -m "not slow"         # extra arguments go to pytest (here: unit tests only, seconds)
#   FORKRL_RANDOM_ORDER=1 bash scripts/test.sh # the suite once, in a random order (what CI runs)
#
# CI (CI=true) runs the suite once, shuffled (pytest-random-order: the modules in a random order and the tests of
# each module in a random order; a test that depends on another's leftovers fails there). One pass, not a file-order
# pass and a shuffled one: a fresh order each run still finds order dependence over the runs, at half the time (the
# two passes took ~45 of CI's 90 minutes). The seed is printed; FORKRL_RANDOM_SEED=<seed> replays an order.
# The ten slowest tests are listed at the end (pytest --durations=10).
#
# The Docker end-to-end test (tests/e2e/test_docker.py: image build, compose up, run, probe, down) is
# included when CI=true or FORKRL_DOCKER_TESTS=1 (root; ~4 min warm, ~8 min cold). In CI the Docker engine
# and docker-compose are installed first when missing, and the test fails (does not skip) when Docker
# still cannot run. FORKRL_DOCKER_TESTS=0 leaves it out, also in CI.
# The browser test of the HTML reports (tests/trainer/test_report_browser.py) drives Debian's Chromium through
# Playwright (the `playwright` Python package; never its own browser download). In CI (as root) Chromium is
# installed from the OS packages when missing, and the test fails (does not skip) when it still cannot run;
# elsewhere it skips without /usr/bin/chromium (FORKRL_CHROMIUM names another binary).
# FORKRL_SKIP_SETUP=1 uses the venv as it is (no install step), e.g. a venv shared with other checkouts.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "${FORKRL_SKIP_SETUP:-}" = 1 ] || bash scripts/setup.sh
VENV=${FORKRL_VENV:-.venv}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# The suite starts many processes on few cores (and CI machines are loaded): OpenMP threads that wait at a
# barrier sleep instead of spinning on cores the others need (forkrl itself leaves the variable to the user).
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
[ -t 1 ] || export TQDM_MININTERVAL=${TQDM_MININTERVAL:-10}  # CI logs: a progress line every 10 s, not 10 a second

"$VENV/bin/ruff" check --quiet . || { echo "[test] ruff found problems (see above)"; exit 1; }

if [ "${CI:-}" = true ] && [ "$(id -u)" = 0 ] && ! [ -x "${FORKRL_CHROMIUM:-/usr/bin/chromium}" ]; then
  echo "[test] installing chromium for the browser test of the reports"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) \
    >/tmp/forkrl-apt-chromium.log 2>&1 || echo "[test] apt-get failed (see /tmp/forkrl-apt-chromium.log); the browser test will fail"
fi

markers=()
if [ "${FORKRL_DOCKER_TESTS:-}" = 1 ] || { [ "${CI:-}" = true ] && [ "${FORKRL_DOCKER_TESTS:-}" != 0 ]; }; then
  if [ "${CI:-}" = true ] && [ "$(id -u)" = 0 ] && ! command -v docker-compose >/dev/null 2>&1; then
    echo "[test] installing docker.io, docker-compose and debootstrap for the Docker end-to-end test"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io docker-compose debootstrap) \
      >/tmp/forkrl-apt.log 2>&1 || echo "[test] apt-get failed (see /tmp/forkrl-apt.log); the Docker test will fail"
  fi
  markers=(-m "docker or not docker")
fi

# Free disk, said up front: a full disk fails tests by the dozen with "No space left on device" far from the cause.
# The suite writes ~1 GB per session under $TMPDIR (a passing test's tmp_path is deleted at the session's end);
# the Docker test builds images of ~8 GB under dockerd's data root.
need_gb=$(( ${#markers[@]} > 0 ? 12 : 3 ))
free_gb=$(df -Pk "${TMPDIR:-/tmp}" . /var/lib 2>/dev/null | awk 'NR > 1 {print int($4 / 1048576)}' | sort -n | head -1)
echo "[test] free disk: ${free_gb:-?} GB (least of \$TMPDIR, the checkout, /var/lib)"
if [ -n "$free_gb" ] && [ "$free_gb" -lt "$need_gb" ]; then
  echo "[test] warning: less than $need_gb GB free; tests that fail with 'No space left on device' failed for the disk"
fi

order=()
label="file order"
if [ "${CI:-}" = true ] || [ "${FORKRL_RANDOM_ORDER:-}" = 1 ]; then
  seed=${FORKRL_RANDOM_SEED:-$(( $(od -An -N4 -tu4 /dev/urandom) % 1000000 ))}
  order=(--random-order-bucket=module --random-order-seed="$seed")
  label="random order (seed $seed)"
  echo "[test] $label (replay: FORKRL_RANDOM_SEED=$seed FORKRL_RANDOM_ORDER=1 bash scripts/test.sh)"
fi
t0=$(date +%s)
"$VENV/bin/python" -m pytest tests -q --durations=10 "${markers[@]}" "${order[@]}" "$@"
echo "[test] $label: passed in $(( $(date +%s) - t0 )) s"
