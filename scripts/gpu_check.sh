#!/usr/bin/env bash
# GPU check (issues 13, 26): the run this project exists for, scaled down, as one command. A random-init
# Qwen2.5-1.5B-shaped model built from a config (forkrl/models/random_qwen2.py size 1.5b: no download), the
# rollout service (vLLM) on GPU 0, the trainer on the other GPUs (torchrun + FSDP2; 1 GPU: both on GPU 0, vLLM's
# KV cache capped), and recipes/dapo_paper.toml through clients/start_run.py --config with flags that scale it
# down: loss dapo, --entropy-top-frac 0.2, mini-batches (4 AdamW updates per rollout batch), TIS cap 2,
# activation checkpointing, packed sequences (--pack-sequences: micro-batches of one packed row of <= 4096 tokens,
# --mask-scope step as the token budget needs; the trainer's default attention, sdpa: forkrl has no setting that
# loads flash-attention yet), 10 steps of 32 prompts x 8 samples, <= 256 new tokens, weights pushed through vLLM's
# weight-transfer API (--weight-sync transfer: nccl; 1 GPU: shm, below). Prints generation tokens/s, the
# per-step times (generate/train/push), the push route, peak memory per trainer rank, GPU and process, the wall
# time (warns past 480 s), then PASS or FAIL; exits non-zero when a step is missing, skipped or short of its
# updates, the run fails, or the final weights are not finite.
#
#   bash scripts/gpu_check.sh                 # needs CUDA: exits 2 at once, saying so, without it
#   bash scripts/gpu_check.sh --dry-run       # the same path on CPU: size tiny-1.5b, gloo, 2 trainer ranks
#
# NOT RUN ON A GPU: no GPU was lent when this version was written (issue 26); only --dry-run has run, on a
# 2-core CPU machine (docs/results.md). Departures from the recipe, all for size or time: dataset = a generated
# JSONL of arithmetic problems in dapo_plain format (the embedded character tokenizer has no chat template);
# dynamic sampling off (a random-init policy fails every sample, so every group has one reward, the recipe's
# filter would keep none and every step would be skipped); overlong ramp 64 tokens (<= max_new_tokens).
# 1 GPU: NCCL refuses two ranks on one device ("Duplicate GPU detected"), so the push there takes
# --weight-sync shm (a shared-memory file + LoadWeights) and the route line says so; the nccl transfer needs
# >= 2 GPUs. One trainer rank trains in fp32 (FSDP2's bf16 compute is for > 1 rank), so the check lets cuBLAS
# run fp32 matmuls in TF32 on every rank (PyTorch's TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1, as NVIDIA's containers
# set it; GPU_CHECK_TF32=0: plain fp32). The rollout starts as compose.gpu.yaml and the docs start it
# (the NVML check before the first CUDA query; the engine's GPU defaults: CUDA graphs, the KV cache
# from --gpu-memory-utilization); on 1 GPU with --gpu-memory-utilization 0.3 (compose's 1-GPU layout: vLLM wants
# that fraction free at its start), and the trainer starts once vLLM is up.
# After the run, on CUDA: >= 2 GPUs: a trainer killed mid-push (tests/rollout/transfer_trainer.py --mode
# die-mid-send: the nccl broadcast half sent) must leave the rollout NOT_SERVING within 3 x its
# --transfer-timeout-s (the receive's deadline aborts the communicator), and a good push must then serve; 1 GPU: the
# rollout is restarted beside the trainer (which holds its memory) and must be healthy again within 300 s. The
# summary says what was checked and what was skipped.
# Settings (environment): FORKRL_GPU_CHECK_DEVICE (cuda|cpu), FORKRL_GPU_CHECK_DIR (work dir; default a new temp
# dir), FORKRL_GPU_CHECK_PORT (first of 2 ports; default 52150), PY (python; default .venv's or python3),
# GPU_CHECK_STEPS (10; dry run 3), GPU_CHECK_PROMPTS (32; 4), GPU_CHECK_GROUP (8; 4), GPU_CHECK_MINI (8; 2),
# GPU_CHECK_MAX_NEW (256; 16), GPU_CHECK_RANKS (trainer ranks; default GPUs - 1, dry run 2),
# ROLLOUT_KV_CACHE_GIB (cpu: 1; cuda: unset, sized from the utilization), ROLLOUT_GPU_MEMORY_UTILIZATION (1 GPU:
# 0.3; else vLLM's 0.9), GPU_CHECK_TRANSFER_TIMEOUT_S (60), GPU_CHECK_WEIGHT_SYNC (the push route; default above),
# GPU_CHECK_TF32 (1).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DEVICE=${FORKRL_GPU_CHECK_DEVICE:-cuda}
for arg in "$@"; do
  case "$arg" in
    --dry-run) DEVICE=cpu ;;
    -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit 0 ;;
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
  SIZE=1.5b; DTYPE=bfloat16; MAXLEN=1024; THREADS=4; TF32=${GPU_CHECK_TF32:-1}; SIZING=()
  STEPS=${GPU_CHECK_STEPS:-10}; PROMPTS=${GPU_CHECK_PROMPTS:-32}; GROUP=${GPU_CHECK_GROUP:-8}
  MINI=${GPU_CHECK_MINI:-8}; MAXNEW=${GPU_CHECK_MAX_NEW:-256}; MICRO=16; TOKENS=4096
  ROLLOUT_GPUS=0
  if [ "$NGPU" -gt 1 ]; then
    RANKS=${GPU_CHECK_RANKS:-$((NGPU - 1))}; TRAINER_GPUS=$(seq -s, 1 "$RANKS"); SYNC=${GPU_CHECK_WEIGHT_SYNC:-transfer}
  else
    RANKS=1; TRAINER_GPUS=0; SYNC=${GPU_CHECK_WEIGHT_SYNC:-shm}  # NCCL: no two ranks on one GPU (header)
    SIZING=(--gpu-memory-utilization "${ROLLOUT_GPU_MEMORY_UTILIZATION:-0.3}")  # beside the trainer (header)
  fi
