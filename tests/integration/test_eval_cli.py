"""`python -m forkrl.eval` on the committed model over a built-in-task file (countdown problems written as JSONL),
with in-process vLLM: its avg@n and pass@k equal a count by hand over the samples it wrote, each re-graded here
with the countdown verifier itself; two checkpoints with the same weights and seeds give the same numbers."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from forkrl.data.countdown import check_solution, parse_prompt
from forkrl.data.tasks import make_split
from tests.service_fixtures import REPO_ROOT

pytestmark = pytest.mark.slow


def test_eval_cli_counts_match_a_hand_count(tmp_path: Path, tiny_model_dir: Path) -> None:
    bench = tmp_path / "countdown.jsonl"
    problems = make_split("countdown", "eval", 6, seed=1)
    bench.write_text("".join(json.dumps({"prompt": p.prompt, "answer": p.answer}) + "\n" for p in problems))
    ckpt = shutil.copytree(tiny_model_dir, tmp_path / "step_000005")  # the same weights, as a step-5 checkpoint
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 5}))
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "forkrl.eval", "--model", str(tiny_model_dir), "--checkpoints", str(ckpt),
         "--benchmarks", str(bench), "--reward", "countdown", "--num-samples", "4", "--pass-k", "1,2,4",
         "--max-new-tokens", "16", "--output-dir", str(out)],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "avg@4 (%)" in proc.stdout and "pass@4 (%)" in proc.stdout
    summary = json.loads((out / "eval_results.json").read_text())
    assert [(c["label"], c["step"]) for c in summary["checkpoints"]] == [("base", 0), ("step_000005", 5)]

    # the hand count: every sample of samples.jsonl graded by the countdown verifier, c per problem
    correct: dict[tuple[str, int], list[bool]] = defaultdict(list)
    for line in (out / "samples.jsonl").read_text().splitlines():
        s = json.loads(line)
        numbers, target = parse_prompt(problems[s["index"]].prompt)
        correct[(s["checkpoint"], s["index"])].append(check_solution(s["text"], numbers, target) == "correct")
        assert s["reward"] == (1.0 if correct[(s["checkpoint"], s["index"])][-1] else 0.0)
    for label in ("base", "step_000005"):
        counts = [sum(correct[(label, i)]) for i in range(6)]
        assert all(len(correct[(label, i)]) == 4 for i in range(6))
        row = summary["results"]["countdown"][label]
        assert row["n_problems"] == 6 and row["n_skipped"] == 0
        assert row["avg@4"] == pytest.approx(sum(c / 4 for c in counts) / 6, abs=1e-12)
        for k in (1, 2, 4):
            by_hand = sum(1 - math.comb(4 - c, k) / math.comb(4, k) for c in counts) / 6
            assert row[f"pass@{k}"] == pytest.approx(by_hand, abs=1e-12), k
        records = [r for r in summary["problems"] if r["checkpoint"] == label]
        assert [r["correct"] for r in records] == counts
    # same weights, same seeds: the same samples, the same numbers
    assert summary["results"]["countdown"]["base"] == summary["results"]["countdown"]["step_000005"]
    assert (out / "avg_vs_step.png").read_bytes()[:4] == b"\x89PNG"


def _recount(summary: dict, problems: list, label: str, n: int) -> None:
    """The rows of `label` equal a count by hand: every sample re-graded with the countdown verifier."""
    rows = [r for r in summary["problems"] if r["checkpoint"] == label]
    counts = []
    for r in rows:
        numbers, target = parse_prompt(problems[r["index"]].prompt)
        texts = r["texts"]
        assert len(texts) == n
        counts.append(sum(check_solution(t, numbers, target) == "correct" for t in texts))
        assert r["correct"] == counts[-1]
    row = summary["results"]["countdown"][label]
    assert row[f"avg@{n}"] == pytest.approx(sum(c / n for c in counts) / len(counts), abs=1e-12)
    for k in range(1, n + 1):
        by_hand = sum(1 - math.comb(n - c, k) / math.comb(n, k) for c in counts) / len(counts)
        assert row[f"pass@{k}"] == pytest.approx(by_hand, abs=1e-12), k


def test_eval_with_the_transformers_sampler_counts_alike(tmp_path: Path, tiny_model_dir: Path) -> None:
    from forkrl.eval import EvalParams, run_eval

    bench = tmp_path / "countdown.jsonl"
    problems = make_split("countdown", "eval", 5, seed=4)
    bench.write_text("".join(json.dumps({"prompt": p.prompt, "answer": p.answer}) + "\n" for p in problems))
    summary = run_eval(EvalParams(model=str(tiny_model_dir), benchmarks=[str(bench)], reward="countdown",
                                  num_samples=3, pass_k=[1, 2, 3], max_new_tokens=16, sampler="transformers"),
                       tmp_path / "out", device="cpu", progress=lambda msg: None)
    texts = {}
    for line in (tmp_path / "out" / "samples.jsonl").read_text().splitlines():
        s = json.loads(line)
        texts.setdefault(s["index"], []).append(s["text"])
    for r in summary["problems"]:
        r["texts"] = texts[r["index"]]
    _recount(summary, problems, "base", 3)


def _run_on_a_builtin_task(tmp_path: Path, tiny_model_dir: Path, **settings: object) -> Path:
    """A run directory as the trainer writes one for a built-in task (config.json names no dataset), with the
    committed model as its step-2 checkpoint."""
    run = tmp_path / "run"
    ckpt = shutil.copytree(tiny_model_dir, run / "checkpoints" / "step_000002")
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 2}))
    (run / "config.json").write_text(json.dumps({"task": "", "dataset": "", "eval_dataset": [], "reward": "",
                                                 "prompt_format": "raw", **settings}))
    return run / "checkpoints"


def test_a_run_on_a_builtin_task_evaluates_on_its_held_out_split(tmp_path: Path, tiny_model_dir: Path) -> None:
    """No --benchmarks: a run whose config names a built-in task (here the default, countdown) is evaluated on that
    task's eval split, the problems the run's own evaluation drew (its eval_prompts and seed), graded by the task's
    reward; avg@n and pass@k equal a hand count with the countdown verifier, and the plot is written."""
    from forkrl.data.datasets import load_eval_sets
    from forkrl.eval import EvalParams, plan_eval, run_eval

    root = _run_on_a_builtin_task(tmp_path, tiny_model_dir, eval_prompts=4, seed=7, max_new_tokens=16)
    params = EvalParams(checkpoint_root=str(root), steps=[2], num_samples=3, pass_k=[1, 2, 3], sampler="transformers")
    plan = plan_eval(params)
    (_, drawn), = load_eval_sets("countdown", None, [], 4, 7)
    assert [b.name for b in plan.benchmarks] == ["countdown"] and plan.reward == "countdown"
    assert [(q.prompt, q.answer) for q in plan.benchmarks[0].problems] == [(q.prompt, q.answer) for q in drawn]
    summary = run_eval(params, tmp_path / "out", device="cpu", progress=lambda msg: None)
    texts: dict[int, list[str]] = {}
    for line in (tmp_path / "out" / "samples.jsonl").read_text().splitlines():
        s = json.loads(line)
        texts.setdefault(s["index"], []).append(s["text"])
    for r in summary["problems"]:
        r["texts"] = texts[r["index"]]
    _recount(summary, list(drawn), "step_000002", 3)
    assert (tmp_path / "out" / "avg_vs_step.png").read_bytes()[:4] == b"\x89PNG"


def test_a_builtin_task_is_a_benchmark_by_name(tmp_path: Path, tiny_model_dir: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """--benchmarks countdown (no such path): the task's eval split, its own reward; a path of that name is read."""
    from forkrl.eval import EvalParams, plan_eval
    from forkrl.eval.run import EvalInputError

    plan = plan_eval(EvalParams(model=str(tiny_model_dir), benchmarks=["countdown"], max_problems=5))
    assert plan.reward == "countdown" and len(plan.benchmarks[0].problems) == 5
    assert [q.prompt for q in plan.benchmarks[0].problems] == [q.prompt for q in make_split("countdown", "eval", 5)]
    with pytest.raises(EvalInputError, match="built-in task"):
        plan_eval(EvalParams(model=str(tiny_model_dir)))
    monkeypatch.chdir(tmp_path)
    Path("countdown").write_text('{"prompt": "1 2 3->6:", "answer": "6"}\n')  # a path of that name is read
    with pytest.raises(EvalInputError, match="dataset countdown: unknown kind"):
        plan_eval(EvalParams(model=str(tiny_model_dir), benchmarks=["countdown"]))
