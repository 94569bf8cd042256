"""The countdown task (forkrl/data/countdown.py): the verifier on hand-made cases, token classes, and the
deterministic generator; plus the token classes of sum3/add2 and the task registry."""

from __future__ import annotations

import random

import pytest

from forkrl.data.countdown import (
    check_solution,
    countdown_reward,
    label_chars,
    parse_prompt,
    problem_numbers,
    sample_countdown,
)
from forkrl.data.problem import TOKEN_CLASSES
from forkrl.data.rewards import BUILTIN_REWARDS, exact_match, get_reward_fn
from forkrl.data.tasks import DEFAULT_TASK, TASKS, Problem, get_task, make_split, token_classes
from forkrl.training.config import RunConfig
from forkrl.training.preflight import resolve

NUMS, TARGET = [3, 7, 4], 25


def _problem(numbers=NUMS, target=TARGET) -> Problem:
    return Problem(f"{' '.join(map(str, numbers))}->{target}:", str(target),
                   {"task": "countdown", "numbers": numbers, "target": target})


@pytest.mark.parametrize(
    ("text", "outcome"),
    [
        ("7*3=21,21+4=25", "correct"),
        ("3*7=21,4+21=25", "correct"),  # operand order is free
        ("7*4=28,28-3=25", "correct"),  # any valid solution, not only the reference
        (" 7*3=21,21+4=25\n", "correct"),  # surrounding whitespace
        ("7*3=21,21+4=26", "wrong_arithmetic"),
        ("7*3=20,20+5=25", "wrong_arithmetic"),  # the first wrong result fails the step
        ("3+3=6,6*4=24", "unavailable_number"),  # 3 given once, used twice
        ("7*3=21,21+21=42", "unavailable_number"),  # a result is consumed when used
        ("5*5=25", "unavailable_number"),  # not a given number
        ("7*3=21,21+3=24", "unavailable_number"),
        ("7+4=11", "wrong_target"),
        ("7*4=28,28-4=24", "unavailable_number"),
        ("7*3=21,21-4=17", "wrong_target"),
        ("", "malformed"),
        ("25", "malformed"),
        ("7*3=21,", "malformed"),
        ("7x3=21", "malformed"),
        ("7*3=21, 21+4=25", "malformed"),  # no blank inside
        ("07*3=21,21+4=25", "malformed"),  # no leading zeros
        ("3-7=-4", "malformed"),  # results are non-negative
        ("7*3=21,21+4=25,", "malformed"),
        ("7*3", "malformed"),
    ],
)
def test_check_solution(text, outcome):
    assert check_solution(text, NUMS, TARGET) == outcome


def test_repeated_given_numbers_may_each_be_used_once():
    assert check_solution("3*3=9,9+4=13", [3, 3, 4], 13) == "correct"
    assert check_solution("3*3=9,9+3=12", [3, 3, 4], 12) == "unavailable_number"
    assert check_solution("0+3=3", [3, 0, 1], 3) == "correct"  # 0 is a number like any other


def test_reward_scores_counts_and_skips():
    texts = ["7*3=21,21+4=25", "7*3=21,21+4=26", "3+3=6", "7+4=11", "nope", "7*3=21,21+4=25"]
    probs = [_problem()] * 5 + [Problem("1+2=", "3", {"task": "sum3"})]
    result = countdown_reward(texts, probs)
    assert result.rewards == [1.0, 0.0, 0.0, 0.0, 0.0, None]
    assert result.counters == {"malformed": 1, "unavailable_number": 1, "wrong_arithmetic": 1, "wrong_target": 1,
                               "skipped": 1}
    with pytest.raises(ValueError, match="must pair"):
        countdown_reward(texts, probs[:2])
    assert get_reward_fn("countdown") is countdown_reward is BUILTIN_REWARDS["countdown"]


def test_problems_read_back_from_their_prompt():
    # a countdown problem without meta (e.g. written to JSONL) is still gradable
    assert parse_prompt("3 7 4->25:") == ([3, 7, 4], 25)
    assert parse_prompt("3 7 4 ->25:") is None and parse_prompt("47+85+6=") is None
    assert problem_numbers(Problem("3 7 4->25:", "25")) == ([3, 7, 4], 25)
    assert countdown_reward(["7*3=21,21+4=25"], [Problem("3 7 4->25:", "25")]).rewards == [1.0]