elif [ "$DEVICE" = cpu ]; then
  NGPU=0; SIZE=tiny-1.5b; DTYPE=float32; MAXLEN=512; THREADS=1; TF32=0
  SIZING=(--kv-cache-gib "${ROLLOUT_KV_CACHE_GIB:-1}")
  STEPS=${GPU_CHECK_STEPS:-3}; PROMPTS=${GPU_CHECK_PROMPTS:-4}; GROUP=${GPU_CHECK_GROUP:-4}
  MINI=${GPU_CHECK_MINI:-2}; MAXNEW=${GPU_CHECK_MAX_NEW:-16}; MICRO=8; TOKENS=256; RANKS=${GPU_CHECK_RANKS:-2}
  ROLLOUT_GPUS=; TRAINER_GPUS=; SYNC=${GPU_CHECK_WEIGHT_SYNC:-transfer}
else
  echo "gpu_check: FORKRL_GPU_CHECK_DEVICE must be cuda or cpu, got $DEVICE" >&2; exit 2
fi
OVERLONG=$(( MAXNEW / 4 ))  # the overlong ramp: the recipe's is a fifth of L_max (4096 of 20480)

WORK=${FORKRL_GPU_CHECK_DIR:-$(mktemp -d /tmp/forkrl-gpu-check.XXXXXX)}
mkdir -p "$WORK"
PORT=${FORKRL_GPU_CHECK_PORT:-52150}
RPORT=$PORT; TPORT=$((PORT + 1))
export FORKRL_TOKEN=${FORKRL_TOKEN:-$("$PY" -c "import secrets; print(secrets.token_hex(16))")}
if [ "$SYNC" = shm ] && [ -z "${FORKRL_SYNC_DIR:-}" ]; then
  # a container's /dev/shm is often 64 MiB: the shm route's file (fp32, 6.2 GB at 1.5b) then goes to the work dir
  SHM_FREE=$(df -Pk /dev/shm 2>/dev/null | awk 'NR==2 {print $4}'); SHM_FREE=${SHM_FREE:-0}
  if [ "$SHM_FREE" -lt $((16 * 1024 * 1024)) ]; then export FORKRL_SYNC_DIR=$WORK/sync; mkdir -p "$FORKRL_SYNC_DIR"; fi
