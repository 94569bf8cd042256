"""Problems for training and evaluation: the built-in synthetic task, or real math data from JSONL.

One JSON object per line (blank lines are skipped). Accepted field names:
- prompt: `prompt`, `question` or `problem`. A chat-style prompt (a list of {"role", "content"}) becomes
  the content of its last user message.
- answer: `answer`, `solution`, `ground_truth`, or verl's nested `reward_model.ground_truth`. A GSM8K
  answer ("... #### 1,234") becomes the number after `####` ("1234"); an answer holding a `\\boxed{...}`
  (a MATH solution) becomes the content of its last box. Numbers are turned into strings.

Splits: a JSONL file is split like the built-in tasks, by a hash of the prompt (one prompt in ten goes to
`eval`), so train and eval never share a prompt. To use separate files instead, put `{split}` in the
path (`data/{split}.jsonl`); each file is then used whole for its split.

    from forkrl.data.datasets import load_problems
    problems = load_problems(task=None, dataset="gsm8k.jsonl", split="train", n=1024, seed=0)
"""

from __future__ import annotations

import json
import os
import random
import re
from pathlib import Path
from typing import Any

from forkrl.data.rewards import last_boxed_only_string, remove_boxed
from forkrl.data.tasks import DEFAULT_TASK, SPLITS, Problem, make_split, split_of

DATASET_ENV = "RL_DATASET_PATH"
PROMPT_FIELDS = ("prompt", "question", "problem")
ANSWER_FIELDS = ("answer", "solution", "ground_truth")

_GSM8K_RE = re.compile(r"####\s*(.+?)\s*$", re.DOTALL)


def _prompt_text(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(m, dict) for m in value):
        users = [m.get("content") for m in value if m.get("role") == "user"]
        if users and isinstance(users[-1], str):
            return users[-1]
        raise ValueError(f"{where}: chat-style prompt has no user message with string content")
    kind = type(value).__name__
    raise ValueError(f"{where}: prompt must be a string or a list of {{role, content}}, got {kind}")


def normalize_answer(value: Any) -> str:
    """GSM8K `#### 42` -> "42"; a `\\boxed{x}` solution -> "x"; numbers -> str; whitespace stripped."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise TypeError(f"answer must be a string or a number, got {type(value).__name__}")
    text = str(value).strip()
    match = _GSM8K_RE.search(text)
    if match:
        return match.group(1).replace(",", "").replace("$", "").strip()
    boxed = last_boxed_only_string(text)
    if boxed is not None:
        return remove_boxed(boxed).strip()
    return text


def _record_to_problem(record: Any, where: str, meta: dict) -> Problem:
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    prompt_key = next((k for k in PROMPT_FIELDS if k in record), None)
    if prompt_key is None:
        raise ValueError(f"{where}: no prompt field; accepted names: {', '.join(PROMPT_FIELDS)}")
    answer = next((record[k] for k in ANSWER_FIELDS if k in record), None)
    if answer is None and isinstance(record.get("reward_model"), dict):
        answer = record["reward_model"].get("ground_truth")
    if answer is None:
        raise ValueError(
            f"{where}: no answer field; accepted names: {', '.join(ANSWER_FIELDS)}, reward_model.ground_truth"
        )
    prompt = _prompt_text(record[prompt_key], where)
    try:
        gold = normalize_answer(answer)
    except TypeError as exc:
        raise ValueError(f"{where}: {exc}") from exc
    if not prompt.strip() or not gold:
        raise ValueError(f"{where}: empty prompt or answer")
    return Problem(prompt=prompt, answer=gold, meta=meta)


def load_jsonl(path: str | os.PathLike | None = None) -> list[Problem]:
    """Every problem in a JSONL file, in file order. `path` defaults to $RL_DATASET_PATH."""
    if path is None:
        path = os.environ.get(DATASET_ENV)
        if not path:
            raise ValueError(f"no dataset path given and ${DATASET_ENV} is not set")
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"dataset file not found: {path}")
    problems = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: malformed JSON: {exc.msg} (column {exc.colno})") from None
            problems.append(_record_to_problem(record, where, {"source": str(path), "line": lineno}))
    if not problems:
        raise ValueError(f"dataset {path} is empty")
    return problems


def _take(pool: list[Problem], n: int | None, seed: int) -> list[Problem]:
    """A seeded shuffle of `pool`, reshuffled and repeated until there are `n`; all once when n is None."""
    if n is None:
        n = len(pool)
    out: list[Problem] = []
    epoch = 0
    while len(out) < n:
        order = list(pool)
        random.Random(f"forkrl:data:{seed}:{epoch}").shuffle(order)
        out.extend(order[: n - len(out)])
        epoch += 1
    return out


def load_problems(
    task: str | None = None,
    dataset: str | None = None,
    split: str = "train",
    n: int | None = None,
    seed: int = 0,
) -> list[Problem]:
    """`n` problems of `split` from the built-in `task` or from the JSONL `dataset`.

    With neither given: $RL_DATASET_PATH if set, else the default task. For a dataset, `n=None` means
    every problem of the split once; a larger `n` cycles through it in a new seeded order each pass.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if task and dataset:
        raise ValueError("task and dataset are mutually exclusive: give one")
    if not task and not dataset:
        dataset = os.environ.get(DATASET_ENV) or None
        task = None if dataset else DEFAULT_TASK
    if task:
        if n is None:
            raise ValueError("n is required for a built-in task (its problems are generated)")
        return make_split(task, split, n, seed)
    assert dataset is not None
    if "{split}" in dataset:
        pool = load_jsonl(dataset.format(split=split))
    else:
        pool = [p for p in load_jsonl(dataset) if split_of("jsonl", p.prompt) == split]
        if not pool:
            raise ValueError(
                f"dataset {dataset} has no {split} problems (hash split: 1 prompt in 10 is eval)"
            )
    return _take(pool, n, seed)
