"""Async rollouts with bounded staleness: the next rollout batches are sampled while the trainer trains.

    batches = AheadCollector(lambda step: collect_batch(...), first_step=1, last_step=100, max_staleness=1)
    for step in range(1, 101):
        scored = batches.get(step)          # blocks until step's batch is sampled (or re-raises its error)
        ... train, push version v+1 ...
        batches.done(step)                  # lets the collector start step + 1 + max_staleness
    batches.close()

The rule (algorithms.md §3.8): a trajectory sampled by policy version v may be trained at trainer version V
only if V − v ≤ k. The collector starts sampling step s only once the trainer has finished step s − 1 − k
(trained it and pushed the weights, or skipped it): at that point the rollout serves at least the version
the trainer held when step s − 1 − k ended, and at most k more pushes happen before step s is trained (one
per step), so every trajectory of step s is at most k versions old when it is trained. A rollout service in
swap mode "inplace" (its default) applies a push between two engine steps and lets the samples in flight
continue under the new weights: such a trajectory reports `policy_version` = the version served when it was
submitted (the oldest of its tokens') and `last_policy_version`; the bound uses the oldest, and the behaviour
correction uses the engine's per-token log-probs, each from the weights that sampled it. k = 0 is the
sync loop: sample step s only after step s − 1 pushed. The trainer still checks every batch against the rule
(`staleness`) and drops a batch that breaks it (something else pushed weights), counting it.

Every batch records the data cursor after its prompts were drawn (`cursor`), so a checkpoint stores the
cursor of the last *trained* batch, not of the batches sampled ahead: a resumed run draws the prompts of the
next step again and loses or repeats no step.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

__all__ = ["AheadCollector", "staleness"]


def staleness(trainer_version: int, trajectories: list[Any]) -> list[int]:
    """V − v per trajectory (v = the policy version it was sampled with)."""
    return [trainer_version - int(t.policy_version) for t in trajectories]


class AheadCollector:
    """Samples the batches of steps first_step..last_step on its own thread, at most max_staleness steps ahead
    of the trainer (module docstring). `collect(step)` returns the step's batch; it runs on that thread."""

    def __init__(self, collect: Callable[[int], Any], first_step: int, last_step: int, max_staleness: int) -> None:
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        self._collect, self._k = collect, max_staleness
        self._first, self._last = first_step, last_step
        self._cond = threading.Condition()
        self._done = first_step - 1  # the last step the trainer finished
        self._ready: dict[int, Any] = {}
        self._error: BaseException | None = None
        self._closed = False
        self.started: list[tuple[int, int]] = []  # (step, trainer's last finished step) when sampling began
        self._thread = threading.Thread(target=self._run, name="ahead-collector", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for step in range(self._first, self._last + 1):
                with self._cond:
                    self._cond.wait_for(lambda s=step: self._closed or self._done >= s - 1 - self._k)
                    if self._closed:
                        return
                    self.started.append((step, self._done))
                batch = self._collect(step)
                with self._cond:
                    self._ready[step] = batch
                    self._cond.notify_all()
        except BaseException as err:  # handed to the trainer by get()
            with self._cond:
                self._error = err
                self._cond.notify_all()

    def get(self, step: int) -> Any:
        """The batch of `step` (blocks until it is sampled); re-raises an error of the collecting thread."""
        with self._cond:
            self._cond.wait_for(lambda: step in self._ready or self._error is not None or self._closed)
            if step in self._ready:
                return self._ready.pop(step)
            if self._error is not None:
                raise RuntimeError(f"sampling the batch of step {step} failed: {self._error}") from self._error
            raise RuntimeError("the collector is closed")

    def done(self, step: int) -> None:
        """The trainer finished `step` (trained and pushed, or skipped): sampling may move on."""
        with self._cond:
            self._done = max(self._done, step)
            self._cond.notify_all()

    def in_flight(self) -> int:
        """Batches sampled or being sampled that the trainer has not taken."""
        with self._cond:
            return len(self._ready) + (1 if self._thread.is_alive() and not self._closed else 0)

    def close(self, timeout_s: float | None = None) -> None:
        """Stop after the batch being sampled (it is discarded, as every batch not taken)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout_s)