fi
PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do
    for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
  done
}
trap cleanup EXIT
echo "== gpu_check: device $DEVICE, $NGPU GPU(s), trainer ranks $RANKS, model $SIZE, push $SYNC, work dir $WORK"

echo "== model: random-init Qwen2 ($SIZE) from a config; dataset: $(( (STEPS + 2) * PROMPTS )) generated problems"
"$PY" -m forkrl.models.random_qwen2 --size "$SIZE" --out "$WORK/model"
"$PY" - "$WORK/data.jsonl" "$(( (STEPS + 2) * PROMPTS ))" <<'EOF'
import json, random, sys
rng = random.Random(0)
with open(sys.argv[1], "w") as f:
    for _ in range(int(sys.argv[2])):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        f.write(json.dumps({"prompt": f"What is {a} + {b}?", "answer": str(a + b)}) + "\n")
EOF

wait_healthy() {  # address pid name timeout_s
  local t0; t0=$(date +%s)
  until "$PY" clients/healthcheck.py grpc "$1" >/dev/null 2>&1; do
    if ! kill -0 "$2" 2>/dev/null; then echo "gpu_check: the $3 exited; its log:" >&2; tail -40 "$WORK/$3.log" >&2; exit 1; fi
    if [ $(( $(date +%s) - t0 )) -gt "$4" ]; then echo "gpu_check: the $3 is not healthy after $4 s" >&2; tail -40 "$WORK/$3.log" >&2; exit 1; fi
    sleep 1
  done
}

XFER_TIMEOUT=${GPU_CHECK_TRANSFER_TIMEOUT_S:-60}
start_rollout() {  # log file
  CUDA_VISIBLE_DEVICES=$ROLLOUT_GPUS setsid "$PY" -m rollout_service --model "$WORK/model" --port "$RPORT" \
    --dtype "$DTYPE" --max-model-len "$MAXLEN" --allowed-roots "$WORK" \
    --transfer-timeout-s "$XFER_TIMEOUT" "${SIZING[@]}" >"$1" 2>&1 &
  PIDS+=($!); RPID=$!
}
echo "== rollout service on ${ROLLOUT_GPUS:-cpu} ($DTYPE, ${SIZING[*]:-the engine defaults for a GPU}), port $RPORT"
start_rollout "$WORK/rollout.log"
# one GPU: vLLM refuses to start unless gpu_memory_utilization of the GPU is free, so the trainer waits
[ "$NGPU" -eq 1 ] && wait_healthy "127.0.0.1:$RPORT" "$RPID" rollout 300

echo "== trainer service on ${TRAINER_GPUS:-cpu} ($RANKS rank(s), TF32 $TF32), port $TPORT"
LAUNCH=("$PY")
[ "$RANKS" -gt 1 ] && LAUNCH=("$PY" -m forkrl.launch --nproc-per-node "$RANKS")
CUDA_VISIBLE_DEVICES=$TRAINER_GPUS TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=$TF32 setsid "${LAUNCH[@]}" -m trainer_service \
  --port "$TPORT" --runs-root "$WORK/runs" --allowed-roots "$WORK" --rollout-addresses "127.0.0.1:$RPORT" \
  --device "$DEVICE" --threads "$THREADS" --no-tensorboard >"$WORK/trainer.log" 2>&1 &
PIDS+=($!); TPID=$!

wait_healthy "127.0.0.1:$RPORT" "$RPID" rollout 300
wait_healthy "127.0.0.1:$TPORT" "$TPID" trainer 300
T_READY=$(date +%s)

