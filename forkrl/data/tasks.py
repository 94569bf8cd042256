"""Built-in synthetic tasks with a verifiable answer, used by the embedded tiny model.

`countdown` (the default; forkrl/data/countdown.py) is a task with real forks: reach a target from three
numbers, writing each step:

    prompt      "3 7 4->25:"
    completion  "7*3=21,21+4=25"      (then EOS)
    answer      "25"

Which numbers and which operator to use are decisions ("choice" tokens), the results follow from them
("computed"). Its reward is `countdown` (any valid solution scores). It became the default because RL learns
more on it at the same budget (docs/embedded-default.md, docs/results.md) and because its forks are decisions.

`sum3` is a three-number sum written out with its partial result (`47+85+6=` → `132+6=138`, answer `138`):
a short chain of computed tokens, almost nothing to decide. The prototype's two-number sum (`add2`, kept for
small tests) had answers two or three tokens long, which leaves the top-20% entropy mask almost nothing to
choose from (tiny-rl-notes.md).

Every task labels its answer tokens (`token_classes`: choice, computed, copied, separator, eos, other) so
that training can show which classes the forking-token mask keeps (forkrl/training/metrics.py).

Splits are disjoint by construction: a problem belongs to `eval` when a hash of its prompt falls in a
fixed 10% bucket, to `train` otherwise, whatever the seed. Generation is deterministic for a given
(task, split, n, seed); problems are drawn i.i.d., so a prompt may repeat within a split.

    from forkrl.data.tasks import make_split, extract_answer
    problems = make_split("sum3", "eval", 256, seed=0)
"""

from __future__ import annotations

import hashlib
import itertools
import random
from collections.abc import Iterator, Sequence

from forkrl.data import countdown
from forkrl.data.answers import extract_answer
from forkrl.data.problem import TOKEN_CLASSES, Problem, TaskSpec

__all__ = [
    "DEFAULT_TASK", "SPLITS", "TASKS", "TOKEN_CLASSES", "Problem", "TaskSpec", "extract_answer", "get_task",
    "iter_problems", "make_split", "split_of", "token_classes",
]

DEFAULT_TASK = "countdown"
SPLITS = ("train", "eval")
EVAL_BUCKETS = 10  # one bucket in ten is the eval split



def _operand(rng: random.Random) -> int:
    # one or two digits with equal chance: easy and hard problems both appear often
    return rng.randint(0, 9) if rng.random() < 0.5 else rng.randint(10, 99)


def _carries(x: int, y: int) -> int:
    n, carry = 0, 0
    while x or y:
        carry = int(x % 10 + y % 10 + carry >= 10)
        n += carry
        x, y = x // 10, y // 10
    return n


def _sample_sum3(rng: random.Random) -> Problem:
    a, b, c = _operand(rng), _operand(rng), _operand(rng)
    s1, s2 = a + b, a + b + c
    return Problem(
        prompt=f"{a}+{b}+{c}=",
        answer=str(s2),
        meta={
            "task": "sum3",
            "completion": f"{s1}+{c}={s2}",
            "operands": [a, b, c],
            "carries": _carries(a, b) + _carries(s1, c),
        },
    )


def _sample_add2(rng: random.Random) -> Problem:
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    return Problem(
        prompt=f"{a}+{b}=",
        answer=str(a + b),
        meta={"task": "add2", "completion": str(a + b), "operands": [a, b], "carries": _carries(a, b)},
    )


def _label_parts(text: str, parts: Sequence[tuple[str, str]]) -> list[str]:
    """Classes of the characters of `text` read as numbers separated by the given characters in order:
    parts[i] = (class of the digits of number i, the separator after it, "" for the last). From the first
    character that breaks that format on, "other"."""
    labels: list[str] = []
    part, digits = 0, 0
    for i, ch in enumerate(text):
        digit_class, sep = parts[part]
        if ch.isdigit():
            labels.append(digit_class)
            digits += 1
        elif digits and sep and ch == sep:
            labels.append("separator")
            part, digits = part + 1, 0
        else:
            return labels + ["other"] * (len(text) - i)
    return labels


def _label_sum3(problem: Problem, text: str) -> list[str]:
    """"132+6=138": partial and final sum digits "computed", the repeated operand "copied", "+" "=" separators."""
    return _label_parts(text, (("computed", "+"), ("copied", "="), ("computed", "")))


def _label_add2(problem: Problem, text: str) -> list[str]:
    return _label_parts(text, (("computed", ""),))


TASKS: dict[str, TaskSpec] = {
    "sum3": TaskSpec(
        name="sum3",
        description="three 1-2 digit numbers summed with the partial result written out: 47+85+6=132+6=138",
        max_new_tokens=11,  # "198+99=297" + EOS
        sample=_sample_sum3,
        label_chars=_label_sum3,
        classes=("computed", "copied", "separator", "eos", "other"),
    ),
    "add2": TaskSpec(
        name="add2",
        description="two-digit addition, answer only: 47+85=132",
        max_new_tokens=4,  # "198" + EOS
        sample=_sample_add2,
        label_chars=_label_add2,
        classes=("computed", "eos", "other"),
    ),
    "countdown": countdown.SPEC,
}


def get_task(task: str) -> TaskSpec:
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; built-in tasks: {', '.join(sorted(TASKS))}")
    return TASKS[task]


def split_of(task: str, prompt: str) -> str:
    """The split a prompt belongs to, from a hash of the prompt (not Python's salted `hash`)."""
    digest = hashlib.sha256(f"{task}\x00{prompt}".encode()).digest()
    return "eval" if int.from_bytes(digest[:8], "big") % EVAL_BUCKETS == 0 else "train"


def iter_problems(task: str, split: str, seed: int = 0) -> Iterator[Problem]:
    """An endless, deterministic stream of `task` problems from `split`, drawn independently from the
    task's distribution restricted to that split (so easy problems repeat as often as they should)."""
    spec = get_task(task)
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    # str seeds go through sha512 in `random`: stable across processes and Python versions
    rng = random.Random(f"forkrl:{task}:{split}:{seed}")
    while True:
        problem = spec.sample(rng)
        if split_of(task, problem.prompt) == split:
            yield problem


def make_split(task: str, split: str, n: int, seed: int = 0) -> list[Problem]:
    """The first `n` problems of `iter_problems(task, split, seed)`. Problems are i.i.d., so a prompt can
    repeat within a split; a prompt never appears in both splits."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    return list(itertools.islice(iter_problems(task, split, seed), n))


def token_classes(problem: Problem, token_texts: Sequence[str | None]) -> list[str] | None:
    """The class (TOKEN_CLASSES) of each completion token of a built-in task's problem, None for any other
    problem (a dataset's). `token_texts[i]` is token i's decoded text, None for the end-of-sequence token
    (class "eos"). Blanks are left out before labelling (a tokenizer's leading spaces change no role); a token
    takes the class of its first non-blank character (one character per token for the tiny model's
    tokenizer); a blank token is "other"."""
    spec = TASKS.get(problem.meta.get("task", ""))
    if spec is None or spec.label_chars is None:
        return None
    text = "".join(ch for t in token_texts if t is not None for ch in t if not ch.isspace())
    chars = spec.label_chars(problem, text)
    out, pos = [], 0
    for t in token_texts:
        if t is None:
            out.append("eos")
            continue
        n = sum(not ch.isspace() for ch in t)
        out.append(chars[pos] if n else "other")
        pos += n
    return out
