"""The benchmark eval without an engine: pass@k against brute-force enumeration, maj@k and avg@n on hand-counted
samples, the parameters' rules, and the plan's defaults from the run (forkrl/eval/)."""

from __future__ import annotations

import itertools
import json
import shutil
from fractions import Fraction
from pathlib import Path

import pytest
from pydantic import ValidationError

from forkrl.eval.metrics import ProblemResult, aggregate, maj_at_k, pass_at_k
from forkrl.eval.params import EvalParams
from forkrl.eval.run import EvalInputError, plan_eval


def _brute_pass_at_k(correct: list[bool], k: int) -> Fraction:
    """The share of all k-subsets of the samples that hold a correct one (what the estimator is unbiased for)."""
    subsets = list(itertools.combinations(correct, k))
    return Fraction(sum(any(s) for s in subsets), len(subsets))


@pytest.mark.parametrize("n,c", [(1, 0), (1, 1), (4, 1), (5, 2), (8, 3), (10, 0), (10, 10), (12, 5), (16, 1)])
def test_pass_at_k_is_the_unbiased_estimator(n, c):
    correct = [True] * c + [False] * (n - c)
    for k in range(1, n + 1):
        exact = _brute_pass_at_k(correct, k)
        assert abs(pass_at_k(n, c, k) - exact) <= 2**-50, (n, c, k)
        # the closed form, written out: 1 - C(n-c, k) / C(n, k)
        from math import comb

        assert exact == 1 - Fraction(comb(n - c, k), comb(n, k))
    assert pass_at_k(n, c, 1) == pytest.approx(c / n, abs=2**-50)  # pass@1 is the mean accuracy
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(n, c, n + 1)


def test_maj_at_k_votes_on_the_first_k_answers():
    answers = ["12", "14", "12", None, "14", "14"]
    correct = [True, False, True, False, False, False]
    assert maj_at_k(answers, correct, 1) == 1.0  # "12"
    assert maj_at_k(answers, correct, 2) == 1.0  # a tie: "12" reached the count first
    assert maj_at_k(answers, correct, 4) == 1.0  # "12" twice, None does not vote
    assert maj_at_k(answers, correct, 6) == 0.0  # "14" three times
    assert maj_at_k([None, None], [False, False], 2) == 0.0


def test_a_benchmark_row_is_the_mean_over_its_gradable_problems():
    # hand count: problem A 2 of 4 correct, B 0 of 4, C 4 of 4; D has an ungradable gold (every reward None)
    rows = [
        ProblemResult([1.0, 0.0, 1.0, 0.0], ["5", "6", "5", "6"], [3, 4, 3, 4], [False, False, False, True]),
        ProblemResult([0.0] * 4, ["1", None, "2", "1"], [2, 2, 2, 2], [False] * 4),
        ProblemResult([1.0] * 4, ["7"] * 4, [5, 5, 5, 5], [False] * 4),
        ProblemResult([None] * 4, [None] * 4, [1, 1, 1, 1], [False] * 4),
    ]
    row = aggregate(rows, [1, 2, 4], with_maj=True)
    assert (row["n_problems"], row["n_skipped"]) == (3, 1)
    assert row["avg@4"] == pytest.approx((2 / 4 + 0 + 1) / 3, abs=1e-15)
    # pass@2: A 1 - C(2,2)/C(4,2) = 5/6, B 0, C 1
    assert row["pass@2"] == pytest.approx((5 / 6 + 0 + 1) / 3, abs=1e-15)
    assert row["pass@4"] == pytest.approx(2 / 3, abs=1e-15)
    # maj@4: A ties "5"/"6", "5" first -> correct; B "1" -> wrong; C -> correct
    assert row["maj@4"] == pytest.approx(2 / 3, abs=1e-15)
    assert row["response_len_mean"] == 46 / 16 and row["truncated_frac"] == 1 / 16  # every problem's samples


def test_params_need_something_to_evaluate_and_one_checkpoint_for_the_rollout_sampler():
    assert EvalParams(model="m").num_samples == 16 and EvalParams(model="m").pass_k == [1, 4, 16]
    for kw in (dict(), dict(steps=[1]), dict(model="m", sampler="rollout"),
               dict(model="m", checkpoints=["c"], sampler="rollout", rollout_address="h:1"),
               dict(model="m", rollout_address="h:1"), dict(model="m", sampler="transformers", top_p=0.7),
               dict(model="m", pass_k=[0])):
        with pytest.raises(ValidationError):
            EvalParams(**kw)
    assert EvalParams(checkpoints=["c"], sampler="rollout", rollout_address="h:1").sampler == "rollout"


