"""`countdown`: reach a target from given numbers, writing each operation and its result. A task with real forks.

    prompt      "3 7 4->25:"
    completion  "7*3=21,21+4=25"      (then EOS)
    answer      "25"

Each step is `a<op>b=r` with op one of + - *, operands and results non-negative integers without leading
zeros, steps separated by ",". A step may use a given number or an earlier step's result, each at most once
(a result is a new number in the pool; using it consumes it). The reward (`countdown_reward`) is 1.0 when
every step parses, each operand is available, each result is right and the last result is the target;
any solution counts, not only the reference. Which numbers and which operator to take are the decisions
("choice" tokens); a step's result digits follow from them ("computed"); "=" and "," are fixed by the format
("separator"); see `label_chars`.

Problems: three numbers 1-9 (repeats allowed) and a target made by combining all three in two random steps
(a-b only with a >= b; target >= 1), so every problem is solvable; the reference completion is that solution.
Deterministic for a given random.Random (forkrl/data/tasks.py seeds it per task, split and seed).
"""

from __future__ import annotations

import random
import re
from collections import Counter

from forkrl.data.problem import Problem, RewardResult, TaskSpec

OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
_STEP_RE = re.compile(r"(0|[1-9]\d*)([+\-*])(0|[1-9]\d*)=(0|[1-9]\d*)")
_PROMPT_RE = re.compile(r"(\d+(?: \d+)*)->(\d+):")
OUTCOMES = ("correct", "malformed", "unavailable_number", "wrong_arithmetic", "wrong_target")


def _combine(rng: random.Random, a: int, b: int) -> tuple[int, str, int, int]:
    """A random valid step on a and b: (left, op, right, result), non-negative."""
    op = rng.choice("+-*")
    if op == "-" and a < b:
        a, b = b, a
    elif op != "-" and rng.random() < 0.5:
        a, b = b, a
    return a, op, b, OPS[op](a, b)


def sample_countdown(rng: random.Random) -> Problem:
    while True:
        numbers = [rng.randint(1, 9) for _ in range(3)]
        i, j = rng.sample(range(3), 2)
        k = 3 - i - j
        a1, op1, b1, r1 = _combine(rng, numbers[i], numbers[j])
        a2, op2, b2, r2 = _combine(rng, r1, numbers[k])
        if r2 >= 1:
            break
    completion = f"{a1}{op1}{b1}={r1},{a2}{op2}{b2}={r2}"
    return Problem(
        prompt=f"{' '.join(map(str, numbers))}->{r2}:",
        answer=str(r2),
        meta={"task": "countdown", "completion": completion, "numbers": numbers, "target": r2},
    )


def parse_prompt(prompt: str) -> tuple[list[int], int] | None:
    """(numbers, target) of a countdown prompt, or None."""
    m = _PROMPT_RE.fullmatch(prompt.strip())
    return ([int(x) for x in m.group(1).split()], int(m.group(2))) if m else None


def check_solution(text: str, numbers: list[int], target: int) -> str:
    """The outcome of one completion (one of OUTCOMES); "correct" is the only one that scores."""
    steps = text.strip().split(",")
    parsed = [_STEP_RE.fullmatch(s) for s in steps]
    if not text.strip() or not all(parsed):
        return "malformed"
    pool = Counter(numbers)
    result = None
    for m in parsed:
        a, op, b, result = int(m.group(1)), m.group(2), int(m.group(3)), int(m.group(4))
        for x in (a, b):
            if pool[x] <= 0:
                return "unavailable_number"
            pool[x] -= 1
        if OPS[op](a, b) != result:
            return "wrong_arithmetic"
        pool[result] += 1
    return "correct" if result == target else "wrong_target"


def problem_numbers(problem: Problem) -> tuple[list[int], int] | None:
    meta = problem.meta
    if "numbers" in meta and "target" in meta:
        return list(meta["numbers"]), int(meta["target"])
    return parse_prompt(problem.prompt)  # e.g. a countdown problem read back from JSONL


def countdown_reward(completions: list[str], problems: list[Problem]) -> RewardResult:
    """1.0 for a correct solution, else 0.0; None when the problem is not a countdown problem. Counters: the
    count of each failing outcome (malformed, unavailable_number, wrong_arithmetic, wrong_target)."""
    if len(completions) != len(problems):
        raise ValueError(f"got {len(completions)} completions for {len(problems)} problems; they must pair")
    rewards: list[float | None] = []
    counters = {k: 0 for k in OUTCOMES if k != "correct"}
    for text, problem in zip(completions, problems, strict=True):
        spec = problem_numbers(problem)
        if spec is None:
            rewards.append(None)
            counters["skipped"] = counters.get("skipped", 0) + 1
            continue
        outcome = check_solution(text, *spec)
        rewards.append(1.0 if outcome == "correct" else 0.0)
        if outcome != "correct":
            counters[outcome] += 1
    return RewardResult(rewards, counters)


def label_chars(problem: Problem, text: str) -> list[str]:
    """One class per character of `text` (any text, also malformed or cut off): operand digits and the
    operator are "choice", "=" and "," are "separator", result digits "computed"; from the first character
    that breaks the `a<op>b=r[,...]` format on, "other"."""
    labels: list[str] = []
    part, digits = "a", 0  # the part of the step being read: left operand, right operand, result
    for i, ch in enumerate(text):
        if ch.isdigit():
            labels.append("computed" if part == "r" else "choice")
            digits += 1
        elif digits and part == "a" and ch in OPS:
            labels.append("choice")
            part, digits = "b", 0
        elif digits and part == "b" and ch == "=":
            labels.append("separator")
            part, digits = "r", 0
        elif digits and part == "r" and ch == ",":
            labels.append("separator")
            part, digits = "a", 0
        else:
            return labels + ["other"] * (len(text) - i)
    return labels


SPEC = TaskSpec(
    name="countdown",
    description="reach the target from 3 numbers (1-9), each at most once, writing each step: "
    "3 7 4->25: 7*3=21,21+4=25",
    max_new_tokens=16,  # "9*9=81,81*9=729" + EOS
    sample=sample_countdown,
    reward="countdown",
    label_chars=label_chars,
    classes=("choice", "computed", "separator", "eos", "other"),
)