def test_generator_is_deterministic_and_its_references_are_valid():
    a = [sample_countdown(random.Random(5)) for _ in range(3)]
    assert a == [sample_countdown(random.Random(5)) for _ in range(3)]
    problems = make_split("countdown", "train", 3000, seed=0) + make_split("countdown", "eval", 500, seed=0)
    assert make_split("countdown", "train", 3000, seed=0) == problems[:3000]
    for p in problems:
        numbers, target = p.meta["numbers"], p.meta["target"]
        assert p.prompt == f"{' '.join(map(str, numbers))}->{target}:" and p.answer == str(target) >= "0"
        assert len(numbers) == 3 and all(1 <= x <= 9 for x in numbers) and target >= 1
        assert check_solution(p.meta["completion"], numbers, target) == "correct"
        assert p.meta["completion"].count(",") == 1  # two steps, all three numbers
        assert len(p.meta["completion"]) + 1 <= TASKS["countdown"].max_new_tokens
    assert len("9*9=81,81*9=729") + 1 == TASKS["countdown"].max_new_tokens
    # the eval set must not drift between versions
    assert [p.prompt for p in make_split("countdown", "eval", 4, seed=0)] == [
        "3 2 1->5:", "9 8 2->90:", "9 7 4->8:", "7 2 7->2:"]
    assert len({p.prompt for p in make_split("countdown", "train", 5000, seed=0)}) > 2500
    # exact match would grade only the reference: the task's reward accepts any solution
    p = make_split("countdown", "eval", 1, seed=0)[0]
    assert countdown_reward(["3+2=5,5*1=5"], [p]).rewards == [1.0]
    assert exact_match(["3+2=5,5*1=5"], [p]).rewards == [1.0]  # same final number, but ...
    assert exact_match(["5"], [p]).rewards == [1.0] and countdown_reward(["5"], [p]).rewards == [0.0]


def test_registered_as_the_default_task():
    assert DEFAULT_TASK == "countdown" and get_task("countdown").reward == "countdown"
    assert get_task("sum3").reward == get_task("add2").reward == "exact_match"
    assert resolve(RunConfig(task="countdown")).reward == "countdown"
    assert resolve(RunConfig(task="countdown")).max_new_tokens == 16
    assert resolve(RunConfig()).reward == "countdown" and resolve(RunConfig()).task == "countdown"
    assert resolve(RunConfig(task="sum3")).reward == "exact_match"
    assert resolve(RunConfig(task="countdown", reward="exact_match")).reward == "exact_match"


# ---- token classes ---------------------------------------------------------------------------------------

C, K, S, X = "choice", "computed", "separator", "other"


@pytest.mark.parametrize(
    ("text", "labels"),
    [
        ("7*3=21,21+4=25", [C, C, C, S, K, K, S, C, C, C, C, S, K, K]),
        ("7*3=2", [C, C, C, S, K]),  # cut off: labelled as far as it goes
        ("7*3=2x1", [C, C, C, S, K, X, X]),  # from the first bad character on: other
        ("*3=21", [X] * 5),  # an operator before any digit
        ("7*=21", [C, C, X, X, X]),
        ("7*3=21,,", [C, C, C, S, K, K, S, X]),
        ("", []),
    ],
)
def test_countdown_char_labels(text, labels):
    assert label_chars(_problem(), text) == labels


def test_token_classes_of_every_task():
    cd = _problem()
    assert token_classes(cd, [*"7*3=21", None]) == [C, C, C, S, K, K, "eos"]
    # a token takes its first non-blank character's class; a blank one is other
    assert token_classes(cd, ["7*", "3", "=21", ",", None]) == [C, C, S, S, "eos"]
    assert token_classes(cd, [" 7", "*3", " ", None]) == [C, C, X, "eos"]
    sum3 = make_split("sum3", "eval", 1, seed=0)[0]  # 0+9+58= -> 9+58=67
    assert token_classes(sum3, [*"9+58=67", None]) == [K, S, "copied", "copied", S, K, K, "eos"]
    assert token_classes(sum3, [*"9+5", "8", "x", None]) == [K, S, "copied", "copied", X, "eos"]
    assert token_classes(sum3, [*"9=", None]) == [K, X, "eos"]
    add2 = make_split("add2", "eval", 1, seed=0)[0]
    assert token_classes(add2, [*"105", None]) == [K, K, K, "eos"]
    assert token_classes(add2, [*"1+", None]) == [K, X, "eos"]
    assert token_classes(Problem("What is 2+2?", "4"), ["4", None]) is None  # a dataset problem: no classes


@pytest.mark.parametrize("task", sorted(TASKS))
def test_labels_stay_within_the_task_classes(task):
    spec = TASKS[task]
    assert set(spec.classes) <= set(TOKEN_CLASSES) and "eos" in spec.classes and "other" in spec.classes
    rng = random.Random(0)
    for p in make_split(task, "train", 200, seed=0):
        ref = p.meta["completion"]
        noisy = "".join(rng.choice("0123456789+-*=, x") if rng.random() < 0.2 else ch for ch in ref)
        for text in (ref, noisy, ref[: rng.randint(0, len(ref))]):
            labels = token_classes(p, [*text, None])
            assert len(labels) == len(text) + 1 and set(labels) <= set(spec.classes)
        assert "other" not in token_classes(p, [*ref, None])  # a reference is in the format
