"""Reward functions: exact match, boxed extraction, math-verify in a process pool, timeouts, lookup."""

import time

import pytest

from forkrl.data.answers import last_boxed_only_string, remove_boxed
from forkrl.data.rewards import MathVerifyGrader, RewardResult, exact_match, get_reward_fn, math_verify_reward
from forkrl.data.tasks import Problem


def problems(*answers):
    return [Problem(prompt="q", answer=a) for a in answers]


def test_exact_match_scores_the_extracted_answer():
    result = exact_match(
        ["46+5=51", "46+5=52", "51", "garbage", " 46+5=51\n"], problems("51", "51", "51", "51", "51")
    )
    assert result.rewards == [1.0, 0.0, 1.0, 0.0, 1.0]
    assert result.counters == {"no_answer": 1}
    with pytest.raises(ValueError, match="2 completions for 1 problems"):
        exact_match(["1", "2"], problems("1"))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so \\boxed{42}.", "\\boxed{42}"),
        ("\\boxed{1} then \\boxed{\\frac{1}{2}} end", "\\boxed{\\frac{1}{2}}"),
        ("\\boxed{\\sqrt{x^{2}}}", "\\boxed{\\sqrt{x^{2}}}"),
        ("$\\boxed 5$ done", "\\boxed 5"),
        ("\\fbox{7}", "\\fbox{7}"),
        ("\\boxed{unclosed", None),
        ("no box here", None),
        ("\\boxed", None),
    ],
)
def test_last_boxed_only_string(text, expected):
    assert last_boxed_only_string(text) == expected


def test_remove_boxed():
    assert remove_boxed("\\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert remove_boxed("\\boxed 5") == "5"
    assert remove_boxed("\\fbox{7}") == "7"
    with pytest.raises(ValueError):
        remove_boxed("42")


@pytest.fixture(scope="module")
def grader():
    g = MathVerifyGrader(max_workers=1)
    yield g
    g.close()


def test_math_verify_grades_equivalent_forms(grader):
    completions = [
        "So the answer is \\boxed{\\frac{1}{2}}.",  # same value as gold 0.5
        "First \\boxed{3}, no wait: \\boxed{4}",  # the last box counts
        "\\boxed{5}",  # wrong
        "The answer is 4.",  # no box: wrong, counted
        "\\boxed{x+1}",  # bare LaTeX gold "1+x"
        "\\boxed{3}",  # bare gold "3\\sqrt{2}" must not be read as 3
        "\\boxed{3\\sqrt{2}}",
        "\\boxed{7}",  # gold that math-verify cannot parse: skipped
    ]
    golds = ["0.5", "4", "4", "4", "1+x", "3\\sqrt{2}", "3\\sqrt{2}", "\\text{}"]
    result = grader.grade(completions, golds)
    assert result.rewards == [1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 1.0, None]
    assert result.counters["no_boxed"] == 1
    assert result.counters["skipped"] == 1
    assert result.timeouts == 0


def test_math_verify_reward_function_interface():
    result = math_verify_reward(["\\boxed{12}", "\\boxed{13}"], problems("12", "12"))
    assert isinstance(result, RewardResult)
    assert result.rewards == [1.0, 0.0]
    with pytest.raises(ValueError, match="must pair"):
        math_verify_reward(["\\boxed{12}"], problems("12", "12"))


def sleepy_grade(gold: str, completion: str):
    """A grader that hangs on "hang" (runs in a worker process; module-level so it pickles)."""
    if completion == "hang":
        time.sleep(3600)
    return (1.0 if completion == gold else 0.0), "graded"


HANG_BUDGET_S = 10.0  # per item: a hang exceeds it; a dict lookup in a started, warmed-up worker never does


@pytest.mark.slow
@pytest.mark.timeout(600)  # liveness, not speed: without the per-item timeout this call sleeps for an hour
def test_hung_worker_times_out_scores_zero_and_the_pool_is_replaced():
    """Two hung items take both workers; the three behind them wait in the queue for longer than the per-item
    budget, then are graded in a new pool: an item's clock starts when a worker takes it, and a hang costs only
    its own item. No good item races a short budget: the workers are started and warmed up (the grade function's
    module imported) before any clock starts, and the budget is one only a hang exceeds."""
    grader = MathVerifyGrader(max_workers=2, timeout_s=HANG_BUDGET_S, grade_fn=sleepy_grade)
    try:
        result = grader.grade(["hang", "hang", "1", "2", "9"], ["1", "2", "1", "2", "3"])
        assert result.rewards == [0.0, 0.0, 1.0, 1.0, 0.0]
        assert result.timeouts == 2
        assert grader.pools_started >= 2
        # the grader keeps working after the recycle
        assert grader.grade(["4"], ["4"]).rewards == [1.0]
    finally:
        grader.close()


def test_get_reward_fn():
    assert get_reward_fn("exact_match") is exact_match
    assert get_reward_fn("math_verify") is math_verify_reward
    assert get_reward_fn("forkrl.data.rewards:exact_match") is exact_match
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        get_reward_fn("nope")
    with pytest.raises(ValueError, match="cannot import module 'no_such_module_xyz'"):
        get_reward_fn("no_such_module_xyz:f")
    with pytest.raises(ValueError, match="has no callable 'missing'"):
        get_reward_fn("forkrl.data.rewards:missing")
