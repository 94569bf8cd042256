"""Reward functions: plain functions from completions to scores.

The interface, which your own reward must follow to be used with `--reward my_pkg.my_mod:my_reward`:

    def reward_fn(completions: list[str], problems: list[Problem]) -> RewardResult

- `completions[i]` is the generated text only (no prompt, no EOS) and is graded against `problems[i]`
  (a `forkrl.data.tasks.Problem`; the gold answer is `problems[i].answer`). Both lists have the same length;
  a prompt sampled G times appears G times.
- `RewardResult.rewards[i]` is a float, or None to skip the sample (e.g. an ungradable gold answer): the
  trainer leaves skipped samples out of advantages and the loss.
- `RewardResult.counters` holds integer counts the trainer logs as they are (e.g. `timeouts`). Optional.
- The function runs in the trainer's process and must not hang; put slow or unsafe graders behind a
  process pool with a timeout, as `math_verify_reward` does.

Built in:
- `exact_match`: 1.0 when `tasks.extract_answer(completion)` equals the gold answer string, else 0.0. For
  the built-in tasks `sum3` and `add2`.
- `countdown`: 1.0 for any valid solution of a countdown problem (forkrl/data/countdown.py: each step's
  arithmetic right, each number used at most once, the target reached), else 0.0.
- `math_verify_reward`: the last `\\boxed{...}` of the completion (braces matched; under the prompt format
  dapo, the last "Answer:" line instead: forkrl/data/prompts.py), checked against the gold answer with
  math-verify, gold first (`verify` is not symmetric). Gold without `$` or `\\boxed` is read as inline math
  ("1+x" as "$1+x$"); gold that math-verify cannot parse gives None. Grading runs in a process pool:
  math-verify times out with SIGALRM, which works only in a main thread, and sympy can hang. An item past
  `timeout_s` scores 0 and is counted; the pool is then replaced, so a hung worker never blocks training.

`get_reward_fn("exact_match" | "countdown" | "math_verify" | "module:function")` resolves a name.
"""

from __future__ import annotations

import atexit
import concurrent.futures as cf
import functools
import importlib
import multiprocessing
import os
import threading
import time
from collections import deque
from collections.abc import Callable

from forkrl.data.answers import answer_line, extract_answer, last_boxed_only_string
from forkrl.data.countdown import countdown_reward
from forkrl.data.problem import Problem, RewardFn, RewardResult

DEFAULT_TIMEOUT_S = 15.0  # math-verify's own alarms are 5 s for parsing and 5 s for verifying
WARM_UP_TIMEOUT_S = 120  # math-verify's alarms while a new worker warms up (before any item's clock starts)




def _check_lengths(completions: list[str], problems: list[Problem]) -> None:
    if len(completions) != len(problems):
        raise ValueError(f"got {len(completions)} completions for {len(problems)} problems; they must pair")


def exact_match(completions: list[str], problems: list[Problem]) -> RewardResult:
    _check_lengths(completions, problems)
    rewards: list[float | None] = []
    no_answer = 0
    for completion, problem in zip(completions, problems, strict=True):
        pred = extract_answer(completion)
        no_answer += pred is None
        rewards.append(1.0 if pred is not None and pred == problem.answer.strip() else 0.0)
    return RewardResult(rewards, {"no_answer": no_answer})


# ---- math-verify, in worker processes ------------------------------------------------------------


@functools.lru_cache(maxsize=4096)
def _parse_gold(gold: str):  # runs in a worker
    from math_verify import parse

    if "$" in gold or "\\boxed" in gold:
        return parse(gold)
    # Bare gold answers are LaTeX without an anchor. Parsed as they are, math-verify reads "1+x" as 1
    # and "3\\sqrt{2}" as 3, so read them as inline math first.
    return parse(f"${gold}$") or parse(gold)


def _grade_math(gold: str, completion: str) -> tuple[float | None, str]:
    """(reward, outcome) for one sample; runs in a worker process (its main thread, so SIGALRM works)."""
    from math_verify import LatexExtractionConfig, parse, verify

    gold_parsed = _parse_gold(gold)
    if not gold_parsed:
        return None, "skipped"
    boxed = last_boxed_only_string(completion)
    if boxed is None:
        return 0.0, "no_boxed"
    config = LatexExtractionConfig(boxed_match_priority=0, try_extract_without_anchor=False)
    pred = parse(boxed, extraction_config=[config])
    if not pred:
        return 0.0, "unparsed"
    return (1.0 if verify(gold_parsed, pred) else 0.0), "graded"


