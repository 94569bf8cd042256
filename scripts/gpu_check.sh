#!/usr/bin/env bash
# GPU check (issue 13): a random-init ~0.5B Qwen2-architecture model built from a config (no download), the
# rollout service on the CUDA vLLM, the trainer on the GPUs present (torchrun + FSDP2 when > 1 GPU), 5 steps
# with --entropy-top-frac 0.2 through clients/start_run.py; prints tokens/s, the step-time breakdown, the
# weight-push time and route, and peak GPU memory. Target: < 8 minutes on one large GPU.
#
#   bash scripts/gpu_check.sh                 # needs CUDA: exits 2 at once, saying so, without it
#   bash scripts/gpu_check.sh --dry-run       # the same path on CPU with a tiny model (FORKRL_GPU_CHECK_DEVICE=cpu)
#
# NOT YET RUN ON A GPU: only --dry-run has run (on a 2-core CPU machine). GPU layout: 1 GPU -> the rollout
# and the trainer share GPU 0 (vLLM's KV cache capped at ROLLOUT_KV_CACHE_GIB, default 16); N > 1 GPUs ->
# the rollout on GPU 0, the trainer on GPUs 1..N-1 (torchrun --nproc-per-node N-1, FSDP2, bf16 compute).
# Settings (environment): FORKRL_GPU_CHECK_DEVICE (cuda|cpu), FORKRL_GPU_CHECK_DIR (work dir; default a
# new temp dir), FORKRL_GPU_CHECK_PORT (first of 2 ports; default 52150), PY (python; default .venv's or
# python3), GPU_CHECK_STEPS (5), GPU_CHECK_PROMPTS (32 per step), GPU_CHECK_GROUP (8), GPU_CHECK_MAX_NEW (256).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DEVICE=${FORKRL_GPU_CHECK_DEVICE:-cuda}
for arg in "$@"; do
  case "$arg" in
    --dry-run) DEVICE=cpu ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "gpu_check: unknown argument $arg (see --help)" >&2; exit 2 ;;
  esac
done
if [ -z "${PY:-}" ]; then
  if [ -x "${FORKRL_VENV:-$ROOT/.venv}/bin/python" ]; then PY=${FORKRL_VENV:-$ROOT/.venv}/bin/python; else PY=python3; fi
fi
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
T_START=$(date +%s)

if [ "$DEVICE" = cuda ]; then
  NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)" 2>/dev/null || echo 0)
  if [ "$NGPU" -lt 1 ]; then
    echo "gpu_check: no CUDA device (torch.cuda.is_available() is False in $PY). This check needs an NVIDIA GPU;" >&2
    echo "gpu_check: run 'bash scripts/gpu_check.sh --dry-run' for the same path on CPU with a tiny model." >&2
    exit 2
  fi
  SIZE=0.5b; DTYPE=bfloat16; KV=${ROLLOUT_KV_CACHE_GIB:-16}; MAXLEN=1024
  STEPS=${GPU_CHECK_STEPS:-5}; PROMPTS=${GPU_CHECK_PROMPTS:-32}; GROUP=${GPU_CHECK_GROUP:-8}
  MAXNEW=${GPU_CHECK_MAX_NEW:-256}; MICRO=16
  if [ "$NGPU" -gt 1 ]; then
    ROLLOUT_GPUS=0; TRAINER_GPUS=$(seq -s, 1 $((NGPU - 1))); RANKS=$((NGPU - 1))
  else
    ROLLOUT_GPUS=0; TRAINER_GPUS=0; RANKS=1
  fi
elif [ "$DEVICE" = cpu ]; then
  NGPU=0; SIZE=tiny; DTYPE=float32; KV=1; MAXLEN=512; RANKS=1
  STEPS=${GPU_CHECK_STEPS:-5}; PROMPTS=${GPU_CHECK_PROMPTS:-4}; GROUP=${GPU_CHECK_GROUP:-4}
  MAXNEW=${GPU_CHECK_MAX_NEW:-16}; MICRO=16; ROLLOUT_GPUS=; TRAINER_GPUS=
else
  echo "gpu_check: FORKRL_GPU_CHECK_DEVICE must be cuda or cpu, got $DEVICE" >&2; exit 2
fi

WORK=${FORKRL_GPU_CHECK_DIR:-$(mktemp -d /tmp/forkrl-gpu-check.XXXXXX)}
mkdir -p "$WORK"
PORT=${FORKRL_GPU_CHECK_PORT:-52150}
RPORT=$PORT; TPORT=$((PORT + 1))
export FORKRL_TOKEN=${FORKRL_TOKEN:-$("$PY" -c "import secrets; print(secrets.token_hex(16))")}
PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do
    for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
  done
}
trap cleanup EXIT
echo "== gpu_check: device $DEVICE, $NGPU GPU(s), trainer ranks $RANKS, model $SIZE, work dir $WORK"

echo "== model: random-init Qwen2 ($SIZE) from a config"
"$PY" -m forkrl.models.random_qwen2 --size "$SIZE" --out "$WORK/model"

