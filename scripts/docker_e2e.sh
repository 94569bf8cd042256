#!/usr/bin/env bash
# End-to-end check of the Docker stack: image build, compose up, a 3-step RL run, a probe of its
# checkpoints, compose down. Prints the time of each phase. Leaves nothing running (trap), and removes
# only what it created: its compose project (forkrl-e2e, with its volumes), if it started it, dockerd, and
# the image an earlier run had built under the tag it rebuilds (left untagged by the new build).
#
#   sudo bash scripts/docker_e2e.sh
#
# Environment (all optional):
#   COMPOSE_PROJECT   compose project name (default forkrl-e2e: its own containers and volumes)
#   ROLLOUT_PORT TRAINER_PORT PROBE_PORT   ports on 127.0.0.1 (default 51051 51052 8100; a port set here
#                     must be free; a default that is taken moves to the next free port, with a log line)
#   FORKRL_IMAGE      image tag to build and run (default forkrl:cpu)
#   E2E_RUN_ARGS      extra flags for clients/start_run.py
#   E2E_PROBE_JSON    probe request body (default: steps [1] + final, small sample)
#   E2E_CLIENT        host | container: where start_run.py runs (default: host when .venv exists)
#   KEEP_DOCKERD=1    leave a dockerd this script started running
#   KEEP_STACK=1      skip `down -v` (debugging; the stack stays up)
#   DOCKER_DATA_ROOT  dockerd --data-root when this script starts it (default: dockerd's own)
# Needs root (dockerd, debootstrap), docker.io + docker-compose (or the compose v2 plugin), debootstrap.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)

export COMPOSE_PROJECT_NAME=${COMPOSE_PROJECT:-forkrl-e2e}
# Not the default ports: a development stack (or a test) on 50051/50052/8000 can keep running meanwhile.
PORTS_SET_BY_USER=" ${ROLLOUT_PORT:+ROLLOUT_PORT} ${TRAINER_PORT:+TRAINER_PORT} ${PROBE_PORT:+PROBE_PORT} "
export ROLLOUT_PORT=${ROLLOUT_PORT:-51051} TRAINER_PORT=${TRAINER_PORT:-51052} PROBE_PORT=${PROBE_PORT:-8100}
export FORKRL_IMAGE=${FORKRL_IMAGE:-forkrl:cpu}
# Container paths must keep their defaults here (a FORKRL_DATA meant for clients/launch.py would move them).
unset FORKRL_DATA FORKRL_PROBE_JOBS FORKRL_VOLUME FORKRL_PROBE_VOLUME
mkdir -p .docker

log() { printf '\033[1m[e2e %s]\033[0m %s\n' "$(date +%H:%M:%S)" "$*"; }
now() { date +%s.%N; }
declare -a PHASES=()
phase_start=0
begin() { phase_name=$1; phase_start=$(now); log "== $1"; }
end() { PHASES+=("$(awk -v n="$phase_name" -v a="$phase_start" -v b="$(now)" 'BEGIN { printf "%-22s %7.1f s", n, b - a }')"); phase_name=""; }
report() {
  echo
  log "timings:"
  for p in "${PHASES[@]}"; do echo "    $p"; done
  [ -z "${failed_phase:-}" ] || echo "    (stopped during: $failed_phase)"
}

# ---- compose CLI: v1 (docker-compose) or v2 (docker compose)
if command -v docker-compose >/dev/null 2>&1; then COMPOSE=(docker-compose)
elif docker compose version >/dev/null 2>&1; then COMPOSE=(docker compose)
else echo "no docker-compose / docker compose found" >&2; exit 1; fi
compose() { "${COMPOSE[@]}" -f compose.yaml "$@"; }