def _warm_worker(grade_module: str, warm_math_verify: bool) -> None:
    """Everything a worker does once, before any item's clock starts: import the grade function's module and,
    for math-verify, grade one item, so its lazy set-up (sympy, the LaTeX parser, the extraction regexes) is not
    charged to the first real item, whose 5 s alarms a freshly spawned worker on a busy machine could miss. The
    warm-up's own alarms are far longer: it may take its time, it must not hang."""
    importlib.import_module(grade_module)
    if not warm_math_verify:
        return
    from math_verify import LatexExtractionConfig, parse, verify

    config = LatexExtractionConfig(boxed_match_priority=0, try_extract_without_anchor=False)
    verify(parse("$\\frac{1}{2}$", parsing_timeout=WARM_UP_TIMEOUT_S),
           parse("\\boxed{0.5}", extraction_config=[config], parsing_timeout=WARM_UP_TIMEOUT_S),
           timeout_seconds=WARM_UP_TIMEOUT_S)

    from forkrl.runtime import die_with

    die_with(os.getppid())  # a pool worker ends with the trainer, also when that was SIGKILLed


def _ready(delay_s: float) -> int:
    time.sleep(delay_s)
    return os.getpid()


class MathVerifyGrader:
    """A process pool that grades with math-verify; per-item timeout, hung workers replaced."""

    def __init__(
        self,
        max_workers: int | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        grade_fn: Callable[[str, str], tuple[float | None, str]] = _grade_math,
    ):
        self.grade_fn = grade_fn  # picklable (module-level); (gold, completion) -> (reward, outcome)
        self.startup_timeout_s = 120.0
        self.max_workers = max_workers or min(2, os.cpu_count() or 1)
        self.timeout_s = timeout_s
        self._pool: cf.ProcessPoolExecutor | None = None
        self._lock = threading.Lock()
        self.pools_started = 0

    def _get_pool(self) -> cf.ProcessPoolExecutor:
        if self._pool is None:
            # spawn, not fork: the parent holds torch/vLLM threads, which do not survive a fork
            self._pool = cf.ProcessPoolExecutor(
                self.max_workers, mp_context=multiprocessing.get_context("spawn"), initializer=_warm_worker,
                initargs=(self.grade_fn.__module__, self.grade_fn is _grade_math),
            )
            self.pools_started += 1
            self._wait_for_workers(self._pool)
        return self._pool

    def _wait_for_workers(self, pool: cf.ProcessPoolExecutor) -> None:
        """Return once every worker has started and warmed up (each answered a `_ready`), so process start-up
        (seconds on a busy machine) is never charged to an item's timeout. A worker that is up answers the
        `_ready`s while the others still start, so they are sent in rounds until every worker has answered."""
        deadline = time.monotonic() + self.startup_timeout_s
        pids: set[int] = set()
        while len(pids) < self.max_workers:
            ready = [pool.submit(_ready, 0.05) for _ in range(self.max_workers)]
            done, not_done = cf.wait(ready, timeout=max(0.0, deadline - time.monotonic()))
            try:
                pids |= {f.result() for f in done}
            except cf.process.BrokenProcessPool:
                not_done = not_done or done
            if not_done:
                self._recycle()
                raise RuntimeError(f"math-verify worker pool did not start within {self.startup_timeout_s} s")

    def _recycle(self) -> None:
        pool, self._pool = self._pool, None
        if pool is None:
            return
        for proc in list(getattr(pool, "_processes", {}).values()):  # only this pool's own workers
            proc.kill()
        pool.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True, cancel_futures=True)
                self._pool = None

    def grade(self, completions: list[str], golds: list[str], timeout_s: float | None = None) -> RewardResult:
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        rewards: list[float | None] = [0.0] * len(completions)
        counters = {"timeouts": 0, "skipped": 0, "no_boxed": 0, "unparsed": 0, "errors": 0}
        queue = deque(range(len(completions)))
        retried: set[int] = set()

        def collect(fut: cf.Future, i: int) -> bool:
            """Record a finished item; False when its worker died and the pool must be replaced."""
            try:
                reward, outcome = fut.result()
            except cf.process.BrokenProcessPool:
                # a worker died (e.g. killed for memory): give the item one more try in a new pool
                if i in retried:
                    counters["errors"] += 1
                else:
                    retried.add(i)
                    queue.appendleft(i)
                return False
            except Exception:
                counters["errors"] += 1
                return True
            rewards[i] = reward
            if outcome != "graded":
                counters[outcome] = counters.get(outcome, 0) + 1
            return True

        with self._lock:
            # At most one item per worker is in flight, so an item's clock starts when a worker takes it
            # (a queued item would otherwise time out behind a hung one).
            in_flight: dict[cf.Future, tuple[int, float]] = {}
            while queue or in_flight:
                pool = self._get_pool()
                while queue and len(in_flight) < self.max_workers:
                    i = queue.popleft()
                    in_flight[pool.submit(self.grade_fn, golds[i], completions[i])] = (i, time.monotonic())
                done, _ = cf.wait(in_flight, timeout=0.05, return_when=cf.FIRST_COMPLETED)
                healthy = True
                for fut in done:
                    healthy &= collect(fut, in_flight.pop(fut)[0])
                now = time.monotonic()
                timed_out = [f for f, (_, t0) in in_flight.items() if now - t0 > timeout_s]
                counters["timeouts"] += len(timed_out)  # scored 0
                for fut in timed_out:
                    del in_flight[fut]
                if timed_out or not healthy:
                    # the pool has a hung or dead worker: replace it; retry what was still in flight
                    for fut, (i, _) in in_flight.items():
                        if fut.done():
                            collect(fut, i)  # requeues the item itself if its worker died
                        else:
                            queue.appendleft(i)
                    in_flight.clear()
                    self._recycle()
        return RewardResult(rewards, counters)


