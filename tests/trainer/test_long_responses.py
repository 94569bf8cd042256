"""Long responses through the whole loop (issue 45 item 3): a random-init Qwen2 that never samples EOS
(forkrl/models/random_qwen2.py `no_eos`, 4096 positions) served by a real rollout service (vLLM), trained by the
shared trainer service through `clients/start_run.py` with micro-batches by tokens, the step-scope top-20% mask, the
soft overlong penalty and activation checkpointing; every response is 2048 tokens. Then the probe reads the run's
final checkpoint and samples 2048-token responses again (in process, forkrl's transformers sampler: one vLLM engine
in the test)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from forkrl.models.random_qwen2 import build_random_qwen2
from forkrl.probe import ProbeParams, run_probe
from forkrl.remote.rollout import RolloutClient
from tests.service_fixtures import REPO_ROOT, start_rollout_service

pytestmark = pytest.mark.slow

MAX_NEW = 2048
# 4 rows of 2048 response tokens + a countdown prompt (< 100 tokens) each: 3 rows fit in 8192 padded tokens, 4 do not
BUDGET = 8192


def test_a_run_with_2k_token_responses_then_the_probe(trainer: tuple[str, Path], tmp_path: Path) -> None:
    address, runs_root = trainer
    model = build_random_qwen2(tmp_path / "model", "tiny", no_eos=True, max_position_embeddings=2 * MAX_NEW)
    run_dir = tmp_path / "run"
    with start_rollout_service(model, seed=0, staging_dir=tmp_path / "staging", log_path=tmp_path / "rollout.log",
                               kv_cache_gib=1) as rollout:
        cmd = [sys.executable, str(REPO_ROOT / "clients" / "start_run.py"), "--model", str(model),
               "--rollout-addresses", rollout, "--trainer-address", address, "--run-dir", str(run_dir),
               "--num-steps", "2", "--save-every", "1", "--prompts-per-step", "2", "--group-size", "2",
               "--eval-prompts", "0", "--max-new-tokens", str(MAX_NEW), "--overlong-cache-len", "512",
               "--max-tokens-per-micro-batch", str(BUDGET), "--mask-scope", "step", "--entropy-top-frac", "0.2",
               "--activation-checkpointing", "--lr", "1e-5"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        with RolloutClient(rollout) as client:
            served = client.info().version
    assert served == 2, f"the rollout service serves version {served}, not the weights of step 2"

    train = [m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if m["kind"] == "train"]
    assert [m["step"] for m in train] == [1, 2]
    for m in train:
        # every response ran to the cap: 2 prompts x 2 samples x 2048 tokens, all truncated, all penalized in full
        assert m["response_len_mean"] == MAX_NEW and m["response_tokens"] == 4 * MAX_NEW, m
        assert m["truncated_frac"] == 1.0 and m["reward_mean"] == -1.0
        assert m["micro_batches"] == 2  # by tokens: 3 rows + 1 row under the budget
        assert m["kept_tokens"] == math.ceil(0.2 * 4 * MAX_NEW)  # one top-k over the step's tokens
        assert math.isfinite(m["loss"]) and m["n_updates"] == 1
    assert (run_dir / "checkpoints" / "final" / "model.safetensors").is_file()

    params = ProbeParams(checkpoint_root=str(run_dir / "checkpoints"), include_final=True, num_prompts=2,
                         num_samples=2, max_new_tokens=MAX_NEW, sampler="transformers", seed=0,
                         max_positions_per_group=2, bootstrap=0)
    summary = run_probe(params, tmp_path / "probe", device="cpu")
    (ck,) = summary["checkpoints"]
    assert "final" in ck["label"] and ck["n_trajectories"] == 4
    # every sampled response 2048 tokens, none finished (no EOS), entropies and gradients over all of them
    assert ck["n_response_tokens"] == 4 * MAX_NEW and ck["finished_frac"] == 0.0, ck
    assert ck["n_nonfinite_tokens"] == 0 and summary["n_records"] > 0
