"""The benchmark metrics of `python -m forkrl.eval`, per problem and per benchmark.

For one problem with n graded samples of which c are correct (reward > 0):
- avg@n = c / n, the mean accuracy over the samples (the paper's avg@16: n = 16 at T = 1);
- pass@k = 1 - C(n-c, k) / C(n, k), the unbiased estimator of "at least one of k samples is correct" (Chen et al.
  2021, arXiv 2107.03374, Eq. 1), for k <= n; exact in integers (math.comb), then one division;
- maj@k: the answers of the first k samples (as the reward reads them: forkrl.data.prompts.final_answer) vote;
  the most frequent wins (a tie goes to the answer that reached the count first); maj@k is 1 when a sample with
  the winning answer was graded correct, 0 otherwise or when no sample gave an answer. None when the reward's
  answer cannot be read here (a custom reward).
A benchmark's value is the mean over its problems; a problem whose gold answer the reward cannot grade
(reward None on every sample) is left out and counted (`n_skipped`).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n-c, k) / C(n, k): the probability that k samples drawn without replacement from the n contain a
    correct one."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def maj_at_k(answers: Sequence[str | None], correct: Sequence[bool], k: int) -> float:
    """1.0 when the most frequent answer among the first k samples is one a correct sample gave."""
    votes = Counter(a for a in answers[:k] if a is not None)
    if not votes:
        return 0.0
    top = max(votes.values())
    winner = next(a for a in answers[:k] if a is not None and votes[a] == top)  # first to reach the top count
    return 1.0 if any(a == winner and ok for a, ok in zip(answers[:k], correct[:k], strict=True)) else 0.0


@dataclass
class ProblemResult:
    """The samples of one problem on one checkpoint."""

    rewards: list[float | None]
    answers: list[str | None]  # as the reward reads them; None: none given (or unknown for a custom reward)
    lengths: list[int]  # response tokens
    truncated: list[bool]  # cut at max_new_tokens without an EOS
    extra: dict = field(default_factory=dict)

    @property
    def gradable(self) -> bool:
        return any(r is not None for r in self.rewards)

    @property
    def correct(self) -> list[bool]:
        return [r is not None and r > 0 for r in self.rewards]

    def metrics(self, ks: Sequence[int], with_maj: bool) -> dict[str, float]:
        n, c = len(self.rewards), sum(self.correct)
        out = {f"avg@{n}": c / n}
        for k in ks:
            out[f"pass@{k}"] = pass_at_k(n, c, k)
            if with_maj:
                out[f"maj@{k}"] = maj_at_k(self.answers, self.correct, k)
        return out


def aggregate(problems: Sequence[ProblemResult], ks: Sequence[int], with_maj: bool) -> dict[str, float | int]:
    """A benchmark's row: every metric's mean over its gradable problems, their count, the skipped ones, the mean
    response length and the truncated fraction."""
    graded = [p for p in problems if p.gradable]
    out: dict[str, float | int] = {"n_problems": len(graded), "n_skipped": len(problems) - len(graded)}
    if graded:
        per = [p.metrics(ks, with_maj) for p in graded]
        for key in per[0]:
            out[key] = sum(m[key] for m in per) / len(per)
    lengths = [x for p in problems for x in p.lengths]
    out["response_len_mean"] = sum(lengths) / len(lengths) if lengths else 0.0
    out["truncated_frac"] = sum(t for p in problems for t in p.truncated) / max(len(lengths), 1)
    return out