_default_grader: MathVerifyGrader | None = None


def _grader() -> MathVerifyGrader:
    global _default_grader
    if _default_grader is None:
        _default_grader = MathVerifyGrader()
        atexit.register(_default_grader.close)
    return _default_grader


def math_verify_reward(
    completions: list[str], problems: list[Problem], timeout_s: float | None = None, answer: str = "boxed"
) -> RewardResult:
    """`answer`: where the completion's answer is: "boxed" (the last \\boxed{}) or "answer_line" (DAPO's last
    "Answer: ..." line, forkrl/data/prompts.py: read here, graded as if it were boxed; none scores 0 and is
    counted as `no_answer_line`)."""
    _check_lengths(completions, problems)
    golds = [p.answer for p in problems]
    if answer == "boxed":
        return _grader().grade(completions, golds, timeout_s=timeout_s)
    if answer != "answer_line":
        raise ValueError(f"answer must be boxed or answer_line, got {answer!r}")
    lines = [answer_line(c) for c in completions]
    has = [i for i, v in enumerate(lines) if v is not None]
    result = _grader().grade([f"\\boxed{{{lines[i]}}}" for i in has], [golds[i] for i in has], timeout_s=timeout_s)
    rewards: list[float | None] = [0.0] * len(completions)
    for i, r in zip(has, result.rewards, strict=True):
        rewards[i] = r
    return RewardResult(rewards, {**result.counters, "no_answer_line": len(completions) - len(has)})


BUILTIN_REWARDS: dict[str, RewardFn] = {
    "exact_match": exact_match,
    "countdown": countdown_reward,
    "math_verify": math_verify_reward,
}


def get_reward_fn(name: str) -> RewardFn:
    """`exact_match`, `countdown`, `math_verify`, or `package.module:function` for your own reward."""
    if name in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[name]
    if ":" not in name:
        raise ValueError(
            f"unknown reward {name!r}: use one of {', '.join(BUILTIN_REWARDS)} or 'package.module:function'"
        )
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"reward {name!r}: cannot import module {module_name!r}: {exc}") from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward {name!r}: module {module_name!r} has no callable {attr!r}")
    return fn