STARTED_DOCKERD=0
STACK_UP=0
cleanup() {
  local rc=$?
  set +e
  failed_phase=${phase_name:-}
  if [ "$STACK_UP" = 1 ]; then
    if [ "$rc" != 0 ]; then
      log "FAILED (exit $rc): state and last log lines"
      compose ps
      for s in model rollout trainer probe; do compose logs --no-color --tail 40 "$s" 2>/dev/null; done
    fi
    if [ "${KEEP_STACK:-0}" = 1 ]; then
      log "KEEP_STACK=1: stack left up (${COMPOSE[*]} -p $COMPOSE_PROJECT_NAME down -v to remove)"
    else
      begin "compose down -v"
      compose down -v --remove-orphans >/dev/null 2>&1
      end
    fi
  fi
  if [ "$STARTED_DOCKERD" = 1 ] && [ "${KEEP_DOCKERD:-0}" != 1 ] && [ "${KEEP_STACK:-0}" != 1 ]; then
    log "stopping the dockerd this script started"
    kill -TERM "$(cat .docker/dockerd.pid)" 2>/dev/null
    for _ in $(seq 50); do kill -0 "$(cat .docker/dockerd.pid)" 2>/dev/null || break; sleep 0.2; done
  fi
  report
  [ "$rc" = 0 ] && log "E2E OK" || log "E2E FAILED"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# ---- 1. Docker engine (host networking only: no bridge, no iptables rules)
begin "dockerd"
if ! docker info >/dev/null 2>&1; then
  [ "$(id -u)" = 0 ] || { echo "dockerd is not running and starting it needs root" >&2; exit 1; }
  log "starting dockerd --bridge=none --iptables=false (log: .docker/dockerd.log)"
  extra=()
  [ -n "${DOCKER_DATA_ROOT:-}" ] && extra=(--data-root "$DOCKER_DATA_ROOT")
  setsid dockerd --bridge=none --iptables=false "${extra[@]}" >.docker/dockerd.log 2>&1 </dev/null &
  echo $! >.docker/dockerd.pid
  STARTED_DOCKERD=1
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 0.5; done
  docker info >/dev/null 2>&1 || { tail -20 .docker/dockerd.log >&2; exit 1; }
fi
end

# ---- 2. base image: python:3.11-slim when present, else a local Debian one (no registry here)
begin "base image"
if docker image inspect python:3.11-slim >/dev/null 2>&1; then
  export FORKRL_BASE_IMAGE=python:3.11-slim
else
  export FORKRL_BASE_IMAGE=${FORKRL_BASE_IMAGE:-forkrl-base:bookworm}
  FORKRL_BASE_IMAGE=$FORKRL_BASE_IMAGE bash docker/build_base_image.sh
fi
log "base image: $FORKRL_BASE_IMAGE"
end

# ---- 3. wheelhouse (cached while pyproject.toml is unchanged)
begin "wheelhouse"
bash docker/build_wheelhouse.sh
end

# ---- 4. image (legacy builder compatible; host network for the build containers)
begin "docker build"
# The venv stage is tagged too: as an untagged intermediate image it would be the first thing
# `docker image prune` deletes, and with it the cache that makes app-only rebuilds take seconds.
for target in venv final; do
  if [ $target = venv ]; then tag=${FORKRL_IMAGE%%:*}-venv:${FORKRL_IMAGE##*:}; opts=(--target venv); else tag=$FORKRL_IMAGE; opts=(); fi
  old_id=$(docker image inspect -f '{{.Id}}' "$tag" 2>/dev/null || true)
  # --force-rm: a failed step's build container is removed too (the legacy builder keeps it otherwise)
  nice docker build --force-rm --network host --build-arg BASE_IMAGE="$FORKRL_BASE_IMAGE" "${opts[@]}" \
    -f docker/Dockerfile -t "$tag" . 2>&1 \
    | grep -v -e "^DEPRECATED: The legacy builder" -e "Install the buildx" -e "docs.docker.com/go/buildx" \
    | grep -E "^(Step|Successfully tagged)|rror" || true
  docker image inspect "$tag" >/dev/null
  # the image this build's tag replaced (an earlier run's, now untagged: ~4 GB each) goes; docker refuses while a
  # container or another tag still uses it, and then it stays
  if [ -n "$old_id" ] && [ "$old_id" != "$(docker image inspect -f '{{.Id}}' "$tag")" ]; then
    docker image rm "$old_id" >/dev/null 2>&1 && log "removed the image $tag replaced (${old_id:7:12})" || true
  fi
done
log "image $FORKRL_IMAGE: $(docker image inspect -f '{{.Size}}' "$FORKRL_IMAGE" | awk '{printf "%.2f GB", $1/1e9}')"
end

# ---- 5. compose up, wait until every long-running service is healthy
# A port is taken when something accepts a connection on it. 51051/51052 lie in Linux's ephemeral range
# (32768-60999), so any process on a busy machine (a test's server, a vLLM engine's socket) can hold one
# by chance: a default that is taken moves up to the next free port; a port the user set must be free.
port_taken() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
claimed=""
for var in ROLLOUT_PORT TRAINER_PORT PROBE_PORT; do
  port=${!var}
  if [[ "$PORTS_SET_BY_USER" == *" $var "* ]]; then
    if port_taken "$port"; then
      echo "port $port on 127.0.0.1 ($var) is in use (another stack?); set another" >&2
      exit 1
    fi
  else
    first=$port
    while port_taken "$port" || [[ " $claimed " == *" $port "* ]]; do
      port=$((port + 1))
      [ "$port" -lt $((first + 200)) ] || { echo "no free port in $first..$port on 127.0.0.1 for $var" >&2; exit 1; }
    done
    [ "$port" = "$first" ] || log "$var: port $first on 127.0.0.1 is in use; using $port"
    export "$var=$port"
  fi
  claimed="$claimed $port"
done
begin "up -> healthy"
STACK_UP=1
compose config -q
compose up -d
deadline=$(( $(date +%s) + ${E2E_UP_TIMEOUT:-900} ))
while :; do
  states=""
  all_healthy=1
  for s in rollout trainer probe; do
    cid=$(compose ps -q "$s" 2>/dev/null || true)
    st=$( [ -n "$cid" ] && docker inspect -f '{{.State.Status}}/{{if .State.Health}}{{.State.Health.Status}}{{end}}' "$cid" || echo "missing/")
    states="$states $s=$st"
    [ "$st" = "running/healthy" ] || all_healthy=0
    case "$st" in exited/*|dead/*|*/unhealthy) echo "service $s: $st" >&2; exit 1 ;; esac
  done
  [ "$all_healthy" = 1 ] && break
  [ "$(date +%s)" -lt "$deadline" ] || { echo "not healthy in time:$states" >&2; exit 1; }
  sleep 2
done
log "healthy:$states"
mcid=$(compose ps -q model)
log "of which the one-shot model service (copies the committed tiny model into the fresh volume) ran $(docker inspect -f \
  '{{.State.StartedAt}} {{.State.FinishedAt}}' "$mcid" | python3 -c 'import sys, datetime as d
a, b = (d.datetime.fromisoformat(t[:26].rstrip("Z")) for t in sys.stdin.read().split())
print(f"{(b - a).total_seconds():.1f} s")')"
end

# ---- 6. a short RL run (3 steps, checkpoint every step) through the trainer
# The services' token: FORKRL_TOKEN when the caller set one, else the one the `token` service created.
if [ -z "${FORKRL_TOKEN:-}" ]; then FORKRL_TOKEN=$(compose exec -T trainer cat /data/secrets/token); fi
export FORKRL_TOKEN
RUN_DIR=/data/runs/e2e-$(date +%Y%m%d-%H%M%S)
if [ -z "${E2E_CLIENT:-}" ]; then [ -x .venv/bin/python ] && E2E_CLIENT=host || E2E_CLIENT=container; fi
run_args=(--entropy-top-frac 0.2 --num-steps 3 --save-every 1 --run-dir "$RUN_DIR"
          --trainer-address "127.0.0.1:$TRAINER_PORT" --rollout-addresses "127.0.0.1:$ROLLOUT_PORT")
# shellcheck disable=SC2206
run_args+=(${E2E_RUN_ARGS:-})
begin "rl run (3 steps)"
log "clients/start_run.py ${run_args[*]}  ($E2E_CLIENT)"
if [ "$E2E_CLIENT" = host ]; then
  .venv/bin/python clients/start_run.py "${run_args[@]}" </dev/null
else
  compose exec -T trainer python clients/start_run.py "${run_args[@]}" </dev/null
fi
end

# ---- 7. probe the run's checkpoints (blocking request), check the summary
begin "probe"
body=${E2E_PROBE_JSON:-"{\"checkpoint_root\": \"$RUN_DIR/checkpoints\", \"steps\": [1], \"include_final\": true, \"num_prompts\": 8, \"group_size\": 8, \"max_positions_per_group\": 16}"}
log "POST /probe?wait=true $body"
code=$(curl -sS --noproxy '*' -o .docker/e2e-probe.json -w '%{http_code}' -X POST \
  -H 'content-type: application/json' -H "authorization: Bearer $FORKRL_TOKEN" \
  "http://127.0.0.1:$PROBE_PORT/probe?wait=true" -d "$body")
[ "$code" = 200 ] || { echo "probe answered HTTP $code: $(head -c 2000 .docker/e2e-probe.json)" >&2; exit 1; }
python3 - .docker/e2e-probe.json <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
labels = [c.get("label") for c in s.get("checkpoints", [])]
assert len(labels) == 2 and "final" in labels, f"expected step 1 + final, got checkpoints {labels}"
assert s.get("results"), "summary has no results"
assert s.get("n_records", 0) > 0, "summary has no token records"
print(f"    summary: checkpoints {labels}, {len(s['results'])} result cells, {s['n_records']} records,"
      f" gradient method {s.get('gradient_method')}")
PY
end

# shellcheck disable=SC2046
log "container memory: $(docker stats --no-stream --format '{{.Name}}={{.MemUsage}}' \
  $(docker ps -q --filter "label=com.docker.compose.project=$COMPOSE_PROJECT_NAME") | awk '{print $1}' | tr '\n' ' ')"
