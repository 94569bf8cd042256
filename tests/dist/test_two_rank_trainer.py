"""The trainer service on 2 ranks (torchrun, gloo, FSDP2) runs a 3-step masked run through
clients/start_run.py, its first step equals a 1-rank trainer's on the same samples, and `--resume` continues
it on the same 2 ranks from its sharded checkpoint (step 4). Then the recipe's mechanics through the same
client: 3 steps with `--mini-batch-prompts 4 --ppo-epochs 2` (4 updates a step, pi_old from before the first),
TIS and the dual clip, whose first step again equals the 1-rank trainer's (within the per-update bound of
tests/dist/test_dp_equals_one_rank.py: u REL for u updates).

Both trainers train the embedded tiny model against one real rollout service. Rank 0 serves gRPC, talks to
the rollout service and writes metrics and checkpoints; rank 1 follows its commands
(forkrl/training/ranks.py). Step 1 samples the same trajectories in both runs (same initial weights, same
seeds), so its step metrics agree to float32 rounding (REL, the bound of tests/dist/test_dp_equals_one_rank.py);
later steps sample from weights that differ by rounding and are not compared.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from forkrl.weights.checkpoint import read_state
from tests.service_fixtures import start_rollout_service, start_trainer_service
from tests.trainer.helpers import metric_lines, start_run_argv, trainer_rollout_logp_ceiling

pytestmark = [pytest.mark.slow, pytest.mark.isolated]
REL = 1e-5
STEP_KEYS = ("loss", "pg_loss", "grad_norm", "kept_frac", "entropy_mean", "entropy_kept_mean", "mask_threshold",
             "logp_delta_mean", "clip_frac_low", "clip_frac_high")


def _run(address: str, rollout: str, model: Path, run_dir: Path, *extra: str,
         eval_prompts: int = 0) -> subprocess.CompletedProcess:
    cmd = start_run_argv(
        "--entropy-top-frac", "0.2", "--num-steps", "3", "--prompts-per-step", "8", "--group-size", "4",
        "--eval-prompts", str(eval_prompts), "--micro-batch-size", "16", "--save-every", "3", "--run-dir", str(run_dir),
        "--model", str(model), "--rollout-addresses", rollout, "--trainer-address", address, *extra)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)


RECIPE = ("--mini-batch-prompts", "4", "--ppo-epochs", "2", "--loss", "dapo", "--tis-cap", "2", "--dual-clip-c", "2",
          "--kl-pass")


def test_a_two_rank_trainer_runs_and_its_first_step_equals_one_rank(tiny_model_dir: Path, tmp_path: Path) -> None:
    ceiling = trainer_rollout_logp_ceiling(tiny_model_dir)
    with start_rollout_service(tiny_model_dir, seed=0, staging_dir=tmp_path / "staging",
                               log_path=tmp_path / "rollout.log") as rollout:
        with start_trainer_service(tmp_path / "runs1", log_path=tmp_path / "trainer1.log") as one:
            p1 = _run(one, rollout, tiny_model_dir, tmp_path / "runs1" / "one")
            r1 = _run(one, rollout, tiny_model_dir, tmp_path / "runs1" / "recipe", *RECIPE, eval_prompts=4)
        assert p1.returncode == 0, p1.stderr[-3000:]
        assert r1.returncode == 0, r1.stderr[-3000:]
        with start_trainer_service(tmp_path / "runs2", log_path=tmp_path / "trainer2.log", ranks=2) as two:
            p2 = _run(two, rollout, tiny_model_dir, tmp_path / "runs2" / "two")
            assert p2.returncode == 0, p2.stderr[-3000:] + (tmp_path / "trainer2.log").read_text()[-4000:]
            state3 = read_state(tmp_path / "runs2" / "two" / "checkpoints" / "final")
            # --resume on the same 2 ranks: every rank reads its AdamW shards back (DCP) and trains step 4
            p3 = _run(two, rollout, tiny_model_dir, tmp_path / "runs2" / "two", "--resume", "--num-steps", "4")
            assert p3.returncode == 0, p3.stderr[-3000:] + (tmp_path / "trainer2.log").read_text()[-4000:]
            r2 = _run(two, rollout, tiny_model_dir, tmp_path / "runs2" / "recipe", *RECIPE, eval_prompts=4)
            assert r2.returncode == 0, r2.stderr[-3000:] + (tmp_path / "trainer2.log").read_text()[-4000:]
    assert "succeeded" in p2.stdout and "succeeded" in p3.stdout and "succeeded" in r2.stdout
    _check_the_recipe_run(tmp_path / "runs1" / "recipe", tmp_path / "runs2" / "recipe", ceiling)
    _check_the_report_sample(tmp_path / "runs1" / "recipe", tmp_path / "runs2" / "recipe")
    assert "rank 1: run started" in (tmp_path / "trainer2.log").read_text()  # rank 1 followed rank 0

    lines1, lines2 = metric_lines(tmp_path / "runs1" / "one"), metric_lines(tmp_path / "runs2" / "two")
    assert [m["step"] for m in lines2] == [1, 2, 3, 4]
    for m in lines2:
        # 32 trajectories in micro-batches of 16: each global micro-batch keeps exactly ceil(N_j / 5)
        # tokens over both ranks, so the step keeps between ceil(N/5) and ceil(N/5) + 1
        n = int(m["response_tokens"])
        assert m["micro_batches"] == 2
        assert max(1, -(-n // 5)) <= m["kept_tokens"] <= max(1, -(-n // 5)) + 1
        assert m["logp_delta_max"] <= ceiling  # the rollout served exactly the weights gathered from the shards
    a, b = lines1[0], lines2[0]
    assert (a["response_tokens"], a["kept_tokens"]) == (b["response_tokens"], b["kept_tokens"])
    for k in STEP_KEYS:
        assert abs(a[k] - b[k]) <= REL * max(1.0, abs(a[k])), (k, a[k], b[k])

    # the 3-step run's checkpoint: HF weights gathered on rank 0, AdamW state in 2 DCP shards
    assert state3["step"] == 3 and state3["world_size"] == 2 and state3["optimizer_saved"] is True
    assert state3["optimizer"]["format"] == "dcp"
    final = tmp_path / "runs2" / "two" / "checkpoints" / "final"
    state = read_state(final)
    assert state["step"] == 4 and state["world_size"] == 2 and state["data_cursor"] == 4 * 8
    assert sorted(p.name for p in (final / state["optimizer"]["dir"]).glob("*.distcp")) == \
        ["__0_0.distcp", "__1_0.distcp"]
    assert "from step 3" in p3.stdout + (tmp_path / "trainer2.log").read_text()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def _check_the_recipe_run(one: Path, two: Path, ceiling: float) -> None:
    lines1, lines2 = metric_lines(one), metric_lines(two)
    assert [m["step"] for m in lines2] == [1, 2, 3]
    for m in lines2:
        # 2 mini-batches of 4 prompts x 4 samples (one micro-batch of 16 each), 2 epochs: 4 updates, each
        # micro-batch keeping ceil(N_j / 5) over both ranks, every token counted once per epoch
        n = int(m["response_tokens"])
        assert (m["n_updates"], m["skipped_updates"], m["micro_batches"]) == (4, 0, 2)
        assert 2 * max(1, -(-n // 2 // 5)) <= m["kept_tokens"] <= 2 * (-(-n // 2 // 5) + 1)
        assert m["logp_delta_max"] <= ceiling and "tis_weight_mean" in m and "dual_clip_frac" in m
    a, b = lines1[0], lines2[0]
    assert (a["response_tokens"], a["kept_tokens"]) == (b["response_tokens"], b["kept_tokens"])
    for k in (*STEP_KEYS, "approx_kl", "ratio_max", "tis_weight_mean"):
        assert abs(a[k] - b[k]) <= 4 * REL * max(1.0, abs(a[k])), (k, a[k], b[k])
    final = two / "checkpoints" / "final"
    assert read_state(final)["step"] == 3 and read_state(final)["world_size"] == 2


def _check_the_report_sample(one: Path, two: Path) -> None:
    """The run report's eval sample (forkrl/report/record.py) on 2 ranks: every rank joined the teacher-forced
    forwards of the sharded policy ("tokens"), and at step 0 (the same initial weights, the same eval seeds) they
    give the 1-rank trainer's entropies and log-probs within float32 rounding."""
    import json
    import math

    def sample(run: Path, step: int) -> list[dict]:
        lines = [json.loads(s) for s in (run / "eval_samples" / f"step_{step:06d}.jsonl").read_text().splitlines()]
        return [r for r in lines if r["kind"] == "response"]

    for run in (one, two):
        assert sorted(p.name for p in (run / "eval_samples").glob("*.jsonl")) == ["step_000000.jsonl",
                                                                                  "step_000003.jsonl"]
        assert (run / "report.html").is_file()
    a, b = sample(one, 0), sample(two, 0)
    assert [r["tokens"] for r in a] == [r["tokens"] for r in b] and len(a) == 4
    for ra, rb in zip(a, b, strict=True):
        assert sum(rb["kept"]) == max(1, math.ceil(0.2 * rb["n_tokens"]))
        for x, y in zip(ra["entropy"] + ra["logp"], rb["entropy"] + rb["logp"], strict=True):
            assert abs(x - y) <= REL * max(1.0, abs(x)), (x, y)