wait_healthy() {  # address pid name timeout_s
  local t0; t0=$(date +%s)
  until "$PY" clients/healthcheck.py grpc "$1" >/dev/null 2>&1; do
    if ! kill -0 "$2" 2>/dev/null; then echo "gpu_check: the $3 exited; its log:" >&2; tail -40 "$WORK/$3.log" >&2; exit 1; fi
    if [ $(( $(date +%s) - t0 )) -gt "$4" ]; then echo "gpu_check: the $3 is not healthy after $4 s" >&2; tail -40 "$WORK/$3.log" >&2; exit 1; fi
    sleep 1
  done
}

echo "== rollout service on ${ROLLOUT_GPUS:-cpu} (vLLM, $DTYPE, KV cache $KV GiB), port $RPORT"
CUDA_VISIBLE_DEVICES=$ROLLOUT_GPUS setsid "$PY" -m rollout_service --model "$WORK/model" --port "$RPORT" \
  --dtype "$DTYPE" --kv-cache-gib "$KV" --max-model-len "$MAXLEN" --allowed-roots "$WORK" \
  >"$WORK/rollout.log" 2>&1 &
PIDS+=($!); RPID=$!

echo "== trainer service on ${TRAINER_GPUS:-cpu} ($RANKS rank(s)), port $TPORT"
LAUNCH=("$PY")
[ "$RANKS" -gt 1 ] && LAUNCH=("$PY" -m torch.distributed.run --standalone --nproc-per-node "$RANKS")
CUDA_VISIBLE_DEVICES=$TRAINER_GPUS setsid "${LAUNCH[@]}" -m trainer_service --port "$TPORT" --runs-root "$WORK/runs" \
  --allowed-roots "$WORK" --rollout-addresses "127.0.0.1:$RPORT" --device "$DEVICE" --no-tensorboard \
  >"$WORK/trainer.log" 2>&1 &
PIDS+=($!); TPID=$!

wait_healthy "127.0.0.1:$RPORT" "$RPID" rollout 300
wait_healthy "127.0.0.1:$TPORT" "$TPID" trainer 300
T_READY=$(date +%s)

GPU_MEM_LOG=$WORK/gpu_mem.csv
if [ "$DEVICE" = cuda ] && command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=index,memory.used,memory.total --format=csv,noheader,nounits -lms 500 >"$GPU_MEM_LOG" 2>/dev/null &
  PIDS+=($!)
fi

echo "== $STEPS steps, --entropy-top-frac 0.2 ($PROMPTS prompts x $GROUP samples, <= $MAXNEW new tokens)"
"$PY" clients/start_run.py --trainer-address "127.0.0.1:$TPORT" --model "$WORK/model" --run-dir "$WORK/runs/check" \
  --rollout-addresses "127.0.0.1:$RPORT" \
  --num-steps "$STEPS" --entropy-top-frac 0.2 --prompts-per-step "$PROMPTS" --group-size "$GROUP" \
  --max-new-tokens "$MAXNEW" --micro-batch-size "$MICRO" --lr 1e-6 --eval-prompts 0 --save-every 0 \
  --weight-sync auto --no-detach
T_END=$(date +%s)

"$PY" - "$WORK/runs/check/metrics.jsonl" "$GPU_MEM_LOG" "$((T_READY - T_START))" "$((T_END - T_READY))" "$DEVICE" <<'EOF'
import json, statistics, sys
from pathlib import Path
metrics, mem_log, t_ready, t_run, device = sys.argv[1:6]
rows = [r for r in map(json.loads, Path(metrics).read_text().splitlines()) if r.get("kind") == "train"]
if not rows:
    sys.exit(f"gpu_check: no train steps in {metrics}")
def med(k):
    vals = [r[k] for r in rows if k in r]
    return statistics.median(vals) if vals else float("nan")
print(f"\n== gpu_check results ({len(rows)} steps on {device}; start-up {t_ready} s, run {t_run} s)")
print(f"tokens/s (generation, median)  {med('tokens_per_s'):10.1f}")
for k in ("time_step_s", "time_generate_s", "time_score_s", "time_train_s", "time_push_s", "swap_drain_s",
          "swap_apply_s"):
    print(f"{k:30s} {med(k):10.3f} s (median)")
print(f"push routes (shm services)      {med('push_shm_services'):10.0f}")
peak = max((r.get("gpu_mem_peak_gib", 0.0) for r in rows), default=0.0)
if device == "cuda":
    print(f"trainer peak GPU memory        {peak:10.2f} GiB (torch.cuda.max_memory_allocated, rank 0)")
    p = Path(mem_log)
    if p.exists() and p.stat().st_size:
        used = {}
        for line in p.read_text().splitlines():
            parts = [x.strip() for x in line.split(",")]
            if len(parts) == 3 and parts[1].isdigit():
                used[parts[0]] = max(used.get(parts[0], 0), int(parts[1]))
        for gpu, mib in sorted(used.items()):
            print(f"GPU {gpu} peak used (nvidia-smi)  {mib / 1024:10.2f} GiB (vLLM + trainer)")
EOF
echo "== gpu_check done in $(( $(date +%s) - T_START )) s (target < 480 s on one large GPU); logs in $WORK"