GPU_MEM_LOG=$WORK/gpu_mem.csv; APP_MEM_LOG=$WORK/gpu_apps.csv
if [ "$DEVICE" = cuda ] && command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=index,memory.used,memory.total --format=csv,noheader,nounits -lms 500 >"$GPU_MEM_LOG" 2>/dev/null &
  PIDS+=($!)
  (while sleep 0.5; do nvidia-smi --query-compute-apps=pid,gpu_uuid,used_memory --format=csv,noheader,nounits; done) \
    >"$APP_MEM_LOG" 2>/dev/null &
  PIDS+=($!)
fi

echo "== recipes/dapo_paper.toml scaled down: $STEPS steps of $PROMPTS prompts x $GROUP samples (<= $MAXNEW new" \
  "tokens), mini-batches of $MINI prompts ($(( PROMPTS / MINI )) updates per step), TIS cap 2, push $SYNC"
RUN_RC=0
"$PY" clients/start_run.py --config recipes/dapo_paper.toml --trainer-address "127.0.0.1:$TPORT" \
  --model "$WORK/model" --dataset "$WORK/data.jsonl" --prompt-format dapo_plain --run-dir "$WORK/runs/check" \
  --rollout-addresses "127.0.0.1:$RPORT" --num-steps "$STEPS" --prompts-per-step "$PROMPTS" --group-size "$GROUP" \
  --mini-batch-prompts "$MINI" --micro-batch-size "$MICRO" --max-new-tokens "$MAXNEW" \
  --max-tokens-per-micro-batch "$TOKENS" --pack-sequences --mask-scope step \
  --overlong-cache-len "$OVERLONG" --no-dynamic-sampling --loss dapo --entropy-top-frac 0.2 --tis-cap 2.0 \
  --activation-checkpointing --eval-prompts 0 --save-every 0 --log-to jsonl --weight-sync "$SYNC" --no-detach \
  2>&1 | tee "$WORK/run.log" || RUN_RC=$?
T_END=$(date +%s)

# The trainer's peak per rank: rank 0's in metrics.jsonl, the others' in the trainer log (forkrl/training/ranks.py).
set +e
"$PY" - "$WORK" "$RANKS" "$STEPS" "$(( PROMPTS / MINI ))" "$SYNC" "$DEVICE" "$RUN_RC" "$RPID" \
  "$((T_READY - T_START))" "$((T_END - T_READY))" <<'EOF'
import json, math, re, statistics, sys
from pathlib import Path
work, ranks, steps, updates, sync, device, run_rc, rpid, t_ready, t_run = sys.argv[1:11]
work, ranks, steps, updates, run_rc = Path(work), int(ranks), int(steps), int(updates), int(run_rc)
fails = []
if run_rc:
    fails.append(f"clients/start_run.py exited {run_rc} (the run failed: {work}/run.log, {work}/trainer.log)")
mfile = work / "runs/check/metrics.jsonl"
rows = [json.loads(x) for x in mfile.read_text().splitlines()] if mfile.exists() else []
rows = {r["step"]: r for r in rows if r.get("kind") == "train"}
for step in range(1, steps + 1):
    r = rows.get(step)
    if r is None:
        fails.append(f"step {step}: missing from {mfile}")
    elif "time_train_s" not in r:
        fails.append(f"step {step}: not trained (no group to train on)")
    elif r.get("n_updates", updates) != updates or r.get("skipped_updates", 0):
        fails.append(f"step {step}: {r.get('n_updates')} updates ({r.get('skipped_updates', 0)} skipped), "
                     f"expected {updates}")
    elif not all(math.isfinite(v) for v in r.values() if isinstance(v, float)):
        fails.append(f"step {step}: a non-finite metric")
trained = [rows[s] for s in sorted(rows) if "time_train_s" in rows[s]]
def med(k):
    vals = [r[k] for r in trained if k in r]
    return statistics.median(vals) if vals else float("nan")
print(f"\n== gpu_check results ({len(trained)} of {steps} steps trained on {device}; start-up {t_ready} s, "
      f"run {t_run} s)")
print(f"generation tokens/s (median)   {med('tokens_per_s'):10.1f}")
for k in ("time_step_s", "time_generate_s", "time_score_s", "time_train_s", "time_push_s", "swap_apply_s"):
    print(f"{k:30s} {med(k):10.3f} s (median)")
