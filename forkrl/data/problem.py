"""The types every task and reward shares: a Problem (prompt, gold answer, extras), a TaskSpec (how a built-in
task samples problems, how long its answers are, and how its answer tokens are classed) and a RewardResult (what
a reward function returns). The other modules of forkrl/data import them from here, so forkrl/data has no import
cycle (tests/unit/test_layout.py checks it)."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

# Classes of answer tokens (`TaskSpec.label_chars`), for the kept-token breakdown (forkrl/training/metrics.py):
#   choice     a decision: which number or operator to use next (countdown)
#   computed   follows from earlier tokens by arithmetic: digits of a partial sum or a step's result
#   copied     repeats a number of the prompt where nothing is decided (sum3's third operand)
#   separator  "+", "=", "," between the parts the format fixes
#   eos        the end-of-sequence token
#   other      anything outside the task's format (malformed text from its first bad character on)
TOKEN_CLASSES = ("choice", "computed", "copied", "separator", "eos", "other")


@dataclass
class Problem:
    """One prompt and its gold answer. `meta` holds task-specific extras; built-in tasks put the reference
    completion (used for the supervised warm start) under "completion"."""

    prompt: str
    answer: str
    meta: dict = field(default_factory=dict)


@dataclass(frozen=True)
class TaskSpec:
    name: str
    description: str
    max_new_tokens: int  # enough for the longest reference completion plus EOS
    sample: Callable[[random.Random], Problem]
    reward: str = "exact_match"  # the run's reward when none is given (forkrl/data/rewards.py names)
    # one class (TOKEN_CLASSES) per character of a completion (without EOS), for any text the model writes
    label_chars: Callable[[Problem, str], list[str]] | None = None
    classes: tuple[str, ...] = ()  # the classes label_chars can give, plus "eos": the breakdown's rows


@dataclass
class RewardResult:
    """What a reward function returns (forkrl/data/rewards.py): one reward per completion (None: skip the sample,
    e.g. an ungradable gold answer) and integer counters the trainer logs as they are (e.g. `timeouts`)."""

    rewards: list[float | None]
    counters: dict[str, int] = field(default_factory=dict)

    @property
    def timeouts(self) -> int:
        return self.counters.get("timeouts", 0)


RewardFn = Callable[[list[str], list[Problem]], RewardResult]
"""A reward function: (completions, their problems) -> RewardResult."""
