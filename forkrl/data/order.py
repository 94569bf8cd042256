"""The training prompt order: deterministic and resumable from a cursor.

    order = DataOrder(problems, seed=3)              # or cursor=state["data_cursor"] on resume
    batch = order.take(32)                           # order.cursor counts the prompts taken so far

Epoch e walks a permutation of the problems seeded by (seed, e) (forkrl/seeds.py, frozen format), so a run
resumed at cursor c sees exactly the prompts an uninterrupted run sees from its c-th prompt on.
"""

from __future__ import annotations

import random

from forkrl.data.tasks import Problem
from forkrl.seeds import run_seed


class DataOrder:
    """Deterministic, resumable prompt order: epoch e walks a permutation seeded by (seed, e)."""

    def __init__(self, problems: list[Problem], seed: int, cursor: int = 0) -> None:
        self.problems, self.seed, self.cursor = problems, seed, cursor
        self._epoch, self._order = -1, []

    def take(self, k: int) -> list[Problem]:
        out = []
        n = len(self.problems)
        for _ in range(k):
            epoch, pos = divmod(self.cursor, n)
            perm = self._perm(epoch)
            out.append(self.problems[perm[pos]])
            self.cursor += 1
        return out

    def _perm(self, epoch: int) -> list[int]:
        if epoch != self._epoch:
            self._order = list(range(len(self.problems)))
            random.Random(run_seed("data", self.seed, epoch)).shuffle(self._order)
            self._epoch = epoch
        return self._order