print("per step (s):  step  generate     train      push     total")
for r in trained:
    print(f"              {r['step']:4d} {r.get('time_generate_s', 0):9.3f} {r['time_train_s']:9.3f} "
          f"{r.get('time_push_s', 0):9.3f} {r.get('time_step_s', 0):9.3f}")
log = (work / "run.log").read_text(errors="replace") if (work / "run.log").exists() else ""
tlog = (work / "trainer.log").read_text(errors="replace") if (work / "trainer.log").exists() else ""
routes = sorted(set(re.findall(r"weight sync \(\w+\): ([^\n]*)", log + tlog)))
groups = sorted(set(re.findall(r"weight sync: (\w+ weight-transfer group[^\n]*)", tlog)))
print(f"push route                     {'; '.join(routes) or '(not logged)'}")
for g in groups:
    print(f"                               {g}")
if sync == "transfer" and not any(r.endswith("transfer") for r in routes):
    fails.append(f"the push did not take the transfer route ({routes or 'no route logged'})")
if device == "cuda":
    peaks = {0: max((r.get("gpu_mem_peak_gib", 0.0) for r in trained), default=0.0)}
    for rank, gib in re.findall(r"rank (\d+): step \d+: gpu_mem_peak_gib ([\d.]+)", tlog):
        peaks[int(rank)] = max(peaks.get(int(rank), 0.0), float(gib))
    for rank in sorted(peaks):
        print(f"trainer rank {rank} peak           {peaks[rank]:10.2f} GiB (torch.cuda.max_memory_allocated)")
    used = {}
    p = work / "gpu_mem.csv"
    for line in (p.read_text().splitlines() if p.exists() else []):
        parts = [x.strip() for x in line.split(",")]
        if len(parts) == 3 and parts[1].isdigit():
            used[parts[0]] = max(used.get(parts[0], 0), int(parts[1]))
    for gpu, mib in sorted(used.items()):
        print(f"GPU {gpu} peak used               {mib / 1024:10.2f} GiB (nvidia-smi, every process on it)")
    apps = {}
    p = work / "gpu_apps.csv"
    for line in (p.read_text().splitlines() if p.exists() else []):
        parts = [x.strip() for x in line.split(",")]
        if len(parts) == 3 and parts[2].isdigit():
            apps[parts[0]] = max(apps.get(parts[0], 0), int(parts[2]))
    def is_rollout(pid):  # the rollout service or a process under it (vLLM's engine core)
        try:
            while pid not in ("0", "1", rpid):
                pid = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
            return pid == rpid
        except OSError:
            return False
    for pid, mib in sorted(apps.items()):
        who = "rollout (vLLM)" if is_rollout(pid) else "trainer or other"
        print(f"process {pid:>8s} peak          {mib / 1024:10.2f} GiB (nvidia-smi; {who})")
# the final checkpoint's weights: every tensor finite
ckpts = sorted((work / "runs/check/checkpoints/final").glob("*.safetensors"))  # the policy (HF layout)
if not ckpts:
    fails.append("no final weights (runs/check/checkpoints/final/*.safetensors)")
else:
    import torch
    from safetensors.torch import safe_open
    bad = []
    for f in ckpts:
        with safe_open(str(f), "pt") as st:
            bad += [k for k in st.keys() if not torch.isfinite(st.get_tensor(k)).all()]
    state = "every tensor finite" if not bad else f"NON-FINITE: {bad[:5]}"
    print(f"final weights                  {', '.join(f.name for f in ckpts)}: {state}")
    if bad:
        fails.append(f"non-finite tensors in the final weights: {bad[:5]}")
for f in fails:
    print(f"gpu_check: FAIL: {f}")
sys.exit(1 if fails else 0)
EOF
CHECK_RC=$?
set -e

