"""bench/bench_peers.py (forkrl against TRL's GRPOTrainer): the report's arithmetic and goals, TRL's batch settings,
and the smoke mode end to end (real services, real TRL). TRL is the optional extra `bench`: without it the tests
that need it skip, saying so. No measured number is asserted: only structure, finiteness and exact arithmetic."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))

from bench import bench_peers  # noqa: E402

needs_trl = pytest.mark.skipif(bench_peers.trl_version() is None,
                               reason="TRL is not installed (the optional extra `bench`: pip install -e '.[bench]')")


def _run(arm: str, seed: int, step_s: float, t1: float) -> dict:
    steps = {"step_s": [step_s] * 3, "generate_s": [step_s / 2] * 3, "train_s": [step_s / 4] * 3,
             "push_s": [0.0 if arm == "trl" else step_s / 8] * 3}
    return {"size": "tiny", "arm": arm, "seed": seed, "shape": {"steps": 3, "prompts": 32, "group": 8, "tokens": 16},
            "means": bench_peers.step_means(steps, 0), "eval_after": {"t1": t1, "greedy": t1}}


def test_step_means_leave_out_the_warmup_steps_unless_the_run_is_too_short():
    steps = {"step_s": [10.0, 1.0, 2.0, 3.0], "generate_s": [5.0, 0.5, 0.5, 0.5]}
    assert bench_peers.step_means(steps, 1) == {"step_s": 2.0, "generate_s": 0.5}
    assert bench_peers.step_means(steps, 4) == {"step_s": 4.0, "generate_s": 1.625}  # 4 steps, warmup 4: all


def test_report_ratios_goals_and_learning_verdicts():
    # sync 1.0 vs TRL 2.0 s/step: ratio 0.50 (goal 1.0 met); async 1.5: ratio 0.75 (goal 0.6 missed)
    results = [_run("sync", 0, 1.0, 0.30), _run("async", 0, 1.5, 0.30), _run("trl", 0, 2.0, 0.30),
               _run("sync", 1, 1.0, 0.40), _run("async", 1, 1.5, 0.90), _run("trl", 1, 2.0, 0.40)]
    text = "\n".join(bench_peers.report(results, {"tiny": {"t1": 0.2, "greedy": 0.2}}))
    assert "forkrl sync / TRL: 0.50  (goal <= 1.0: met)" in text
    assert "forkrl async k=1 / TRL: 0.75  (goal <= 0.6: missed)" in text
    # a missed goal says what bounds it, from the measured parts (generation 1.5 / 2, training 1.5 / 4, push 1.5 / 8);
    # a met goal says nothing more
    assert ("what bounds it: generation 0.750 and training 0.375 s/step overlap on the same cores (push 0.188); "
            "the step is 1.500") in text
    assert text.count("what bounds it") == 1
    for label in bench_peers.LABELS.values():
        assert label in text
    # gains over 0.2: sync (0.1, 0.2) == TRL (0.1, 0.2): difference 0; async (0.1, 0.7): mean 0.4 - 0.15 = +0.25,
    # within the larger sd, that of (0.1, 0.7) = sqrt(2 * 0.3^2) = 0.424
    assert "forkrl sync - TRL: gain difference +0.000" in text
    assert "forkrl async k=1 - TRL: gain difference +0.250, the seeds' spread (larger sd) 0.424" in text
    # an update longer than the goal allows bounds the step by itself: async 4.0 s/step, update 1.0 > 0.6 x 1.5
    slow = [_run("async", 0, 4.0, 0.3), _run("trl", 0, 1.5, 0.3)]
    text = "\n".join(bench_peers.report(slow, {"tiny": {"t1": 0.2, "greedy": 0.2}}))
    assert "what bounds it: the trainer's update alone takes 1.000 s/step in this arm = 0.67x TRL's whole step" in text


def test_report_gives_the_per_seed_ratios_and_calls_a_miss_inside_their_spread_one():
    # seed by seed sync / TRL: 1.1 / 1.0 = 1.10, 0.9 / 1.0 = 0.90, 1.1 / 1.0 = 1.10: mean 1.033, sd 0.115; the ratio of
    # the means 3.1 / 3.0 = 1.033 misses the goal 1.0 by 0.03 < 0.115; async 2.0 / 1.0 each seed: sd 0, plainly missed
    results = []
    for seed, sync_s in enumerate((1.1, 0.9, 1.1)):
        results += [_run("sync", seed, sync_s, 0.3), _run("async", seed, 2.0, 0.3), _run("trl", seed, 1.0, 0.3)]
    text = "\n".join(bench_peers.report(results, {"tiny": {"t1": 0.2, "greedy": 0.2}}))
    assert ("forkrl sync / TRL: 1.03  (goal <= 1.0: missed by 0.03, less than the per-seed ratios' sd 0.12: level "
            "with the goal within this machine's run-to-run spread)") in text
    assert "of its seed): 1.10 / 0.90 / 1.10, mean 1.03 ± 0.12" in text
    assert "forkrl async k=1 / TRL: 2.00  (goal <= 0.6: missed)" in text
    assert "of its seed): 2.00 / 2.00 / 2.00, mean 2.00 ± 0.00" in text
    # a seed without its TRL run is left out of the pairs
    assert bench_peers.seed_ratios(results[:-1], "sync") == pytest.approx([1.1, 0.9])


def test_smoke_forces_two_steps_and_a_small_eval(tmp_path: Path):
    a = bench_peers.parse_args(["--smoke", "--arms", "sync", "async", "--data-dir", str(tmp_path)])
    assert (a.num_steps, a.big_steps, a.eval_prompts, a.big_shape) == (2, 2, 32, [8, 2, 8])
    assert bench_peers.shape_of(a, "0.5b") == {"prompts": 8, "group": 2, "tokens": 8, "steps": 2}
    with pytest.raises(SystemExit):
        bench_peers.parse_args(["--top-frac", "0", "--arms", "sync"])


def test_the_trl_arm_sees_forkrls_prompts_in_forkrls_order():
    from forkrl.data.datasets import load_problems
    from forkrl.data.order import DataOrder

    pool = list(load_problems("countdown", None, "train", 20000, 3))
    order = DataOrder(pool, 3)
    want = [p.prompt for p in order.take(32) + order.take(32)]  # the trainer's first two steps, seed 3
    assert [p.prompt for p in bench_peers.train_prompts(3, 64)] == want


@needs_trl
def test_trl_config_one_update_per_batch_in_micro_batches(tmp_path: Path):
    from bench.peers_trl import trl_config

    shape = {"prompts": 32, "group": 8, "tokens": 16}
    c = trl_config(tmp_path, shape, steps=5, lr=3e-4, seed=0, device="cpu", top_frac=0.2, micro_batch=64)
    # 256 samples per step = 4 micro-batches of 64, generated once, one optimizer step
    assert (c.per_device_train_batch_size, c.gradient_accumulation_steps, c.steps_per_generation) == (64, 4, 4)
    assert (c.generation_batch_size, c.num_generations, c.num_iterations) == (256, 8, 1)
    assert (c.loss_type, c.top_entropy_quantile, c.beta, c.max_completion_length) == ("grpo", 0.2, 0.0, 16)
    assert (c.shuffle_dataset, c.bf16, c.gradient_checkpointing, c.lr_scheduler_type) == (False, False, False,
                                                                                          "constant")
    small = trl_config(tmp_path, {"prompts": 8, "group": 2, "tokens": 8}, steps=2, lr=3e-4, seed=0, device="cpu",
                       top_frac=0.2, micro_batch=64)
    assert (small.per_device_train_batch_size, small.gradient_accumulation_steps) == (16, 1)


@pytest.mark.slow
@needs_trl
def test_smoke_runs_every_arm_two_steps_and_prints_every_arm(tmp_path: Path):
    out = tmp_path / "results.json"
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "bench" / "bench_peers.py"), "--smoke", "--sizes", "tiny",
                           "--data-dir", str(tmp_path), "--out", str(out)],
                          capture_output=True, text=True, timeout=1800, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert sorted(r["arm"] for r in results) == ["async", "sync", "trl"]
    for r in results:
        assert all(len(v) == 2 for v in r["steps"].values()), (r["arm"], r["steps"])  # 2 steps each
        for key, values in r["steps"].items():
            assert all(math.isfinite(v) and (v >= 0 if key == "push_s" else v > 0) for v in values), (r["arm"], key)
        assert 0 <= r["eval_after"]["t1"] <= 1 and 0 <= r["eval_after"]["greedy"] <= 1  # its final model, evaluated
        assert r["run_dir"] is None and r["final"] is None
    # each run's directory (checkpoints) is deleted once evaluated (without --keep-runs): nothing is left
    assert list((tmp_path / "runs").iterdir()) == []
    for label in bench_peers.LABELS.values():
        assert label in proc.stdout
    assert "forkrl sync / TRL:" in proc.stdout and "forkrl async k=1 / TRL:" in proc.stdout
    assert "eval before (initial model, every arm)" in proc.stdout