def _run(tmp_path: Path, tiny_model_dir: Path, config: dict) -> Path:
    """A run dir shaped like a trainer's: config.json and checkpoints/{step_000005,final} (the tiny model)."""
    run = tmp_path / "run"
    for name, step in (("step_000005", 5), ("final", 9)):
        ckpt = shutil.copytree(tiny_model_dir, run / "checkpoints" / name)
        (ckpt / "trainer_state.json").write_text(json.dumps({"step": step}))
    (run / "config.json").write_text(json.dumps(config))
    return run


@pytest.mark.slow  # copies of the model, the datasets cache
def test_the_plan_takes_its_defaults_from_the_runs_config(tmp_path, tiny_model_dir):
    bench = tmp_path / "bench.jsonl"
    bench.write_text("".join(json.dumps({"problem": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(5)))
    run = _run(tmp_path, tiny_model_dir, {"reward": "exact_match", "temperature": 0.7, "max_new_tokens": 11,
                                          "prompt_format": "raw", "eval_dataset": [str(bench)]})
    plan = plan_eval(EvalParams(checkpoint_root=str(run / "checkpoints"), steps=[5], include_final=True,
                                model=str(tiny_model_dir), num_samples=4))
    assert [(c.label, c.step) for c in plan.checkpoints] == [("base", 0), ("step_000005", 5), ("final", 9)]
    assert (plan.reward, plan.temperature, plan.max_new_tokens, plan.prompt_format) == ("exact_match", 0.7, 11, "raw")
    assert [(b.name, len(b.problems)) for b in plan.benchmarks] == [("bench", 5)]
    assert plan.ks == [1, 4] and "pass_k [16] > num_samples 4" in plan.notes[0]
    assert plan.run_config == str((run / "config.json").resolve())
    # flags win over the run's settings; max_problems cuts each benchmark
    plan = plan_eval(EvalParams(checkpoint_root=str(run / "checkpoints"), include_final=True, temperature=1.0,
                                reward="math_verify", max_problems=2, benchmarks=[str(bench), str(bench)]))
    assert (plan.reward, plan.temperature) == ("math_verify", 1.0)
    assert [(b.name, len(b.problems)) for b in plan.benchmarks] == [("bench", 2), ("bench-2", 2)]
    # a recipe (TOML) works as the run's settings too
    recipe = tmp_path / "r.toml"
    recipe.write_text(f'prompt_format = "dapo_plain"\nmax_new_tokens = 7\neval_dataset = ["{bench}"]\n')
    plan = plan_eval(EvalParams(model=str(tiny_model_dir), run_config=str(recipe)))
    assert (plan.prompt_format, plan.max_new_tokens, plan.reward) == ("dapo_plain", 7, "math_verify")


@pytest.mark.slow  # the tokenizer's chat template is read
def test_the_plan_refuses_before_any_model_is_loaded(tmp_path, tiny_model_dir):
    bench = tmp_path / "b.jsonl"
    bench.write_text(json.dumps({"problem": "1+1=", "answer": "2"}) + "\n" + json.dumps({"problem": "x"}) + "\n")
    with pytest.raises(EvalInputError, match=r"b\.jsonl:2: no answer field"):
        plan_eval(EvalParams(model=str(tiny_model_dir), benchmarks=[str(bench)]))
    bench.write_text(json.dumps({"problem": "1+1=", "answer": "2"}) + "\n")
    with pytest.raises(EvalInputError, match="no benchmarks"):
        plan_eval(EvalParams(model=str(tiny_model_dir)))
    with pytest.raises(EvalInputError, match="has no chat template"):  # the committed model has none
        plan_eval(EvalParams(model=str(tiny_model_dir), benchmarks=[str(bench)], prompt_format="chat"))
    with pytest.raises(EvalInputError, match="asks for the answer on a last 'Answer:' line"):
        plan_eval(EvalParams(model=str(tiny_model_dir), benchmarks=[str(bench)], prompt_format="dapo_plain",
                             reward="countdown"))