# What CPU cannot show (header): each check prints its line; the summary lists them.
CHECKED=("the run above through the compose/docs launch path${SIZING[*]:+ (${SIZING[*]})}")
SKIPPED=()
EXTRA_RC=0
health() { "$PY" clients/healthcheck.py grpc "127.0.0.1:$RPORT" >/dev/null 2>&1; }
version() { "$PY" -c "import sys; from forkrl.remote.rollout import RolloutClient; print(RolloutClient(sys.argv[1]).info().version)" "127.0.0.1:$RPORT"; }
if [ "$DEVICE" = cuda ] && [ "$NGPU" -gt 1 ]; then
  echo "== a trainer killed mid-push (nccl, half the broadcast sent): the rollout must recover within its deadline"
  V0=$(version)
  CUDA_VISIBLE_DEVICES=1 "$PY" -m tests.rollout.transfer_trainer --address "127.0.0.1:$RPORT" --model "$WORK/model" \
    --out "$WORK/half.safetensors" --mode die-mid-send --device cuda --run-id gpu-check-kill >"$WORK/kill.log" 2>&1 || true
  t0=$(date +%s)
  while health && [ $(( $(date +%s) - t0 )) -le $(( 3 * XFER_TIMEOUT )) ]; do sleep 1; done
  if health; then
    echo "gpu_check: FAIL: the rollout still SERVING $(( 3 * XFER_TIMEOUT )) s after the trainer died mid-push"; EXTRA_RC=1
  else
    echo "   the half-received push ended after $(( $(date +%s) - t0 )) s (NOT_SERVING: the weights are broken)"
    CUDA_VISIBLE_DEVICES=1 "$PY" -m tests.rollout.transfer_trainer --address "127.0.0.1:$RPORT" --model "$WORK/model" \
      --out "$WORK/good.safetensors" --mode all --device cuda --run-id gpu-check-kill >"$WORK/good.log" 2>&1 || true
    if health && [ "$(version)" = $((V0 + 1)) ]; then
      echo "   a good nccl push then served version $((V0 + 1)): recovered"
      CHECKED+=("a trainer killed mid-push: the nccl receive's deadline ended the push, a good push then served")
    else
      echo "gpu_check: FAIL: no recovery after the mid-push kill ($WORK/kill.log, $WORK/good.log, $WORK/rollout.log)"
      EXTRA_RC=1
    fi
  fi
else
  SKIPPED+=("a trainer killed mid-push (needs the nccl transfer: >= 2 GPUs)")
fi
if [ "$DEVICE" = cuda ] && [ "$NGPU" -eq 1 ]; then
  echo "== a rollout restart beside the trainer on the 1-GPU layout (${SIZING[*]})"
  nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader 2>/dev/null | sed 's/^/   GPU process before: /'
  kill -TERM "$RPID"; for _ in $(seq 1 120); do kill -0 "$RPID" 2>/dev/null || break; sleep 0.5; done
  start_rollout "$WORK/rollout-restart.log"
  wait_healthy "127.0.0.1:$RPORT" "$RPID" rollout-restart 300 && \
    CHECKED+=("a rollout restart beside the trainer's memory (1 GPU, ${SIZING[*]})")
else
  SKIPPED+=("a rollout restart on the 1-GPU layout (this machine has $NGPU GPU(s))")
fi
echo "== checked:"; for c in "${CHECKED[@]}"; do echo "   - $c"; done
[ "${#SKIPPED[@]}" -gt 0 ] && { echo "== not checked here:"; for c in "${SKIPPED[@]}"; do echo "   - $c"; done; }
TOTAL=$(( $(date +%s) - T_START ))
echo "== wall time $TOTAL s (target <= 480 s on one H200); logs in $WORK"
if [ "$DEVICE" = cuda ] && [ "$TOTAL" -gt 480 ]; then
  echo "gpu_check: WARNING: $TOTAL s is over the 480 s target (not a failure)"
fi
if [ "$CHECK_RC" -eq 0 ] && [ "$RUN_RC" -eq 0 ] && [ "$EXTRA_RC" -eq 0 ]; then echo "gpu_check: PASS"; exit 0; fi
echo "gpu_check: FAIL"; exit 1
