"""The built-in synthetic tasks: determinism, disjoint splits, reference solutions, answer extraction."""

from collections import Counter

import pytest

from forkrl.data.tasks import DEFAULT_TASK, TASKS, Problem, extract_answer, get_task, make_split, split_of


def test_default_task_is_countdown():
    assert DEFAULT_TASK == "countdown"
    assert DEFAULT_TASK in TASKS


def test_eval_split_is_pinned():
    # the eval set must not drift between versions, or accuracies stop being comparable
    assert [p.prompt for p in make_split("sum3", "eval", 4, seed=0)] == [
        "0+9+58=",
        "2+0+5=",
        "0+1+25=",
        "2+2+95=",
    ]
    assert [p.answer for p in make_split("sum3", "eval", 4, seed=0)] == ["67", "7", "26", "99"]
    assert [p.prompt for p in make_split("add2", "eval", 3, seed=0)] == ["12+93=", "75+95=", "51+62="]


@pytest.mark.parametrize("task", sorted(TASKS))
def test_make_split_is_deterministic_and_seeded(task):
    a = make_split(task, "train", 200, seed=3)
    assert a == make_split(task, "train", 200, seed=3)
    assert [p.prompt for p in a] != [p.prompt for p in make_split(task, "train", 200, seed=4)]
    # a longer split starts with the shorter one
    assert make_split(task, "train", 300, seed=3)[:200] == a
    assert len(a) == 200 and all(isinstance(p, Problem) for p in a)


@pytest.mark.parametrize("task", sorted(TASKS))
def test_splits_are_disjoint(task):
    train = {p.prompt for p in make_split(task, "train", 20000, seed=0)}
    evals = {p.prompt for seed in (0, 1) for p in make_split(task, "eval", 1000, seed=seed)}
    assert not train & evals
    assert all(split_of(task, prompt) == "train" for prompt in train)
    assert all(split_of(task, prompt) == "eval" for prompt in evals)


def test_eval_bucket_is_about_a_tenth():
    import random

    rng = random.Random(0)
    prompts = {get_task("sum3").sample(rng).prompt for _ in range(20000)}
    share = sum(split_of("sum3", p) == "eval" for p in prompts) / len(prompts)
    assert 0.08 < share < 0.12


def test_sum3_reference_completions_are_right():
    for p in make_split("sum3", "train", 3000, seed=0) + make_split("sum3", "eval", 500, seed=0):
        a, b, c = p.meta["operands"]
        assert p.prompt == f"{a}+{b}+{c}="
        assert p.meta["completion"] == f"{a + b}+{c}={a + b + c}"
        assert p.answer == str(a + b + c)
        assert extract_answer(p.meta["completion"]) == p.answer
        # the completion and EOS fit the task's generation limit
        assert len(p.meta["completion"]) + 1 <= TASKS["sum3"].max_new_tokens


def test_sum3_max_new_tokens_covers_the_worst_case():
    assert len("198+99=297") + 1 == TASKS["sum3"].max_new_tokens
    assert len("198") + 1 == TASKS["add2"].max_new_tokens


def test_sum3_difficulty_is_mixed():
    problems = make_split("sum3", "train", 4000, seed=0)
    carries = Counter(min(p.meta["carries"], 2) for p in problems)
    # easy (no carry), medium and hard problems all appear in quantity
    assert all(carries[k] > 0.1 * len(problems) for k in (0, 1, 2)), carries
    one_digit = sum(x < 10 for p in problems for x in p.meta["operands"]) / (3 * len(problems))
    assert 0.45 < one_digit < 0.55
    assert len({p.prompt for p in problems}) > 0.9 * len(problems)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("46+5=51", "51"),
        ("51", "51"),
        (" 46+5= 51 \n", "51"),
        ("-3", "-3"),
        ("1=2=3", "3"),
        ("46+5=", None),
        ("46+5=5 1", None),
        ("46+5=51x", None),
        ("", None),
        ("abc", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_bad_arguments_say_what_is_wrong():
    with pytest.raises(ValueError, match="unknown task 'nope'"):
        make_split("nope", "train", 1)
    with pytest.raises(ValueError, match="split must be one of"):
        make_split("sum3", "test", 1)
    with pytest.raises(ValueError, match="n must be >= 0"):
        make_split("sum3", "train", -1)
    assert make_split("sum3", "train", 0) == []
